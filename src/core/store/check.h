// Checker: `pool check` (check.cpp: the run, nodes, namespaces, pins, quotas, the lock area's
// findings; check_blocks.cpp: index entries, chunks and block descriptors). Recomputes every
// invariant of format.h from the pool itself and, with repair, releases what nobody else ever
// will. It knows no Pool: it is handed the Region, the store's owning types it reads and repairs
// through (Index, Quotas, Namespaces), the node table's reads (NodeTable) and who this attachment
// is; it asks the node side back only through Peers (reap, an emulated host's beat, the reclaims
// to report, the intent cap, the lock area's check). Pool::check forwards to it.
//
// What a check keeps (check.cpp and check_blocks.cpp implement it):
// - The pool is untrusted input: a check only reads it through the Region's bounds-checked
//   accessors and snapshots, and a finding is evidence (slot, block, node, epoch, state) in one line.
// - Nothing a live node may cause in passing is an error: a finding about a WRITING, EVICTING or
//   READY entry, or a block no entry points to, counts only if it is unchanged after a pause
//   (pause_before_reread); a chunk changing hands is skipped, its blocks counted once it is ACTIVE.
// - Accounting: capacity == free + ready + in flight + condemned + leaked blocks, else an error.
// - Repair releases only what nobody else ever would, each on evidence re-read after the pause,
//   through the owner's own release (Index::release_abandoned, Index::reclaim_condemned, a claim
//   of the block descriptor, Quotas::book); never what a live node holds. Without repair a check
//   frees only what any attached node may (condemned entries no pin holds) and breaks only a
//   namespace-table lock nobody can release.
// - A node a check could not judge (another kernel, lease not watched long enough) makes it fail:
//   it never calls the pool consistent without having judged every node.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "index.h"
#include "lock_check.h"
#include "namespaces.h"
#include "node_table.h"
#include "quotas.h"
#include "region.h"
#include "store_types.h"

namespace cxlkv {

// What a check found, and with `repair` what it fixed. Each section of Checker::run reads `repair`
// here and adds to the rest. The Python binding turns it into `pool check`'s dict (bindings.cpp).
struct CheckReport {
  bool repair = false;  // input: also fix what can be fixed safely (`pool check --repair`)
  bool ok = true;       // no error: nothing found, or everything found was repaired
  std::vector<std::string> errors, warnings;
  std::vector<std::string> repaired;  // one line per repair made
  uint64_t reclaimed_nodes = 0;
  uint64_t capacity_blocks = 0, free_blocks = 0, ready_blocks = 0, inflight_blocks = 0;
  uint64_t condemned_blocks = 0;  // CONDEMNED entries whose block is still USED
  uint64_t leaked_blocks = 0, stuck_entries = 0, orphan_pins = 0, duplicate_keys = 0;
  uint64_t free_chunks = 0, active_chunks = 0;
  // multihost lock area (lock_check.cpp): tickets and tier-1 words found, by kind, and what a
  // repair reset
  LockFindings lock;
  uint64_t undecided_nodes = 0;      // nodes of another kernel not judged within a lease
  uint64_t intents = 0;              // block-less intents (WRITING entries without a block) found
  uint64_t intent_cap = 0;           // the per-node cap of them (Pool::intent_cap)
  uint64_t nodes_at_intent_cap = 0;  // nodes holding their cap (warning) or more (error)
  void error(const std::string& what) {
    ok = false;
    if (errors.size() < 100) errors.push_back(what);
  }
  void fixed(const std::string& what) {
    if (repaired.size() < 100) repaired.push_back(what);
  }
};

class Checker {
 public:
  // The node side (Pool): what a check needs that only the attachment has.
  class Peers {
   public:
    // A row-less observer (multihost) takes a row and, if one is free, a node slot before it
    // repairs (repairing is writing; host_slot.cpp); a no-op for any other attachment.
    virtual void become_writer() = 0;
    // One pass of the node table's judge reclaiming the dead (nodes.cpp); *undecided: nodes of
    // another kernel it could not judge yet. Returns how many were reclaimed.
    virtual uint64_t reap_for_check(uint64_t* undecided) = 0;
    // While a check waits for a lease to pass: an emulated host beats from the checking thread
    // (a real attachment's heartbeat thread beats by itself: a no-op).
    virtual void beat_while_watching() = 0;
    // Nodes this attachment reclaimed since it opened the pool or since the last call (F20).
    virtual uint64_t take_reclaimed() = 0;
    // The cap on block-less intents per node (the creator's share of the index).
    virtual uint64_t intent_cap_per_node() = 0;
    // The cross-host lock area's check (nodes/lock_check.h) into r, run with this attachment's
    // view of the lock; false when the pool has no lock area (r untouched).
    virtual bool check_lock_area(LockReport& r) = 0;

