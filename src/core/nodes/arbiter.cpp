// The bakery (arbiter.h) and the locked read-compare-store of Coherence (coherence.h).
#include "arbiter.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "checksum.h"
#include "errors.h"
#include "liveness.h"

namespace cxlkv {

void RowLessArbiter::lock(const void*) {
  throw ReadOnlyError(pool_ +
                      ": an observer without a host slot reads only; this write needs the cross-host "
                      "lock (it takes a row once it must write: reap, check)");
}

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
  fault("lock.held");
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

void Bakery::check_fence() { check_fence_at(liveness::mono_ns()); }

void Bakery::check_fence_at(uint64_t now) {
  if (c_.fenced->load(std::memory_order_acquire)) throw fenced_error(where_);
  uint64_t last = c_.last_beat->load(std::memory_order_acquire);
  if (now > last && now - last > c_.lease_ns / 2) {
    c_.fenced->store(true, std::memory_order_release);
    throw fenced_error(where_);
  }
}

bool Bakery::ticket_owner_attached(const LockLine& t, uint32_t row) const {
  if (t.node == 0 || t.node > c_.max_nodes || node_state(t.node_word) != kNodeAlive) return false;
  NodeSlot* s = &c_.nodes[t.node - 1];
  if (c_.coh.read(&s->state) != t.node_word) return false;
  // ALIVE with the ticket's word: the slot's fields are published and immutable (format.h L-rules).
  return c_.coh.read(&s->host_slot) == uint64_t(row) + 1;
}

void Bakery::throw_wait_timeout(uint32_t stripe, uint32_t row, const LockLine& t, bool absolute) const {
  throw LockTimeoutError(
      c_.pool + ": cross-host lock stripe " + std::to_string(stripe) + ": row " + std::to_string(row) +
      " holds ticket (choosing " + std::to_string(t.choosing) + ", number " + std::to_string(t.number) +
      ", node " + std::to_string(t.node) + ", waits " + std::to_string(t.waits) + ") " +
      (absolute ? "that kept this claim waiting " + std::to_string(kClaimLeases) +
                      " leases in all (its waits moved, yet it never let us in)"
                : "unchanged for " + std::to_string(kWaitLeases) + " leases while its holder looks alive") +
      "; the claim failed, nothing was changed "
      "(`cxlkv pool check` names the row; --repair clears tickets no host owns)");
}

void Bakery::throw_tier1_timeout(uint32_t stripe, uint64_t v, bool absolute) const {
  throw LockTimeoutError(
      c_.pool + ": cross-host lock stripe " + std::to_string(stripe) + ": the tier-1 word of row " +
      std::to_string(c_.slot) + " (participant " + std::to_string(tier1_participant1(v)) + ", node " +
      std::to_string(tier1_node(v)) + ", epoch " + std::to_string(tier1_epoch(v)) + ", " +
      tier1_kind_name(classify_tier1(v, c_.slot)) + ") was held " +
      (absolute
           ? "until this claim had waited " + std::to_string(kClaimLeases) + " leases in all"
           : "for " + std::to_string(kWaitLeases) + " leases by a process of this host that looks alive") +
      "; the claim failed, nothing was changed (`cxlkv pool check` names the word)");
}

Bakery::Bakery(Config c) : c_(std::move(c)), where_(c_.pool) {
  // Checked by the header's validation before any Bakery is built; here because observe_rows
  // scans into an array of kMaxLockHosts. Row == hosts: a reader with no row (lock_reader_).
  if (c_.hosts == 0 || c_.hosts > kMaxLockHosts || c_.slot > c_.hosts)
    throw ArgumentError("lock rows: " + std::to_string(c_.hosts) + " hosts, row " + std::to_string(c_.slot) +
                        " (1.." + std::to_string(kMaxLockHosts) + " hosts; a row below them, or none)");
  skipped_tickets_.resize(size_t(kLockStripes) * c_.hosts);
  observed_.resize(size_t(kLockStripes) * c_.hosts);
  uint64_t seed = liveness::mono_ns() ^ (uint64_t(::getpid()) << 32) ^ reinterpret_cast<uintptr_t>(this);
  nonce_ = (xxh3(&seed, sizeof seed, 3) & 0x7FFF) << 48;
  mine_.store(nonce_ | make_tier1_word(c_.participant1, 0, 0), std::memory_order_relaxed);
}

// Called while this attachment holds no stripe (attach_node), so no tier-1 word carries the old
// value when it changes.
void Bakery::set_node(uint32_t node, uint64_t node_word) {
  node_ = node, node_word_ = node_word;
  where_ = c_.pool + (node ? ": node " + std::to_string(node) : std::string());
  mine_.store(nonce_ | make_tier1_word(c_.participant1, node, node_epoch(node_word)),
              std::memory_order_relaxed);
}

bool Bakery::tier1_cas(uint32_t k, uint64_t expected, uint64_t desired) const {
  // Host-local word: only processes of this host (one coherence domain) ever touch it.
  return std::atomic_ref<uint64_t>(tier1(k)).compare_exchange_strong(
      expected, desired, std::memory_order_acq_rel, std::memory_order_acquire);
}

bool Bakery::fence_ok() const {
  return !c_.fenced->load(std::memory_order_acquire) &&
         liveness::mono_ns() - c_.last_beat->load(std::memory_order_acquire) <= c_.lease_ns / 2;
}

// True when the word's participant byte is unlocked: the process that took the word is gone (the
// kernel released its lock), in any PID namespace. False when it is held, or cannot be judged.
bool Bakery::participant_gone(uint64_t word) const {
  uint32_t p1 = tier1_participant1(word);
  if (p1 == 0 || !c_.lock || !c_.lock->lock_id || c_.participant1 == 0) return false;
  return !liveness::lock_held_by_other(*c_.lock, c_.participant_base + p1 - 1);
}

const char* Bakery::tier1_kind_name(Tier1Kind k) {
  switch (k) {
    case Tier1Kind::free: return "free";
    case Tier1Kind::holder: return "a live holder";
    case Tier1Kind::nodeless: return "a holder without a node";
    case Tier1Kind::stale: return "stale: its node is not alive in that epoch";
    case Tier1Kind::foreign: return "foreign: no process of that row's host";
  }
  return "?";
}

// The word is untrusted (any process of the pod can write the line): it is judged from the node
// table only. A process of the row's host writes make_tier1_word(participant, node, epoch of its
// node word) | nonce, so a word naming a node that is ALIVE in another epoch, or not ALIVE, is
// not the word of that node's current incarnation (stale); one naming a live node of another
// row or host id, or out of range, or without the tag bit, is nobody's (foreign).
Bakery::Tier1Kind Bakery::classify_tier1(uint64_t word, uint32_t row) const {
  if (word == 0) return Tier1Kind::free;
  if (!(word >> 63)) return Tier1Kind::foreign;
  const uint32_t node = tier1_node(word);
  if (node == 0) return Tier1Kind::nodeless;
  if (node > c_.max_nodes) return Tier1Kind::foreign;
  NodeSlot* s = &c_.nodes[node - 1];
  const uint64_t st = c_.coh.read(&s->state);
  if (node_state(st) != kNodeAlive || (node_epoch(st) & 0xFFFFFF) != tier1_epoch(word))
    return Tier1Kind::stale;
  c_.coh.invalidate(s, sizeof *s);  // ALIVE in this epoch: its fields are published (format.h L-rules)
  if (s->host_slot != uint64_t(row) + 1) return Tier1Kind::foreign;
  if (row == c_.slot && c_.host_id && s->host_id != c_.host_id) return Tier1Kind::foreign;
  return Tier1Kind::holder;
}

uint64_t Bakery::read_tier1(uint32_t k, uint32_t j) const {
  LockLine* l = line(k, j);
  c_.coh.invalidate(l, sizeof *l);
  return std::atomic_ref<uint64_t>(l->tier1).load(std::memory_order_acquire);
}

bool Bakery::take_over_own_word(uint32_t k, uint64_t seen) {
  check_fence();
  std::lock_guard<std::timed_mutex> g(local_[k]);
  if (seen == 0 || seen == mine_.load(std::memory_order_relaxed) || !tier1_cas(k, seen, mine_.load()))
    return false;
  take_over_and_release(k);
  return true;
}

bool Bakery::clear_orphaned_word(uint32_t k, uint32_t j, uint64_t seen_word, const LockLine& seen) {
  if (j == c_.slot) return take_over_own_word(k, seen_word);
  check_fence();
  if (read_tier1(k, j) != seen_word || !same_line(read_ticket(k, j), seen)) return false;  // it moved
  LockLine* l = line(k, j);
  check_fence();
  l->choosing = 0, l->number = 0, l->node = 0, l->node_word = 0;
  std::atomic_ref<uint64_t>(l->tier1).store(0, std::memory_order_release);
  bump(l);
  write_back(l);
  return true;
}

uint32_t Bakery::heal_own_row() {
  if (!fence_ok()) return 0;  // a fenced attachment never writes the row again
  uint32_t n = 0;
  const uint64_t mine = mine_.load(std::memory_order_relaxed);
  for (uint32_t k = 0; k < kLockStripes; ++k) {
    std::unique_lock<std::timed_mutex> g(local_[k], std::try_to_lock);
    if (!g.owns_lock()) {  // a thread of ours uses the stripe: its row is a live holder's
      if (CacheModel* m = c_.coh.model(); m && m->heal_ignores_holders()) {  // negative control
        LockLine* me = line(k, c_.slot);
        me->choosing = 0, me->number = 0;
        bump(me);
        write_back(me);
        ++n;
      }
      continue;
    }
    const uint64_t v = std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire);
    if (v != 0) {
      // A word whose process is gone, or that names no host-mate of this row (a stray write):
      // take it over, as a waiter would (its ticket is reset with it). A stale word (its node not
      // ALIVE in its epoch: reclaimed, or a forged epoch) once it stood still for a lease: a real
      // holder of that incarnation has fenced itself by then (its beats fail).
      const Tier1Kind kind = v == mine ? Tier1Kind::holder : classify_tier1(v, c_.slot);
      bool take = kind == Tier1Kind::foreign || (v != mine && participant_gone(v));
      if (kind == Tier1Kind::stale) {
        const uint64_t t = liveness::mono_ns();
        if (stale_seen_[k].word != v) stale_seen_[k] = StaleWord{v, t};
        take = take || t - stale_seen_[k].since > c_.lease_ns;
      }
      if (take && tier1_cas(k, v, mine)) {
        ++n;
        stale_seen_[k] = StaleWord{};
        take_over_and_release(k);
      }
      continue;
    }
    LockLine* me = line(k, c_.slot);
    // Another host may have written the row in memory (it is untrusted): read memory's copy,
    // before our CAS stores into the line. The line may be dirty (a host-mate's release whose
    // write-back has not run yet), so as clflush does: write back, then drop; a drop alone would
    // lose those stores (the emulator caught it: a dirty lock line dropped by healing).
    c_.coh.flush(me, sizeof *me);
    c_.coh.invalidate(me, sizeof *me);
    if (!tier1_cas(k, 0, mine)) continue;  // a host-mate took it just now
    if (me->choosing || me->number) {      // node/node_word stay after a release: not a ticket
      ++n;
      release_row(k);  // writes the reset ticket back with the free word
    } else {
      tier1_cas(k, mine, 0);
    }
  }
  healed_.fetch_add(n, std::memory_order_relaxed);
  return n;
}

