// Cross-host mutual exclusion without atomic read-modify-write, and the fence of one attachment
// (multihost backend). See docs/ARCHITECTURE.md "Multi-host CXL 2.0" and LockLine in format.h.
//
// Two tiers, as in TraCT. Tier 1, inside one host: a process-local mutex per stripe (threads of
// this attachment queue there), then the row's `tier1` word, taken by CAS among the processes of
// this host that share its host slot (one coherence domain: the CAS never crosses hosts). Tier 2,
// across hosts: Lamport's bakery among host slots on plain loads and stores of per-host lines
// (format::LockLine), competed for by the tier-1 holder alone: a line is written back whole by its
// one writer at a time and read only after the reader dropped its copy, so every line behaves as
// an atomic single-writer register, which is all the bakery needs.
//
// Tier-1 recovery (a holder that died or stood still): the word names the holder's participant
// byte (an OFD lock held for the attachment's life) and its node. A waiter takes the word over
// (CAS) once the byte is free (the holder's process is gone: same-kernel evidence) or once the word
// and the holder's (state, beat) stood still for a lease (the rule other hosts apply to its ticket;
// such a holder fences itself before any further store). The taker writes back the line the
// holder was modifying (holder_line): a dead process's dirty copy lives on in the host's caches.
// A fenced holder never writes the row again: it only gives the tier-1 word back (CAS).
//
// Fence (lease self-check): a node stores into shared lines only while its last published beat is
// younger than half a lease. A peer declares it dead (and skips its ticket, or reclaims its slot)
// only after seeing its beat stand still for a whole lease on the peer's own clock, so every
// store the node made passed its check before any peer could act on its death. Assumption (not
// enforced, written down): no pause longer than half a lease between a check and the write-back
// that follows it (a few instructions), and clocks that run at the same rate.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "coherence.h"
#include "format.h"
#include "liveness.h"

namespace cxlkv {

// The arbiter of a multihost observer that holds no row (host_slot.cpp, "Observers"): it reads
// only, so every arbitrated write is refused with ReadOnlyError instead of taking a lock it has
// no row for (a write without the lock would be a CAS across coherence domains). No node: no fence.
class RowLessArbiter final : public Arbiter {
 public:
  explicit RowLessArbiter(std::string pool) : pool_(std::move(pool)) {}
  void lock(const void*) override;
  void unlock(const void*) override {}
  void check_fence() override {}

