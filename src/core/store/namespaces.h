// Namespaces: the namespace table (format.h, "Namespace entry") and its lock
// (SharedWords.ns_lock). One namespace per model/KV layout (and TP rank). Owns the table's
// protocol — open (find by name, else create under the lock), the listing, the breaking of a lock
// whose holder can never release it — and what else changes under that lock: tenants' quota rows
// and quota limits (format/quota.h; the rows themselves are read and written by Quotas). It knows
// no Pool: Pool forwards to it (pool.h), and it asks the node side back only through Peers.
//
// Invariants it keeps (format.h states them; namespaces.cpp implements them):
// - Keys of different namespaces never alias: the namespace id seeds the index hash and is
//   compared on every lookup, and each chunk belongs to exactly one namespace, so block geometry
//   is fixed per chunk.
// - An entry is created by one writer: the one that claims its state word FREE -> CREATING under
//   the namespace-table lock; it writes every field, writes them back and publishes READY last.
//   A dead creator's CREATING entry is freed by whoever reclaims it (release_of_node).
//   A READY entry is immutable (readers need no lock), but its bytes are untrusted: a READY entry
//   whose block size no writer could have stored is not listed (`pool check` reports it).
// - A name is opened only with the layout it was created with (fingerprint and every field),
//   else LayoutMismatchError: the layout decides the bytes, so it decides what may be shared.
// - The namespace-table lock is held by one node id at a time, for a bounded time (3 leases, then
//   LockTimeoutError), and released however the work under it ends; quota rows change only under
//   it. A holder id out of range or naming a FREE node slot is broken (break_stale_lock); a dead
//   holder's lock is released by whoever reclaims it (release_of_node).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "layout.h"
#include "quotas.h"
#include "region.h"
#include "store_types.h"

namespace cxlkv {

class Namespaces {
 public:
  // The node side, asked only on slow paths (a lock not free, an observer about to write).
  class Peers {
   public:
    // Reclaims the nodes judged dead (nodes.cpp); returns how many.
    virtual uint64_t reap_dead_nodes() = 0;
    // A row-less observer (multihost) takes a row and, if one is free, a node slot before it
    // writes (host_slot.cpp); a no-op for any other attachment. node_id reads non-zero afterwards
    // if it got a slot.
    virtual void become_writer() = 0;

   protected:
    ~Peers() = default;
  };

  // path: the pool's path, for messages. node_id, read_only, observer: who this attachment is
  // (1-based node id, 0 = not attached; opened read-only; opened with attach=false), owned and
  // changed by the node side (open, attach, detach, become_writer); read here, never written.
  Namespaces(Region& region, Quotas& quotas, const std::string& path, const uint32_t& node_id,
             const bool& read_only, const bool& observer, Peers& peers)
      : region_(region),
        coh_(region.coh()),
        quotas_(quotas),
        path_(path),
        node_id_(node_id),
        read_only_(read_only),
        observer_(observer),
        peers_(peers) {}

  // The namespace named want.name: found with the same layout, or created (under the lock).
  // ReadOnlyError for a read-only pool or an observer; ArgumentError for a bad name or layout;
  // LayoutMismatchError, NamespaceTableFullError, LockTimeoutError.
  NsHandle open(const Layout& want);
  // The READY namespaces, by id, each with its layout as stored.
  std::vector<std::pair<NsHandle, Layout>> list();
  std::vector<NsHandle> handles();  // list()'s handles (Allocator::Peers::namespace_handles)
  // Breaks the namespace-table lock when its holder id is out of range or names a FREE node slot
  // (a holder that can never release it). Returns the stale holder id, 0 if nothing was broken.
  uint64_t break_stale_lock();
  // Step 4 of the reclaim of node `dead` (nodes.cpp holds its slot RECLAIMING): the table's lock
  // if it holds it, and the entries it was creating (CREATING -> FREE).
  void release_of_node(uint8_t dead);

  // --- quotas (format/quota.h): naming a tenant and setting a limit, under the lock ----------
  // The row of tenant `tenant`, created (under the namespace-table lock) on first use; 1-based.
  uint8_t tenant_row(const std::string& tenant);
  // Sets the limit of a namespace (ns_id, tenant "") or a tenant (ns_id 0): max_bytes and/or
  // max_ppm of the arena, 0 = none (both 0 clears it). Returns the row.
  uint32_t set_quota(uint32_t ns_id, const std::string& tenant, uint64_t max_bytes, uint32_t max_ppm);

 private:
  // fn under the namespace-table lock, bounded (LockTimeoutError ends with nothing_done).
  void with_lock(const char* nothing_done, const std::function<void()>& fn);
  // fn under the lock as a quota writer: refuses a read-only pool, takes a node slot for an
  // observer; the cached quota rows are dropped afterwards.
  void with_quota_lock(const std::function<void()>& fn);
  const format::PoolHeader& hdr() const { return *region_.header(); }

  Region& region_;
  Coherence& coh_;  // region_'s (one owner: the region; reassigned there for the multihost arbiter)
  Quotas& quotas_;
  const std::string& path_;
  const uint32_t& node_id_;
  const bool& read_only_;
  const bool& observer_;
  Peers& peers_;
};

}  // namespace cxlkv