void Bakery::bump(LockLine* me) const {
  // Host-mates read `waits` (acquire_tier1) while we hold their row: one atomic store.
  std::atomic_ref<uint64_t>(me->waits).store(me->waits + 1, std::memory_order_relaxed);
}

bool Bakery::same_line(const LockLine& a, const LockLine& b) {
  return a.choosing == b.choosing && a.number == b.number && a.node == b.node && a.node_word == b.node_word &&
         a.waits == b.waits;
}

LockLine Bakery::observe(uint32_t k, uint32_t j, const std::function<uint64_t(const LockLine&)>& pulse,
                         uint64_t* since) {
  LockLine now = read_ticket(k, j);
  now.pad[0] = now.number || now.choosing ? pulse(now) : 0;
  const uint64_t t = liveness::mono_ns();
  std::lock_guard<std::mutex> g(watch_mu_);
  const Observed& o = record(k, j, now, t);
  if (since) *since = o.since;
  return o.line;
}

const Bakery::Observed& Bakery::record(uint32_t k, uint32_t j, const LockLine& now, uint64_t t) {
  Observed& o = observed_[size_t(k) * c_.hosts + j];
  if (!o.valid || !same_line(o.line, now) || o.line.pad[0] != now.pad[0]) o = Observed{now, t, true};
  return o;
}