 private:
  std::string pool_;
};

class Bakery final : public Arbiter {
 public:
  struct Config {
    char* base = nullptr;  // pool base as this attachment maps it
    uint32_t hosts = 0;    // lock_hosts of the header
    uint32_t slot = 0;     // this attachment's host slot
    uint32_t max_nodes = 0;
    format::NodeSlot* nodes = nullptr;  // node table (to read a ticket holder's beat)
    uint64_t lease_ns = 0;
    Coherence coh;  // unarbitrated: flush/invalidate of lock lines
    std::atomic<bool>* fenced = nullptr;
    std::atomic<uint64_t>* last_beat = nullptr;
    std::function<void()> tick;  // called while waiting (emulated hosts beat from their thread)
    std::string pool;            // "pool PATH", for the messages of FencedError and LockTimeoutError
    uint64_t host_id = 0;        // this host's id (a tier-1 word must name a node of it); 0: unchecked
    // Tier-1 identity (shared host slots): the lock file whose byte participant_base +
    // participant1 - 1 this attachment holds for its life; participant1 = 0: none (no usable lock
    // file, or an emulated host): tier-1 holders are then judged by silence only.
    const liveness::LockFile* lock = nullptr;
    uint64_t participant_base = 0;
    uint32_t participant1 = 0;
    uint64_t pool_bytes = 0;  // bounds of holder_line (0: never written back on takeover)
  };
  explicit Bakery(Config c);
  void set_node(uint32_t node, uint64_t node_word);
  void lock(const void* addr) override;
  void unlock(const void* addr) override;
  void check_fence() override;
  uint32_t stripe_of(const void* addr) const;
  // Tickets of other hosts skipped because they stood still for a lease with a silent holder.
  uint64_t skipped() const { return skipped_.load(std::memory_order_relaxed); }
  // Tickets found void at once: the named node is not attached on that row with that word
  // (reclaimed, replaced, or a stray write naming a node of another row).
  uint64_t voided() const { return voided_.load(std::memory_order_relaxed); }
  // A wait for one word (a tier-1 word, or one row's ticket in tier 2) that shows no progress
  // (the word and its `waits` unchanged) for this many leases fails the claim: LockTimeoutError
  // naming the stripe, the row and the word.
  static constexpr uint64_t kWaitLeases = 3;
  // Absolute bound of one claim, whatever the lock lines do meanwhile (a forged ticket whose
  // `waits` is bumped in bursts looks like progress forever): from lock()'s entry, the local
  // mutex, tier 1 and tier 2 together end within this many leases, or the claim fails with
  // LockTimeoutError naming the stripe, the row and the word it waited for last. An honest claim
  // waits at most about one lease (dead tickets, all watched at once) plus critical sections of
  // microseconds, so six leases leave a wide margin for a loaded machine.
  static constexpr uint64_t kClaimLeases = 6;
  // What a tier-1 word of row `row` can be, judged from the node table (never from the lock
  // line): `holder` names a node ALIVE in the word's epoch attached on that row (of this host,
  // for our own row); `nodeless` names no node (an attach in progress, an observer without a
  // slot); `stale` names a node not ALIVE in the word's epoch (reclaimed, replaced, or a forged
  // epoch): void once it stood still for a lease, by when any real holder of that incarnation
  // has fenced itself; `foreign` cannot be any process of that row's host (malformed, node out
  // of range, or a live node of another row or host): void at once.
  enum class Tier1Kind { free, holder, nodeless, stale, foreign };
  Tier1Kind classify_tier1(uint64_t word, uint32_t row) const;
  static const char* tier1_kind_name(Tier1Kind k);
  // `pool check`: the tier-1 word of (stripe, row) as memory holds it now.
  uint64_t read_tier1(uint32_t stripe, uint32_t row) const;
  // `pool check --repair` of our own row: takes over stripe k's tier-1 word if it is still
  // `seen` (a CAS among this host's processes), writing back what it guarded, then releases it.
  bool take_over_own_word(uint32_t stripe, uint64_t seen);
  // `pool check --repair` of a row with no live node: clears its tier-1 word and ticket if the
  // line still holds `seen_word` and `seen` (the one write of a row by another host).
  bool clear_orphaned_word(uint32_t stripe, uint32_t row, uint64_t seen_word, const format::LockLine& seen);
  // True when ticket t of row `row` can be its host's: it names a node that is ALIVE with the
  // ticket's word and attached on that row (NodeSlot::host_slot). Reads the node slot.
  bool ticket_owner_attached(const format::LockLine& t, uint32_t row) const;
  // Tier-1 words taken over from a dead or silent process of this host (and rows released for a
  // reclaimed node, release_dead).
  uint64_t takeovers() const { return takeovers_.load(std::memory_order_relaxed); }
  // At open: gives back tier-1 words of this row that name our participant byte. We hold its lock
  // now, so such a word is a dead previous holder's, and no waiter could ever judge it dead.
  void adopt_participant();
  // Reclaim of node `node` (epoch `epoch`) of this row, judged dead: releases every stripe whose
  // tier-1 word it still holds (its ticket is reset, so no host waits a lease for it), unless its
  // participant byte is still locked (a live process, reaped by force: it releases them itself).
  void release_dead(uint32_t node, uint32_t epoch);
  // Reaping: releases every stripe of our row whose tier-1 holder's process is gone (its
  // participant byte is free), whoever reclaimed its node (a host of another id cannot: the row
  // is written by this host's processes only). Returns the stripes released.
  uint32_t sweep();
  // Heartbeat chore: in every stripe whose tier-1 word no host-mate holds (and whose process-
  // local mutex is free), a non-zero ticket in our row is nobody's (a stray write, a fenced
  // holder's): reset it; a tier-1 word of a gone process or of no host-mate of this row is taken
  // over and released. Never blocks. Returns the stripes reset (counted in healed()).
  uint32_t heal_own_row();
  uint64_t healed() const { return healed_.load(std::memory_order_relaxed); }
  // The ticket words and `waits` of two reads of a line agree: every write of a row bumps `waits`,
  // so equal means "not written in between".
  static bool same_line(const format::LockLine& a, const format::LockLine& b);
  // `pool check` (lock_check.cpp): the ticket of (stripe, row) as memory holds it now.
  format::LockLine read_ticket(uint32_t stripe, uint32_t row) const;
  // Resets this attachment's own row of a stripe (we are its host): takes the tier-1 word if it
  // is free, writes the reset ticket back, gives the word back. False if a host-mate holds it.
  bool reset_own_row(uint32_t stripe);
  // Resets row `row` of a stripe whose host has no live node, if it still holds `seen`: the one
  // write of a row by another host (`pool check --repair` only; docs/ARCHITECTURE.md §11).
  bool reset_orphaned_row(uint32_t stripe, uint32_t row, const format::LockLine& seen);

