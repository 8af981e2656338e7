// Attachment (attachment.h), the node table side: attaching, detaching, the heartbeat, telling
// dead peers apart, and reclaiming what they held.
//
// Liveness (who is dead) is judged by liveness.h's primitives, never by pids or hostnames: see the
// invariants L1-L5 beside NodeSlot in format.h.
//
// A process that dies without close() leaves: its node slot, pins in its area, index entries in
// WRITING/EVICTING owned by it, block descs it claimed, a CARVING chunk, maybe the ns_lock or a
// CREATING namespace. Whoever notices first (attach, a failed allocation, `pool check`) claims the
// dead slot (ALIVE -> RECLAIMING, one winner), undoes each of those, and frees the slot. Every
// step is idempotent, so a reclaimer that dies half-way is itself reclaimed and the work redone.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "attachment.h"
#include "clock.h"
#include "errors.h"

namespace cxlkv {

using namespace format;

namespace {
uint64_t pid_ns_inode() {
  struct stat st;
  return ::stat("/proc/self/ns/pid", &st) == 0 ? uint64_t(st.st_ino) : 0;
}
}  // namespace

void Attachment::open(bool attach) {
  const bool multihost = hdr_->backend == uint32_t(Backend::multihost);
  observer_ = !attach;
  // An observer takes no node slot, and on the multihost backend no row either, until it has
  // something to write (become_writer, host_slot.cpp "Observers"): looking never costs a host
  // its attach. Reclaiming dead nodes is writing: a row-less observer leaves it to `pool check`.
  if (multihost && !attach) {
    row_less_ = true;
    row_less_arbiter_ = std::make_unique<RowLessArbiter>("pool " + path_);
    coh_ = Coherence(Backend::multihost, id_.model, row_less_arbiter_.get());
    return;
  }
  if (multihost) setup_arbiter(id_.emulated ? id_.emulated_slot : id_.want_slot, false);
  reap_dead_nodes();
  if (attach) attach_node(false);
  if (multihost) settle_host_slot(false);
}

bool Attachment::heartbeat_tick() {
  // One beat at a time: a beat's own coherence calls may reach a point where the emulator ticks
  // again (two writers of the heartbeat line would break its one-writer rule).
  if (beating_.exchange(true, std::memory_order_acquire)) return true;
  struct Done {
    std::atomic<bool>& b;
    ~Done() { b.store(false, std::memory_order_release); }
  } done{beating_};
  if (!region_.base() || !node_id_) {  // not attached yet: nobody can declare us dead
    last_beat_ns_.store(liveness::mono_ns(), std::memory_order_release);
    return true;
  }
  return liveness::beat(node_slot(node_id_ - 1), node_word_, coh_.unarbitrated(), &fenced_, &last_beat_ns_,
                        bakery_ ? uint64_t(hdr_->lease_ms) * 1'000'000 / 2 : 0);
}

void Attachment::abandon() {
  fenced_.store(true, std::memory_order_release);
  liveness::stop_heartbeat(heartbeat_);
  heartbeat_ = 0;
  node_id_ = 0;
}

void Attachment::attach_node(bool observer) {
  const uint64_t lease_ns = uint64_t(hdr_->lease_ms) * 1'000'000;
  const uint64_t deadline = liveness::mono_ns() + lease_ns + lease_ns / 4;
  for (;;) {
    // Not attached yet: nobody can declare us dead, so the fence starts from now (multihost).
    last_beat_ns_.store(liveness::mono_ns(), std::memory_order_release);
    for (uint32_t n = 0; n < hdr_->max_nodes; ++n) {
      // An observer takes the highest free slot: the low ones are where the node it was opened
      // to reap (and reclaimed at open) was, and where attachers look first.
      const uint32_t i = observer ? hdr_->max_nodes - 1 - n : n;
      NodeSlot* s = node_slot(i);
      uint64_t w = coh_.read(&s->state);
      if (node_state(w) != kNodeFree) continue;
      // L1: the lock before the claim, so no judge of this kernel ever sees our CLAIMED slot
      // without it. A FREE slot whose lock is held is being reclaimed, or its fenced owner has
      // not closed yet: skip it.
      const bool locked = liveness::try_lock(lock_, lock_offset(i));
      if (lock_.lock_id && !locked) continue;
      uint64_t claimed = make_node_word(kNodeClaimed, domain_, node_epoch(w) + 1);
      if (!coh_.claim(&s->state, w, claimed)) {
        if (locked) liveness::unlock(lock_, lock_offset(i));
        continue;
      }
      // We own the slot: its area is ours to reset.
      coh_.check_fence();
      auto* fx = node_fixed(i);
      uint64_t hw = coh_.read(&fx->pin_hw);
      if (hw > hdr_->pin_slots) hw = hdr_->pin_slots;
      // Fresh lines under all our later stores, up to pin_slots, not only pin_hw: a reclaimer
      // cleared the pins of the last owner, and a stale line of ours would bring them back when we
      // publish a neighbouring pin (found by the emulator).
      coh_.invalidate(node_area(i), sizeof(NodeAreaFixed) + uint64_t(hdr_->pin_slots) * 8);
      std::memset(pins(i), 0, hw * 8);
      // Counters are kept across attachments: they accumulate per slot (one writer at a time),
      // so `pool stats` still counts the work of processes that have exited.
      coh_.publish(&fx->pin_hw, 0);
      coh_.publish(&fx->intents, 0);  // a previous owner's count: its intents went with its reclaim
      coh_.flush(node_area(i), sizeof(NodeAreaFixed) + hw * 8);
      coh_.invalidate(s, sizeof *s);
      coh_.check_fence();
      s->pid = id_.pid;
      s->host_slot = bakery_ ? host_slot_ + 1 : 0;
      s->flags = (bakery_ ? kNodeSharesHostSlot : 0) | (observer ? kNodeObserver : 0);
      s->pid_ns = pid_ns_inode();
      s->host_id = host_id_;
      s->lock_id = lock_.lock_id;
      s->attach_unix_ns = now_unix_ns();
      s->beat_unix_ns = s->attach_unix_ns;
      coh_.flush(s, sizeof *s);
      // This is a beat (peers restart their silence clock on it): it is also the fence's last
      // beat, as in liveness::beat. Without it the heartbeat thread's first beat, a quarter lease
      // from now, measured from before the attach and fenced a slow attach that had succeeded.
      const uint64_t beat_time = liveness::mono_ns();
      coh_.publish(&s->beat, s->beat + 1);
      if (bakery_) last_beat_ns_.store(beat_time, std::memory_order_release);
      node_word_ = make_node_word(kNodeAlive, domain_, node_epoch(claimed));
      coh_.publish(&s->state, node_word_);
      node_id_ = i + 1;
      if (bakery_) bakery_->set_node(node_id_, node_word_);
      // An emulated host beats from its own thread (heartbeat_tick), so that a pause stops it.
      if (!id_.emulated)
        heartbeat_ = liveness::start_heartbeat(s, node_word_, std::max<uint64_t>(lease_ns / 4, 1'000'000),
                                               coh_.unarbitrated(), &fenced_, &intact_, &last_beat_ns_,
                                               bakery_ ? lease_ns / 2 : 0, bakery_ ? &chores_ : nullptr);
      if (!id_.emulated && !observer) peers_.start_admin_responder();  // answers `pool ping` (rpc_admin.cpp)
      return;
    }
    if (observer) return;  // a full table: an observer goes on without a node slot
    uint64_t undecided = 0;
    uint64_t reaped = reap_pass(&undecided);
    if (reaped) continue;
    // Slots held by nodes of another kernel can only be judged after a lease of silence.
    if (!undecided || liveness::mono_ns() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<uint64_t>(50, hdr_->lease_ms / 4 + 1)));
  }
  throw NodeTableFullError("pool " + path_ + ": all " + std::to_string(hdr_->max_nodes) +
                           " node slots are taken by live processes (see `cxlkv pool info`; "
                           "`cxlkv pool reap NODE` reclaims one)");
}