uint64_t Bakery::observe_rows(uint32_t k, const std::function<uint64_t(const LockLine&)>& pulse) {
  // The doorway's scan of every other row: all lines first (a drop and a load each), then one clock
  // read and one pass under watch_mu_ to record them. observe() per row read the clock and took the
  // mutex once a row, about a fifth of a row's cost on a VM. The clock is read after the last line,
  // so a recorded `since` is never earlier than the look it dates: a later time only delays a skip.
  std::array<LockLine, kMaxLockHosts> seen;  // the constructor bounds c_.hosts
  for (uint32_t j = 0; j < c_.hosts; ++j) {
    if (j == c_.slot) continue;
    seen[j] = read_ticket(k, j);
    seen[j].pad[0] = seen[j].number || seen[j].choosing ? pulse(seen[j]) : 0;
  }
  const uint64_t t = liveness::mono_ns();
  uint64_t top = 0;
  std::lock_guard<std::mutex> g(watch_mu_);
  for (uint32_t j = 0; j < c_.hosts; ++j)
    if (j != c_.slot) top = std::max(top, record(k, j, seen[j], t).line.number);
  return top;
}

void Bakery::sweep_observations(const std::function<uint64_t(const LockLine&)>& pulse) {
  for (uint32_t k = 0; k < kLockStripes; ++k)
    for (uint32_t j = 0; j < c_.hosts; ++j)
      if (j != c_.slot) observe(k, j, pulse);
}

