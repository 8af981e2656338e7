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
// OS-level failures carry errno so the binding can raise FileNotFoundError, PermissionError...
struct OsError : Error {
  int err;
  OsError(int e, const std::string& what) : Error(what), err(e) {}
};
// This attachment may have been declared dead by a peer (multihost fencing: a pause past the
// lease, or its node slot reclaimed): it publishes nothing more; open the pool again.
struct FencedError : Error {
  using Error::Error;
};
// multihost: a live attachment of another host (or of a build that cannot share rows) uses this
// host slot: a row of the lock area belongs to one host (its processes share it).
struct HostSlotBusyError : Error {
  using Error::Error;
};
// Caller passed a bad argument (wrong key length, buffer too small...): Python ValueError.
struct ArgumentError : Error {
  using Error::Error;
};

}  // namespace cxlkv