   protected:
    ~Peers() = default;
  };

  // node_id, read_only: who this attachment is (1-based node id, 0 = not attached; opened
  // read-only), owned by the node side; read at each use, since a repairing observer may take a
  // node slot during the check (become_writer).
  Checker(Region& region, Index& index, Quotas& quotas, Namespaces& namespaces, const NodeTable& nodes,
          const uint32_t& node_id, const bool& read_only, Peers& peers)
      : region_(region),
        coh_(region.coh()),
        index_(index),
        quotas_(quotas),
        namespaces_(namespaces),
        nodes_(nodes),
        node_id_(node_id),
        read_only_(read_only),
        peers_(peers) {}

  // The whole check (after reaping the dead, watching nodes of another kernel for up to watch_ms:
  // 0 = not at all, < 0 = a lease and a quarter); with repair, also the releases listed above.
  CheckReport run(bool repair, int64_t watch_ms);

 private:
  using NsById = std::map<uint32_t, NsHandle>;  // the listed namespaces, by id
  // The sections of run(), in order; each adds to r and, with r.repair, repairs (check.cpp).
  void watch_undecided_nodes(CheckReport& r, int64_t watch_ms);
  void check_ns_lock(CheckReport& r);
  void check_namespaces(CheckReport& r);
  void check_index(CheckReport& r);  // check_entries, then check_blocks (check_blocks.cpp)
  void check_quotas(CheckReport& r);
  void check_pins(CheckReport& r);
  void check_lock_area(CheckReport& r);  // LockCheck's LockReport merged into r
  // check_blocks.cpp: entries (states, references, probe window, duplicates, intents against the
  // cap, stuck entries), then chunks and block descriptors with the accounting.
  void check_entries(CheckReport& r, const NsById& ns);
  void report_intents(CheckReport& r, const std::vector<uint64_t>& intents_of);
  void check_blocks(CheckReport& r, const NsById& ns);

  bool node_attached(uint8_t node);  // CLAIMED or ALIVE (not judged: a dead one is reaped first)
  void entry_ref(uint64_t slot, uint64_t* chunk, uint64_t* block);  // its block, read afresh
  bool snapshot(uint64_t slot, uint64_t word, format::IndexEntry* out) const {
    return region_.snapshot(slot, word, out);
  }
  const format::PoolHeader& hdr() const { return *region_.header(); }
  uint64_t slot_mask() const { return region_.slot_mask(); }
  uint64_t desc_bytes() const { return region_.desc_bytes(); }
  format::IndexEntry* entry(uint64_t slot) const { return region_.entry(slot); }
  uint64_t* block_desc(uint64_t chunk, uint32_t block) const { return region_.block_desc(chunk, block); }

  Region& region_;
  Coherence& coh_;  // region_'s (one owner: the region; reassigned there for the multihost arbiter)
  Index& index_;
  Quotas& quotas_;
  Namespaces& namespaces_;
  const NodeTable& nodes_;
  const uint32_t& node_id_;
  const bool& read_only_;
  Peers& peers_;
};

}  // namespace cxlkv