LockLine Bakery::read_ticket(uint32_t k, uint32_t j) const {
  LockLine* l = line(k, j);
  c_.coh.invalidate(l, sizeof *l);
  LockLine t{};
  t.choosing = l->choosing, t.number = l->number, t.node = l->node, t.node_word = l->node_word;
  t.waits = l->waits;
  return t;
}

bool Bakery::reset_own_row(uint32_t k) {
  check_fence();
  std::lock_guard<std::timed_mutex> g(local_[k]);
  if (!tier1_cas(k, 0, mine_.load(std::memory_order_relaxed))) return false;
  release_row(k);  // writes number = choosing = 0 back with the free word (unless fenced)
  return true;
}

bool Bakery::reset_orphaned_row(uint32_t k, uint32_t j, const LockLine& seen) {
  if (j == c_.slot) return reset_own_row(k);
  check_fence();
  if (!same_line(read_ticket(k, j), seen)) return false;  // it moved: someone uses the row after all
  LockLine* l = line(k, j);
  check_fence();
  l->choosing = 0, l->number = 0, l->node = 0, l->node_word = 0;
  bump(l);
  write_back(l);
  return true;
}

void Bakery::adopt_participant() {
  if (c_.participant1 == 0) return;
  for (uint32_t k = 0; k < kLockStripes; ++k) {
    uint64_t v = std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire);
    if (v == 0 || tier1_participant1(v) != c_.participant1) continue;
    std::lock_guard<std::timed_mutex> g(local_[k]);
    if (tier1_cas(k, v, mine_.load(std::memory_order_relaxed))) take_over_and_release(k);
  }
}

// We won a dead host-mate's tier-1 word of stripe k: write back what it was modifying, then give
// the row back (also when the write-back throws: the word must not stay ours).
void Bakery::take_over_and_release(uint32_t k) {
  takeovers_.fetch_add(1, std::memory_order_relaxed);
  try {
    take_over(k);
  } catch (...) {
    release_row(k);
    throw;
  }
  release_row(k);
}

