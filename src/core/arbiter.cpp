// The bakery (arbiter.h) and the locked read-compare-store of Coherence (coherence.h).
#include "arbiter.h"

#include <algorithm>
#include <thread>

#include "errors.h"
#include "liveness.h"

namespace cxlkv {

using namespace format;

namespace {
inline void relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
struct Unlock {
  Arbiter* a;
  const void* p;
  ~Unlock() { a->unlock(p); }
};
}  // namespace

bool Coherence::locked_rmw(uint64_t* w, uint64_t& expected, uint64_t desired, bool compare) const {
  arb_->lock(w);
  Unlock u{arb_, w};
  if (model_) model_->fault_point("lock.held");
  arb_->check_fence();
  // From here to the write-back nothing blocks: the fence check covers the store (arbiter.h).
  if (model_)
    model_->invalidate(w, sizeof *w, false);
  else
    hw_evict(w, sizeof *w);
  uint64_t cur = std::atomic_ref<uint64_t>(*w).load(std::memory_order_acquire);
  if (compare && cur != expected) {
    expected = cur;
    return false;
  }
  std::atomic_ref<uint64_t>(*w).store(desired, std::memory_order_release);
  if (model_)
    model_->writeback(w, sizeof *w, false);
  else
    hw_writeback(w, sizeof *w);
  return true;
}

uint32_t Bakery::stripe_of(const void* addr) const {
  // By cache line: every word of one line maps to one stripe, so the read-modify-write of a line
  // (8 chunk words or block descs share one) is serialized as a whole.
  uint64_t line = uint64_t(static_cast<const char*>(addr) - c_.base) >> 6;
  return uint32_t((line * 0x9E3779B97F4A7C15ull) >> 60) % kLockStripes;
}

void Bakery::write_back(LockLine* l) const {
  if (CacheModel* m = c_.coh.model(); m && m->drop_lock_writeback()) return;  // negative control
  c_.coh.flush(l, sizeof *l);
}

uint64_t Bakery::holder_beat(uint64_t node) const {
  if (node == 0 || node > c_.max_nodes) return 0;
  return c_.coh.read(&c_.nodes[node - 1].beat);
}

void Bakery::check_fence() {
  if (c_.fenced->load(std::memory_order_acquire))
    throw FencedError("this node was fenced (declared dead by a peer or reclaimed); open the pool again");
  uint64_t last = c_.last_beat->load(std::memory_order_acquire);
  if (liveness::mono_ns() - last > c_.lease_ns / 2) {
    c_.fenced->store(true, std::memory_order_release);
    throw FencedError(
        "this node's heartbeat lapsed for half a lease (paused?): a peer may have declared it "
        "dead, so it stores nothing more; open the pool again");
  }
}

void Bakery::lock(const void* addr) {
  const uint32_t k = stripe_of(addr);
  local_[k].lock();  // tier 1: threads of this process
  if (depth_[k]++ != 0) {
    --depth_[k];
    local_[k].unlock();
    throw Error("internal: cross-host lock stripe taken twice by one thread");
  }
  try {
    LockLine* me = line(k, c_.slot);
    me->choosing = 1;
    me->node = node_;
    me->node_word = node_word_;
    write_back(me);
    uint64_t top = 0;
    for (uint32_t j = 0; j < c_.hosts; ++j) {
      if (j == c_.slot) continue;  // our own line is dirty-free and ours: never drop it
      top = std::max(top, c_.coh.read(&line(k, j)->number));
    }
    const uint64_t mine = std::min<uint64_t>(top, 1ull << 62) + 1;  // untrusted: bounded
    me->number = mine;
    me->choosing = 0;
    write_back(me);
    c_.coh.fence();
    for (uint32_t j = 0; j < c_.hosts; ++j) {
      if (j == c_.slot) continue;
      LockLine seen{};
      uint64_t since = 0, beat0 = 0, spins = 0, last_tick = liveness::mono_ns();
      for (;;) {
        LockLine* l = line(k, j);
        c_.coh.invalidate(l, sizeof *l);
        LockLine now{};
        now.choosing = l->choosing, now.number = l->number, now.node = l->node, now.node_word = l->node_word;
        bool ahead = now.number != 0 && (now.number < mine || (now.number == mine && j < c_.slot));
        if (!now.choosing && !ahead) break;
        // A holder whose node slot no longer holds the word it locked with was reclaimed (judged
        // dead after a lease of silence, so fenced: it never stores again): its ticket is void.
        // The lease rule below cannot tell once a live attachment reuses that node slot and beats.
        if (now.node != 0 && now.node <= c_.max_nodes &&
            c_.coh.read(&c_.nodes[now.node - 1].state) != now.node_word) {
          skipped_.fetch_add(1, std::memory_order_relaxed);
          break;
        }
        // Blocked by host j. A ticket that stands still for a lease while its holder's heartbeat
        // also stands still belongs to a dead or paused host: skip it (that host fences itself
        // before any further store, see check_fence).
        uint64_t t = liveness::mono_ns();
        if (since == 0 || now.choosing != seen.choosing || now.number != seen.number ||
            now.node != seen.node) {
          seen = now, since = t, beat0 = holder_beat(now.node);
        } else if (t - since > c_.lease_ns) {
          if (holder_beat(now.node) == beat0) {
            skipped_.fetch_add(1, std::memory_order_relaxed);
            break;
          }
          since = t, beat0 = holder_beat(now.node);
        }
        if (++spins % 64 == 0)
          std::this_thread::yield();
        else
          relax();
        if (c_.tick && t - last_tick > 1'000'000) {
          c_.tick();
          last_tick = t;
        }
      }
    }
  } catch (...) {
    LockLine* me = line(k, c_.slot);
    me->number = 0, me->choosing = 0;
    try {
      write_back(me);
    } catch (...) {
    }
    --depth_[k];
    local_[k].unlock();
    throw;
  }
  if (CacheModel* m = c_.coh.model()) m->lock_entered(k);
}

void Bakery::unlock(const void* addr) {
  const uint32_t k = stripe_of(addr);
  if (CacheModel* m = c_.coh.model()) m->lock_left(k);
  LockLine* me = line(k, c_.slot);
  me->number = 0;
  me->choosing = 0;
  try {
    write_back(me);
  } catch (...) {
  }
  --depth_[k];
  local_[k].unlock();
}

}  // namespace cxlkv
