// Error types of the core. Each maps to one Python exception class (src/python/bindings.cpp).
// Rule: a bad pool is reported with an exception that names the path and what is wrong; it never
// leads to a wild memory access.
#pragma once
#include <stdexcept>
#include <string>

namespace cxlkv {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Not a cxlkv pool: bad magic, header checksum mismatch, impossible geometry.
struct FormatError : Error {
  using Error::Error;
};
// A cxlkv pool this build cannot use: newer major version, unknown incompat feature, other stamp.
struct VersionError : Error {
  using Error::Error;
};
// The file or device is smaller than the header says.
struct TruncatedError : Error {
  using Error::Error;
};
// The pool was never completely initialized (creator died, or is still running).
struct NotReadyError : Error {
  using Error::Error;
};
// An offset or state read from the pool failed its bounds check during an operation.
struct CorruptError : Error {
  using Error::Error;
};
struct LayoutMismatchError : Error {
  using Error::Error;
};
struct NodeTableFullError : Error {
  using Error::Error;
};
struct NamespaceTableFullError : Error {
  using Error::Error;
};
// All quota rows (format/quota.h: tenants and namespace quotas) are in use.
struct QuotaTableFullError : Error {
  using Error::Error;
};
// OS-level failures carry errno so the binding can raise FileNotFoundError, PermissionError...
struct OsError : Error {
  int err;
  OsError(int e, const std::string& what) : Error(what), err(e) {}
};
// This attachment may have been declared dead by a peer, so it publishes nothing more: its node
// slot was reclaimed (judged dead, or `pool reap --force`), a co-tenant changed its state word, or
// (multihost) its heartbeat lapsed past half a lease (a pause: GC, SIGSTOP, VM migration). Every
// way a node learns it was fenced throws this one type with the one message of fenced_error().
// Recovery: close the pool and open it again (a new node); the connector does it by itself.
struct FencedError : Error {
  using Error::Error;
};
// `where`: "pool PATH: node N" (or empty). The one message of FencedError.
inline FencedError fenced_error(const std::string& where) {
  return FencedError((where.empty() ? std::string() : where + ": ") +
                     "this node was fenced (reclaimed by a peer, reaped by force, or its heartbeat "
                     "lapsed past half a lease): it stores nothing more; close the pool and open it again");
}
// multihost: a live attachment of another host (or of a build that cannot share rows) uses this
// host slot: a row of the lock area belongs to one host (its processes share it).
struct HostSlotBusyError : Error {
  using Error::Error;
};
// multihost: a cross-host lock did not come free within its bound (a few leases): a ticket or
// tier-1 word that keeps a live-looking holder yet never moves (a stray write, or a host stalled
// while its heartbeat runs). The message names the stripe, the row and what was seen there; the
// operation fails, nothing is lost, and `cxlkv pool check --repair` clears what no host owns.
struct LockTimeoutError : Error {
  using Error::Error;
};
// --- Misuse of a pool handle: one type per condition, so callers branch on the type ---
// The pool was used after close() (Python: cxlkv.ClosedError, also a RuntimeError, the one type
// for every cxlkv object used after its close()).
struct ClosedError : Error {
  using Error::Error;
};
// destroy (or create --force) refused: live processes are attached to the pool.
struct PoolInUseError : Error {
  using Error::Error;
};
// A call that writes the pool on a handle opened to look only: read-only, or as an observer
// (attach=false, no node).
struct ReadOnlyError : Error {
  using Error::Error;
};
// The attachment was inherited through fork(): the child must open the pool again (its node,
// heartbeat and locks belong to the parent).
struct ForkedError : Error {
  using Error::Error;
};
// Caller passed a bad argument (wrong key length, buffer too small...): Python ValueError.
struct ArgumentError : Error {
  using Error::Error;
};

}  // namespace cxlkv
