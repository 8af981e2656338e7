// NodeTable (node_table.h): the liveness verdict on one node slot, moved unchanged from Pool.
#include "node_table.h"

namespace cxlkv {

using namespace format;

NodeInfo NodeTable::judge(uint32_t idx, uint64_t w, uint32_t self_id, uint64_t self_word) {
  const PoolHeader& h = *region_.header();
  const Coherence& coh = region_.coh();
  NodeInfo n;
  n.id = idx + 1;
  n.state = node_state(w);
  n.epoch = node_epoch(w);
  n.lease_ms = h.lease_ms;
  if (n.state == kNodeFree) return n;
  NodeSlot* s = region_.node_slot(idx);
  coh.invalidate(s, sizeof *s);
  n.pid = s->pid, n.pid_ns = s->pid_ns, n.attach_unix_ns = s->attach_unix_ns;
  n.beat = coh.read(&s->beat);
  n.beat_unix_ns = s->beat_unix_ns;
  if (n.state == kNodeAlive) n.host_slot1 = s->host_slot, n.observer = (s->flags & kNodeObserver) != 0;
  if (n.state == kNodeAlive) n.intents = coh.read(&region_.node_fixed(idx)->intents);
  if (self_id == idx + 1 && w == self_word) {
    n.self = n.same_kernel = n.lock_held = true;
    n.verdict = NodeInfo::kAlive;
    n.evidence = "this attachment";
    return n;
  }
  // L1 applies only if we can see its lock: same kernel and same inode (and a working lock).
  n.same_kernel = lock_.lock_id != 0 && node_domain(w) == domain_ &&
                  (n.state != kNodeAlive || (s->host_id == host_id_ && s->lock_id == lock_.lock_id));
  if (n.same_kernel) {
    n.lock_held = liveness::lock_held_by_other(lock_, lock_offset(idx));
    n.verdict = n.lock_held ? NodeInfo::kAlive : NodeInfo::kDead;
    n.evidence = n.lock_held ? "lock held (same kernel)" : "lock free: its process is gone (same kernel)";
    return n;
  }
  // L2: lease, on this judge's monotonic clock.
  Watch& wt = watch_[idx];
  uint64_t now = liveness::mono_ns();
  bool moved = wt.valid && (wt.word != w || wt.beat != n.beat);
  if (!wt.valid || moved) wt = Watch{w, n.beat, now, true, moved};
  n.silent_ms = (now - wt.since_ns) / 1'000'000;
  if (n.silent_ms >= h.lease_ms) {
    n.verdict = NodeInfo::kDead;
    n.evidence = "heartbeat silent for " + std::to_string(n.silent_ms) + " ms >= lease (another kernel)";
  } else if (wt.moved) {
    // Seen to beat, and silent for less than a lease since: alive (a judge that asks again
    // between two beats must not fall back to "undecided").
    n.verdict = NodeInfo::kAlive;
    n.evidence = "heartbeat advancing (another kernel)";
  } else {
    n.verdict = NodeInfo::kUndecided;
    n.evidence = "another kernel: heartbeat observed for " + std::to_string(n.silent_ms) + " of " +
                 std::to_string(h.lease_ms) + " ms";
  }
  return n;
}

std::vector<NodeInfo> NodeTable::verdicts(uint32_t self_id, uint64_t self_word) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<NodeInfo> out;
  for (uint32_t i = 0; i < region_.header()->max_nodes; ++i) {
    uint64_t w = region_.coh().read(&region_.node_slot(i)->state);
    if (node_state(w) != kNodeFree) out.push_back(judge(i, w, self_id, self_word));
  }
  return out;
}

bool NodeTable::any_dead(uint32_t self_id, uint64_t self_word) {
  std::lock_guard<std::mutex> g(mu_);
  for (uint32_t i = 0; i < region_.header()->max_nodes; ++i) {
    uint64_t w = region_.coh().read(&region_.node_slot(i)->state);
    if (node_state(w) != kNodeFree && judge(i, w, self_id, self_word).verdict == NodeInfo::kDead) return true;
  }
  return false;
}

// Serialized with the reaper: judge() updates this judge's lease watches.
bool NodeTable::gone(uint8_t node, uint32_t self_id, uint64_t self_word) {
  if (node == 0 || node > region_.header()->max_nodes) return true;
  if (node == self_id) return false;
  std::lock_guard<std::mutex> g(mu_);
  uint64_t w = region_.coh().read(&region_.node_slot(node - 1)->state);
  if (node_state(w) == kNodeFree) return true;
  return judge(node - 1, w, self_id, self_word).verdict == NodeInfo::kDead;
}

bool NodeTable::incarnation_alive(uint8_t node, uint8_t epoch8) const {
  if (node == 0 || node > region_.header()->max_nodes) return false;
  uint64_t w = region_.coh().read(&region_.node_slot(node - 1)->state);
  uint8_t st = node_state(w);
  return (st == kNodeAlive || st == kNodeClaimed) && uint8_t(node_epoch(w)) == epoch8;
}

}  // namespace cxlkv