void Attachment::detach_node() {
  if (!node_id_) return;
  uint32_t i = node_id_ - 1;
  peers_.stop_admin_responder();  // before the slot is FREE: no answer in the name of a gone node
  liveness::stop_heartbeat(heartbeat_);
  heartbeat_ = 0;
  if (!peers_.mapping_intact()) return;  // the file shrank: its pages are gone, nothing to clean there
  if (!fenced_.load(std::memory_order_acquire) && coh_.read(&node_slot(i)->state) == node_word_) {
    // close() always returns: a fence or a lock that stays taken (LockTimeoutError) leaves the
    // slot to be reclaimed like a dead node's (same kernel at once, once its lock is dropped
    // below; other hosts after a lease of silence, since the heartbeat has stopped).
    try {
      // Pins of a clean close are already released by their leases; clear any left behind.
      uint64_t hw = std::min<uint64_t>(peers_.pin_high_water(), hdr_->pin_slots);
      for (uint64_t p = 0; p < hw; ++p) coh_.publish(&pins(i)[p], 0);
      coh_.publish(&node_fixed(i)->pin_hw, 0);
      uint64_t w = node_word_;
      coh_.claim(&node_slot(i)->state, w, make_node_word(kNodeFree, 0, node_epoch(node_word_)));
    } catch (const FencedError&) {
    } catch (const LockTimeoutError&) {
    }
  }
  liveness::unlock(lock_, lock_offset(i));  // after FREE (L1)
  node_id_ = 0;
}

// Claims slot idx (judged as n from word w) RECLAIMING and reclaims it. Caller holds reap_mu_.
bool Attachment::reclaim_judged(uint32_t idx, uint64_t w, const NodeInfo& n, bool force) {
  if (n.state == kNodeFree || n.self) return false;
  if (n.verdict != NodeInfo::kDead && !force) return false;
  // The reclaimer holds the slot's lock while RECLAIMING (L1), so its own death is seen too.
  const bool locked = liveness::try_lock(lock_, lock_offset(idx));
  if (lock_.lock_id && !locked && !force) return false;  // someone of this kernel holds it
  uint64_t mine = make_node_word(kNodeReclaiming, domain_, node_epoch(w));
  if (!coh_.claim(&node_slot(idx)->state, w, mine)) {
    if (locked) liveness::unlock(lock_, lock_offset(idx));
    return false;
  }
  reclaim_node(idx, mine);
  if (locked) liveness::unlock(lock_, lock_offset(idx));
  table_.forget(idx);
  return true;
}

