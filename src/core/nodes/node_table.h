// NodeTable: this attachment as a judge of the node table's liveness (format.h: L1-L5 beside
// NodeSlot; liveness.h: the primitives). Owns the judge's identity on this kernel (host id, the
// pool's lock file, the domain tag written into node words), its lease observations of every
// slot, and the lock that serialises judging and reclaiming in this process. Gives one verdict
// per slot with its evidence, and the reads built on it (verdicts, any_dead, gone,
// incarnation_alive). Acting on a verdict (claiming a dead slot, reclaiming what it held) is
// Attachment's (attachment.h), which is handed this judge.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "liveness.h"
#include "region.h"

namespace cxlkv {

// One node slot as a judge sees it (`pool info`, `pool reap`): the verdict and its evidence.
struct NodeInfo {
  uint32_t id = 0;    // node id (slot + 1)
  uint8_t state = 0;  // format::NodeState
  uint32_t epoch = 0;
  uint64_t pid = 0, pid_ns = 0, attach_unix_ns = 0, beat = 0, beat_unix_ns = 0;
  bool self = false;         // this attachment
  bool same_kernel = false;  // judged by the kernel lock (same host_id and lock file)
  bool lock_held = false;    // same_kernel only: someone holds the slot's lock
  uint64_t silent_ms = 0;    // lease only: how long this judge has seen (state, beat) unchanged
  uint64_t lease_ms = 0;
  uint64_t host_slot1 = 0;  // multihost: the node's row + 1 (0: none); as published, display only
  bool observer = false;    // an observer's node (format::kNodeObserver): check, stats, reap
  uint64_t intents = 0;     // block-less intents it holds (NodeAreaFixed.intents, as published)
  enum Verdict { kFree, kAlive, kDead, kUndecided } verdict = kFree;
  std::string evidence;  // one line, e.g. "lock held (same kernel)"
};

class NodeTable {
 public:
  explicit NodeTable(const Region& region) : region_(region) {}

  // The judge's identity, set once at open (Pool::validate_and_attach) and cleared at close.
  uint64_t& host_id() { return host_id_; }
  liveness::LockFile& lock_file() { return lock_; }
  uint32_t& domain() { return domain_; }
  // One reclaim at a time per lock descriptor; judge() and forget() need it held (watch_).
  std::mutex& mu() { return mu_; }
  // Forgets every lease observation (a fresh judge of max_nodes slots).
  void reset_watches(uint32_t max_nodes) { watch_.assign(max_nodes, Watch{}); }
  void forget(uint32_t idx) { watch_[idx].valid = false; }

  // The byte of the pool file locked for slot idx (L1). Locks live beyond any data (locks need
  // no bytes) in a 256-byte range per host id, so simulated hosts (CXLKV_HOST_ID) on one kernel
  // do not see each other's locks, exactly as separate kernels would not.
  uint64_t lock_offset(uint32_t idx) const { return (1ull << 48) + (host_id_ & 0xFFFFF) * 256 + idx; }

  // Judges slot idx, whose state word was read as w; self_id/self_word: this attachment's node id
  // (0: none) and node word. Caller holds mu().
  NodeInfo judge(uint32_t idx, uint64_t w, uint32_t self_id, uint64_t self_word);

  // The table as this judge sees it now (each takes mu()): every slot that is not FREE with its
  // verdict (`pool info`); whether any is judged dead (a row-less observer becomes a writer before
  // it reclaims one); whether node `node` (1-based) can no longer finish what it started (its slot
  // is FREE or judged dead; any out-of-range id is gone). self_id, self_word: as for judge().
  std::vector<NodeInfo> verdicts(uint32_t self_id, uint64_t self_word);
  bool any_dead(uint32_t self_id, uint64_t self_word);
  bool gone(uint8_t node, uint32_t self_id, uint64_t self_word);
  // Whether node `node` is attached now (CLAIMED or ALIVE) in the incarnation whose epoch ends in
  // epoch8. A read of its word, no judging.
  bool incarnation_alive(uint8_t node, uint8_t epoch8) const;

 private:
  struct Watch {  // lease observations of this judge, per slot
    uint64_t word = 0, beat = 0, since_ns = 0;
    bool valid = false;
    bool moved = false;  // seen to change at least once: alive until silent for a lease
  };
  const Region& region_;
  uint64_t host_id_ = 0;
  liveness::LockFile lock_;
  uint32_t domain_ = 0;
  std::mutex mu_;
  std::vector<Watch> watch_;
};

}  // namespace cxlkv