void Bakery::release_dead(uint32_t node, uint32_t epoch) {
  for (uint32_t k = 0; k < kLockStripes; ++k) {
    uint64_t v = std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire);
    if (v == 0 || tier1_node(v) != node || tier1_epoch(v) != (epoch & 0xFFFFFF)) continue;
    if (tier1_participant1(v) != 0 && !participant_gone(v)) continue;  // alive (reaped by force)
    std::lock_guard<std::timed_mutex> g(local_[k]);
    if (tier1_cas(k, v, mine_.load(std::memory_order_relaxed))) take_over_and_release(k);
  }
}

uint32_t Bakery::sweep() {
  uint32_t n = 0;
  const uint64_t mine = mine_.load(std::memory_order_relaxed);
  for (uint32_t k = 0; k < kLockStripes; ++k) {
    uint64_t v = std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire);
    if (v == 0 || v == mine || !participant_gone(v)) continue;
    std::lock_guard<std::timed_mutex> g(local_[k]);
    if (!tier1_cas(k, v, mine)) continue;
    ++n;
    take_over_and_release(k);
  }
  return n;
}

// We just took stripe k's tier-1 word from a dead or silent holder. It may have stored into the
// line it was modifying and died before writing it back: that dirty line lives on in this host's
// caches and would reach memory at a random later moment, over another host's newer update.
// Write it back now, while we hold the row (clflush writes a dirty line back from any cache of the
// coherence domain). Its ticket is overwritten by ours (or reset by release_row).
void Bakery::take_over(uint32_t k) {
  uint64_t off = line(k, c_.slot)->holder_line;  // host-local: written by the holders of this row
  if (off % kCacheLine == 0 && c_.pool_bytes >= kCacheLine && off <= c_.pool_bytes - kCacheLine)
    c_.coh.flush(c_.base + off, kCacheLine);
}

bool Bakery::acquire_tier1(uint32_t k, const void* addr, uint64_t deadline) {
  const uint64_t mine = mine_.load(std::memory_order_relaxed);
  if (tier1_cas(k, 0, mine)) {  // uncontended: no clock read
    line(k, c_.slot)->holder_line = uint64_t(static_cast<const char*>(addr) - c_.base);
    return false;
  }
  uint64_t seen = 0, seen_state = 0, seen_beat = 0, since = 0, spins = 0;
  uint64_t last_judge = 0, last_tick = liveness::mono_ns();
  uint64_t wait_start = last_tick, waits_seen = 0, word_seen = 0;
  for (;;) {
    uint64_t v = std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire);
    if (v == 0) {
      if (tier1_cas(k, 0, mine)) break;
      continue;
    }
    if (v == mine) {  // a word of ours left behind (local_[k] is ours, so no thread of ours holds it)
      takeovers_.fetch_add(1, std::memory_order_relaxed);
      take_over(k);
      break;
    }
    const uint64_t t = liveness::mono_ns();
    if (t - last_judge > 1'000'000) {  // judge the holder once per millisecond
      last_judge = t;
      // Untrusted: a word naming a node that is not one of our host-mates on this row (a stray
      // write from anywhere in the pod) is nobody's; the CAS below is among our host's processes.
      const Tier1Kind kind = classify_tier1(v, c_.slot);
      bool gone = kind == Tier1Kind::foreign || participant_gone(v);
      if (!gone) {
        // Silence: the word, and its holder's pulse, unchanged for a lease on our clock: for a
        // node, its (state, beat); for a node-less holder (attach, observer on a full table),
        // the row's `waits`, which it advances while it waits in tier 2 (the pulse peers use).
        // A stale word (its node not ALIVE in the word's epoch) has no pulse: the beats of the
        // slot's current incarnation are not its holder's, and a real holder of the named
        // incarnation fences itself within half a lease of its reclaim. The word alone counts.
        uint32_t node = tier1_node(v);
        uint64_t st = 0, bt = 0;
        if (kind == Tier1Kind::holder)
          st = c_.coh.read(&c_.nodes[node - 1].state), bt = holder_beat(node);
        else if (kind == Tier1Kind::nodeless)
          bt = std::atomic_ref<uint64_t>(line(k, c_.slot)->waits).load(std::memory_order_relaxed);
        if (since == 0 || v != seen || st != seen_state || bt != seen_beat)
          seen = v, seen_state = st, seen_beat = bt, since = t;
        else
          gone = t - since > c_.lease_ns;
      }
      if (gone && tier1_cas(k, v, mine)) {
        takeovers_.fetch_add(1, std::memory_order_relaxed);
        take_over(k);
        break;
      }
    }
    if (c_.tick && t - last_tick > 1'000'000) {
      c_.tick();
      last_tick = t;
    }
    // The holder may itself wait in tier 2 (behind dead hosts' tickets: a lease each): its
    // line's `waits` then advances, which is progress, not a reason to give up.
    if (const uint64_t w = std::atomic_ref<uint64_t>(line(k, c_.slot)->waits).load(std::memory_order_relaxed);
        w != waits_seen || v != word_seen)
      waits_seen = w, word_seen = v, wait_start = t;
    if (t - wait_start > kWaitLeases * c_.lease_ns) throw_tier1_timeout(k, v, false);
    if (t > deadline) throw_tier1_timeout(k, v, true);
    if (++spins % 64 == 0)
      spins > 4096 ? std::this_thread::sleep_for(std::chrono::microseconds(50)) : std::this_thread::yield();
    else
      relax();
  }
  // Host-local, like tier1: the line we are about to modify, for a taker-over (take_over).
  line(k, c_.slot)->holder_line = uint64_t(static_cast<const char*>(addr) - c_.base);
  return true;
}