uint64_t Attachment::reap_pass(uint64_t* undecided) {
  if (row_less_ && any_dead_node()) become_writer();
  if (bakery_) bakery_->sweep();  // tier-1 words of our row left by dead host-mates (arbiter.h)
  std::lock_guard<std::mutex> g(reap_mu_);
  uint64_t reaped = 0;
  last_reap_ns_.store(now_unix_ns(), std::memory_order_relaxed);
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    if (node_id_ == i + 1) continue;
    uint64_t w = coh_.read(&node_slot(i)->state);
    if (node_state(w) == kNodeFree) continue;
    NodeInfo n = judge(i, w);
    if (n.verdict == NodeInfo::kUndecided && undecided) ++*undecided;
    // Still row-less: any_dead_node judged none dead a moment ago, and this one crossed its lease
    // since (or its word changed). Its claim would be refused (ReadOnlyError out of a mere look:
    // `pool check`, stats, the exporter), so it waits for the next pass, which becomes a writer.
    if (row_less_ && n.verdict == NodeInfo::kDead) {
      if (undecided) ++*undecided;
      continue;
    }
    if (reclaim_judged(i, w, n, false)) ++reaped;
  }
  reaped_unreported_.fetch_add(reaped, std::memory_order_relaxed);
  return reaped;
}

NodeInfo Attachment::reap_node(uint32_t id, bool force, bool* reclaimed, uint64_t wait_ms) {
  if (id == 0 || id > hdr_->max_nodes)
    throw ArgumentError("node id must be in 1.." + std::to_string(hdr_->max_nodes));
  become_writer();                    // a row-less observer: reaping is writing
  if (id == node_id_ && observer_) {  // the node was gone when this observer took its slot
    *reclaimed = false;
    NodeInfo n;
    n.id = id;
    n.evidence = "not attached (reclaimed, or never attached, before this command took the slot)";
    return n;
  }
  if (id == node_id_) throw ArgumentError("node " + std::to_string(id) + " is this attachment itself");
  *reclaimed = false;
  const uint32_t idx = id - 1;
  const uint64_t lease_ns = uint64_t(hdr_->lease_ms) * 1'000'000;
  const uint64_t t0 = liveness::mono_ns();
  const uint64_t deadline = t0 + std::max(lease_ns + lease_ns / 4 + 100'000'000, wait_ms * 1'000'000);
  for (;;) {
    {
      std::lock_guard<std::mutex> g(reap_mu_);
      uint64_t w = coh_.read(&node_slot(idx)->state);
      NodeInfo n = judge(idx, w);
      // Without wait: a node judged alive is answered at once; an undecided one is watched.
      const bool settled = wait_ms ? n.verdict == NodeInfo::kDead || n.verdict == NodeInfo::kFree
                                   : n.verdict != NodeInfo::kUndecided;
      if (settled || force || liveness::mono_ns() > deadline) {
        *reclaimed = reclaim_judged(idx, w, n, force);
        if (*reclaimed) reaped_unreported_.fetch_add(1, std::memory_order_relaxed);
        return n;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Attachment::reclaim_node(uint32_t idx, uint64_t reclaiming_word) {
  const uint8_t dead = uint8_t(idx + 1);
  // 0. multihost: the stripes of our host's row it held in tier 1 (host_slot.cpp).
  if (bakery_) release_dead_rows(idx, reclaiming_word);
  // 1. Pins: the dead node reads nothing any more.
  auto* fx = node_fixed(idx);
  uint64_t hw = std::min<uint64_t>(coh_.read(&fx->pin_hw), hdr_->pin_slots);
  coh_.invalidate(pins(idx), hw * 8);  // multihost: write back zeros over its lines, not our stale copy
  for (uint64_t p = 0; p < hw; ++p) coh_.publish(&pins(idx)[p], 0);
  coh_.publish(&fx->pin_hw, 0);
  coh_.publish(&fx->intents, 0);  // its intents are WRITING entries: tombstoned by step 2
  // 2-4. What it held in the store, released by the owners of that state (Attachment::Peers):
  //    index entries it was writing or evicting (Index::release_of_node, index_evict.cpp), chunks
  //    it was carving or draining and block descs no entry points back to (Allocator), the
  //    namespace-table lock and half-created namespaces (Namespaces).
  peers_.release_of_node(dead);
  // 5. Count it in the dead slot's own counters (L5: we own its area until FREE), then free it.
  coh_.bump_owned(&node_fixed(idx)->counters[kReclaimedNodes], 1);
  uint64_t w = reclaiming_word;
  coh_.claim(&node_slot(idx)->state, w, make_node_word(kNodeFree, 0, node_epoch(reclaiming_word)));
}

}  // namespace cxlkv