 private:
  format::LockLine* line(uint32_t stripe, uint32_t host) const {
    return reinterpret_cast<format::LockLine*>(c_.base + format::kLockAreaOff) +
           (uint64_t(stripe) * c_.hosts + host);
  }
  void write_back(format::LockLine* l) const;
  uint64_t holder_beat(uint64_t node) const;
  bool fence_ok() const;  // check_fence without throwing
  uint64_t& tier1(uint32_t stripe) const { return line(stripe, c_.slot)->tier1; }
  bool tier1_cas(uint32_t stripe, uint64_t expected, uint64_t desired) const;
  // Tier 1 of stripe k for the line at addr (caller holds local_[k]); takes over a dead holder.
  // Returns true when it had to wait (the word was not free at once).
  bool acquire_tier1(uint32_t k, const void* addr, uint64_t deadline);
  void check_fence_at(uint64_t now);  // check_fence on a time read a few instructions ago
  void take_over(uint32_t k);         // after a CAS from a dead holder's word: its line, then ours
  // Gives the row of stripe k back: resets our ticket unless fenced, then frees the tier-1 word.
  void release_row(uint32_t k);
  void take_over_and_release(uint32_t k);  // take_over, then release_row (also on a throw)
  bool participant_gone(uint64_t word) const;
  [[noreturn]] void throw_wait_timeout(uint32_t stripe, uint32_t row, const format::LockLine& t,
                                       bool absolute) const;
  [[noreturn]] void throw_tier1_timeout(uint32_t stripe, uint64_t word, bool absolute) const;

  Config c_;
  std::string where_;  // "pool PATH: node N" (FencedError's prefix)
  uint32_t node_ = 0;
  uint64_t node_word_ = 0;
  uint64_t nonce_ = 0;             // told apart attachments that share (participant, node) = (0, 0)
  std::atomic<uint64_t> mine_{0};  // our tier-1 word
  std::array<std::timed_mutex, format::kLockStripes> local_;  // tier 1, threads of this attachment
  // heal_own_row's look at each stripe's tier-1 word when it was `stale` (under local_[k]): the
  // word and since when it stood still; taken over once it stood still for a lease.
  struct StaleWord {
    uint64_t word = 0, since = 0;
  };
  std::array<StaleWord, format::kLockStripes> stale_seen_{};
  std::array<uint32_t, format::kLockStripes> depth_{};  // re-entry guard (a bug, not a feature)
  // A node-less attachment (attach in progress, observer on a full node table) holds at most one
  // stripe at a time: its fence base (last_beat) is refreshed by its own line's writes, which
  // must be the writes of the ticket it holds. nodeless_held_[k]: released by unlock(k).
  std::recursive_mutex nodeless_mu_;
  std::array<bool, format::kLockStripes> nodeless_held_{};
  std::atomic<uint64_t> skipped_{0}, takeovers_{0}, voided_{0}, healed_{0};
  // Tickets this attachment already skipped after a lease of silence, per (stripe, row): the same
  // ticket, still with a silent holder, is skipped again at once instead of after another lease
  // (a host that died holding a ticket would otherwise cost every later acquire of the stripe a
  // lease). Touched only under local_[stripe].
  struct Skipped {
    uint64_t choosing = 0, number = 0, node = 0, node_word = 0, beat = 0;
    bool valid = false;
  };
  std::vector<Skipped> skipped_tickets_;  // [stripe * hosts + row]
  // Every other row's line as this attachment last saw it, with the holder's pulse then
  // (line.pad[0]) and since when it stands still, [stripe * hosts + row]. A row's line changes
  // `waits` on every write (bump), so "unchanged between two looks" means "not written in
  // between", however far apart the looks: lock() counts a dead ticket's lease from its first
  // look, and a blocked waiter looks at every stripe (sweep_observations), so dead tickets in
  // several stripes or rows cost one lease in all.
  struct Observed {
    format::LockLine line{};
    uint64_t since = 0;
    bool valid = false;
  };
  std::mutex watch_mu_;
  std::vector<Observed> observed_;
  void bump(format::LockLine* me) const;  // waits + 1: every write of our line changes it
  format::LockLine observe(uint32_t stripe, uint32_t row,
                           const std::function<uint64_t(const format::LockLine&)>& pulse,
                           uint64_t* since = nullptr);
  void sweep_observations(const std::function<uint64_t(const format::LockLine&)>& pulse);
  // observe() of every other row of a stripe, batched (lock()'s doorway): the largest number seen.
  // record: the one update of observed_ both make (under watch_mu_), for the line `now` seen at t.
  const Observed& record(uint32_t stripe, uint32_t row, const format::LockLine& now, uint64_t t);
  uint64_t observe_rows(uint32_t stripe, const std::function<uint64_t(const format::LockLine&)>& pulse);
};

}  // namespace cxlkv