void Bakery::release_row(uint32_t k) {
  LockLine* me = line(k, c_.slot);
  const uint64_t mine = mine_.load(std::memory_order_relaxed);
  // Fenced (declared dead, or stood still past half a lease): a host-mate may take the row over
  // after a lease of our silence, so we never write it again; peers skip our stale ticket as a dead
  // host's. Not fenced: nobody can take it over before our beat ages a lease, so the row is ours.
  if (!fence_ok()) {
    tier1_cas(k, mine, 0);  // fails if a host-mate took it over: then it is theirs
    return;
  }
  // Taken over (we looked silent for a lease): the row is a host-mate's now; not ours to write.
  if (std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire) != mine) return;
  me->number = 0, me->choosing = 0;
  bump(me);  // while the word is ours: the one writer of `waits` (no bump of a successor is lost)
  tier1_cas(k, mine, 0);
  // One write-back carries the reset ticket and the free tier-1 word (a crashed host's successor
  // then finds the word free in memory). A host-mate that took the word meanwhile may have stored
  // its first fields already: writing them back early is harmless (each word is its own register).
  write_back(me);
}

void Bakery::lock(const void* addr) {
  const uint32_t k = stripe_of(addr);
  // Without a node (an observer on a full node table, or an attach before its slot is ALIVE) our
  // ticket names node 0, which peers skip once its line stood still for a lease on their clock.
  // The fence then runs from our own line's writes (the first ticket write below, then each
  // progress write), and since that base is per attachment, a node-less attachment holds one
  // stripe at a time (nodeless_mu_): a thread of it could not refresh the fence of another's line.
  // A node has a heartbeat instead; its fence runs from its last beat.
  // Clock reads are a good part of an uncontended acquire (tens of ns each on a VM): one at the
  // entry serves the fence, the node-less fence base and the deadline, and again the fence of the
  // first ticket write when nothing waited in between (a few uncontended instructions: the
  // assumption of arbiter.h's fence argument).
  std::unique_lock<std::recursive_mutex> nodeless;
  if (node_ == 0) nodeless = std::unique_lock<std::recursive_mutex>(nodeless_mu_);
  const uint64_t start = liveness::mono_ns();
  if (nodeless.owns_lock()) c_.last_beat->store(start, std::memory_order_release);  // nothing written yet
  check_fence_at(start);  // a fenced attachment touches no row
  // The claim's absolute bound (kClaimLeases), from here: threads of ours queued on the stripe,
  // host-mates in tier 1 and every row of tier 2 share it.
  const uint64_t deadline = start + kClaimLeases * c_.lease_ns;
  bool waited = !local_[k].try_lock();
  if (waited && !local_[k].try_lock_for(std::chrono::nanoseconds(deadline - start)))
    throw LockTimeoutError(c_.pool + ": cross-host lock stripe " + std::to_string(k) +
                           ": threads of this process held it while this claim waited " +
                           std::to_string(kClaimLeases) + " leases; the claim failed, nothing was changed");
  if (depth_[k]++ != 0) {
    --depth_[k];
    local_[k].unlock();
    throw Error("internal: cross-host lock stripe taken twice by one thread");
  }
  bool row = false;
  try {
    waited |= acquire_tier1(k, addr, deadline);  // tier 1: processes of this host
    row = true;
    LockLine* me = line(k, c_.slot);
    const uint64_t now = waited ? liveness::mono_ns() : start;
    // Node-less: the fence runs from this first write (tier 1 may have waited for host-mates).
    if (nodeless.owns_lock()) c_.last_beat->store(now, std::memory_order_release);
    check_fence_at(now);  // before each write of the row: a silent holder may have been taken over
    me->choosing = 1;
    me->node = node_;
    me->node_word = node_word_;
    bump(me);
    write_back(me);
    // The pulse of a ticket: its node's heartbeat; a ticket of no node (an attach in progress, an
    // observer without a node slot) has its own, `waits`, which such a holder advances while it
    // waits and from which it runs its fence (see the write in the wait loop below).
    auto pulse = [&](const LockLine& x) { return x.node ? holder_beat(x.node) : x.waits; };
    const uint64_t top = c_.hosts > 1 ? observe_rows(k, pulse) : 0;  // our own line is never dropped
    const uint64_t mine = std::min<uint64_t>(top, 1ull << 62) + 1;   // untrusted: bounded
    if (c_.hosts > 1)
      check_fence();  // other rows were read (a drop and a load each) since the last check
    else
      check_fence_at(now);
    me->number = mine;
    me->choosing = 0;
    bump(me);
    write_back(me);
    c_.coh.fence();
    // While we wait, our line's `waits` advances (written back every progress_ns): hosts behind
    // our ticket then know we wait rather than sit in the lock, and do not count it to their bound.
    const uint64_t progress_ns = std::max<uint64_t>(c_.lease_ns / 16, 1'000'000);
    uint64_t last_progress = c_.hosts > 1 ? liveness::mono_ns() : now, last_sweep = last_progress;
    for (uint32_t j = 0; j < c_.hosts; ++j) {
      if (j == c_.slot) continue;
      LockLine seen{};
      // The clocks start at the first look that finds row j in our way: a row that is not (the
      // common case, every row of an uncontended claim) costs two line reads and no clock read.
      uint64_t since = 0, beat0 = 0, spins = 0, last_tick = 0;
      uint64_t blocked_since = 0, waits_seen = 0;
      for (;;) {
        const LockLine now = read_ticket(k, j);
        bool ahead = now.number != 0 && (now.number < mine || (now.number == mine && j < c_.slot));
        if (!now.choosing && !ahead) break;
        // The row is untrusted input: a ticket is honoured only while it can be its host's. One
        // that names a node which is not attached on row j with the word it names (reclaimed,
        // replaced, out of range, or a node of another row: a stray or hostile write) is void,
        // and the row counts as empty. A reclaimed holder was judged dead after a lease of
        // silence, so it is fenced and never stores again.
        if (now.node != 0 && !ticket_owner_attached(now, j)) {
          voided_.fetch_add(1, std::memory_order_relaxed);
          break;
        }
        // Blocked by host j. A ticket that stands still for a lease while its holder's pulse
        // also stands still belongs to a dead or paused host: skip it (that host fences itself
        // before any further store, see check_fence). One we skipped before, unchanged and with
        // its holder still silent, is skipped at once: the holder has been silent ever since.
        Skipped& memo = skipped_tickets_[size_t(k) * c_.hosts + j];
        uint64_t t = liveness::mono_ns();
        if (blocked_since == 0) blocked_since = last_tick = t;
        if (since == 0 && memo.valid && memo.choosing == now.choosing && memo.number == now.number &&
            memo.node == now.node && memo.node_word == now.node_word && pulse(now) == memo.beat) {
          skipped_.fetch_add(1, std::memory_order_relaxed);
          break;
        }
        if (since == 0) {
          // Unchanged since this attachment first saw it (in any acquisition, or a sweep while
          // blocked): the lease of silence counts from then, so k dead tickets in k stripes or
          // rows cost one lease in all, not k in a row.
          uint64_t first = 0;
          const LockLine o = observe(k, j, pulse, &first);
          seen = o, since = first, beat0 = o.pad[0];
          if (!same_line(o, now)) seen = now, since = t, beat0 = pulse(now);
        } else if (now.choosing != seen.choosing || now.number != seen.number || now.node != seen.node ||
                   now.waits != seen.waits) {
          seen = now, since = t, beat0 = pulse(now);
          blocked_since = t;  // a new ticket: progress
        } else if (t - since > c_.lease_ns) {
          if (pulse(now) == beat0) {
            skipped_.fetch_add(1, std::memory_order_relaxed);
            memo = Skipped{now.choosing, now.number, now.node, now.node_word, beat0, true};
            break;
          }
          since = t, beat0 = pulse(now);
        }
        // Bounded: a live holder keeps a stripe for microseconds. A ticket that stays in our way
        // for kWaitLeases leases while its holder beats and does not wait itself (its `waits`
        // stands still) is a stray write on its own host's row, or a host whose locking thread
        // stalled while its heartbeat ran: fail this claim with the evidence instead of wedging
        // every process of the pod. Any change of the ticket or of its waits is progress.
        if (now.waits != waits_seen) waits_seen = now.waits, blocked_since = t;
        if (t - blocked_since > kWaitLeases * c_.lease_ns) throw_wait_timeout(k, j, now, false);
        // Absolute: whatever the line does (a forged ticket whose `waits` is bumped in bursts
        // reads as progress), the claim ends by its deadline.
        if (t > deadline) throw_wait_timeout(k, j, now, true);
        if (t - last_sweep > progress_ns) {
          sweep_observations(pulse);
          last_sweep = t;
        }
        if (t - last_progress > progress_ns) {
          check_fence();  // on the previous fence base: a lapsed holder is not revived here
          if (std::atomic_ref<uint64_t>(tier1(k)).load(std::memory_order_acquire) !=
              mine_.load(std::memory_order_relaxed))
            throw fenced_error(where_);  // a host-mate took our row over: we looked silent
          const uint64_t published = liveness::mono_ns();
          // The whole ticket, not only `waits`: a word someone else wrote into our line (a
          // forged ticket that would borrow our pulse, or make us look smaller or larger to
          // other hosts) lives at most until this write, so hosts behind us always see our
          // ticket as we hold it, and a forged ticket cannot take our pulse for its own.
          me->choosing = 0, me->number = mine, me->node = node_, me->node_word = node_word_;
          bump(me);
          write_back(me);
          // Without a node this is our pulse: peers restart their silence clock once they see
          // it, which is after `published`, so the fence may run from there (as from a beat).
          if (node_ == 0) c_.last_beat->store(published, std::memory_order_release);
          last_progress = t;
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
    if (row) {
      try {
        release_row(k);
      } catch (...) {
      }
    }
    --depth_[k];
    local_[k].unlock();
    throw;
  }
  if (nodeless.owns_lock()) {
    nodeless.release();  // held until unlock(k): one stripe at a time without a node
    nodeless_held_[k] = true;
  }
  if (CacheModel* m = c_.coh.model()) m->lock_entered(k, line(k, c_.slot));
}

void Bakery::unlock(const void* addr) {
  const uint32_t k = stripe_of(addr);
  if (CacheModel* m = c_.coh.model()) m->lock_left(k);
  try {
    release_row(k);
  } catch (...) {
  }
  const bool nodeless = std::exchange(nodeless_held_[k], false);
  --depth_[k];
  local_[k].unlock();
  if (nodeless) nodeless_mu_.unlock();
}

}  // namespace cxlkv
