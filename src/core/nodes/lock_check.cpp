// `pool check` of the cross-host lock area (multihost): every (stripe, row) ticket is untrusted
// input, judged the way a waiter judges it (Bakery::lock) and reported by kind. See
// docs/ARCHITECTURE.md §11 "A lock no stray write can wedge".
//
//   foreign: names a node that is attached, in the ticket's incarnation, on ANOTHER row: no host
//            writes that, so it is a stray or hostile write. Waiters treat the row as empty. Error.
//   stale:   names a node that is no longer attached with that word (reclaimed, replaced), or no
//            node at all (taken during an attach, or by an observer without a node slot) and did
//            not move while we looked. Waiters void the first kind at once and skip the second
//            after a lease of standstill. Warning: harmless, but a row no host owns keeps it.
//   stuck:   the ticket of a live holder of that row that did not move while we looked (a
//            critical section lasts microseconds). Warning; a waiter gives up on it after
//            Bakery::kWaitLeases leases (LockTimeoutError).
// Repairs: our own row is ours to write, so its stale tickets are reset by every check (under its
// tier-1 word). A row with no live node (orphaned) is reset only with --repair, only for tickets
// every waiter already ignores (void, or node-less), only once its whole line (`waits`
// included: every write of a row changes it) stood still for a lease, and only if the line is
// still that one right before the write-back. It is the one write of a row by another host: a
// host that starts on that row (its attach takes the row before its node is ALIVE) in the
// instant between that last compare and the write-back is the residual race, which is why it is
// an operator's action and never a waiter's. Rows whose host lives heal themselves
// (Bakery::heal_own_row, on every beat).
#include "lock_check.h"

#include <chrono>
#include <thread>

#include "errors.h"
#include "liveness.h"

namespace cxlkv {

using namespace format;

namespace {
std::string describe(uint32_t k, uint32_t j, const LockLine& t) {
  return "lock stripe " + std::to_string(k) + " row " + std::to_string(j) + ": ticket (choosing " +
         std::to_string(t.choosing) + ", number " + std::to_string(t.number) + ", node " +
         std::to_string(t.node) + ")";
}
}  // namespace

void LockCheck::run(LockReport& r) {
  check_tier1_words(r);
  const uint32_t hosts = region_.header()->lock_hosts;
  struct Seen {
    uint32_t k, j;
    LockLine t;
    bool foreign = false, row_live = false;
  };
  std::vector<Seen> seen;
  for (uint32_t k = 0; k < kLockStripes; ++k)
    for (uint32_t j = 0; j < hosts; ++j) {
      LockLine t = view_.read_ticket(k, j);
      if (t.choosing || t.number) seen.push_back({k, j, t});  // a release leaves node/node_word
    }
  if (seen.empty()) return;
  const uint64_t first_look = liveness::mono_ns();
  // A live holder's ticket moves within microseconds: judge only what stood still (every write
  // of a row changes its `waits`, so an unchanged line was not written in between).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RowUse use = row_use_();
  std::vector<Seen> orphaned;  // --repair: reset once they stood still for a lease
  for (Seen& s : seen) {
    if (!Bakery::same_line(view_.read_ticket(s.k, s.j), s.t)) continue;
    const bool own = own_row(s.j);
    s.row_live = own ? attached_ || use.mate[s.j] : use.mate[s.j] || use.other[s.j] != 0;
    const std::string what = describe(s.k, s.j, s.t);
    if (s.t.node != 0 && view_.ticket_owner_attached(s.t, s.j)) {
      ++r.tickets_stuck;
      r.warnings.push_back(what + " of live node " + std::to_string(s.t.node) +
                           " did not move while checked (a holder stalled inside the lock?)");
      continue;
    }
    if (s.t.node != 0 && s.t.node <= region_.header()->max_nodes) {
      NodeSlot* n = region_.node_slot(uint32_t(s.t.node - 1));
      s.foreign = coh().read(&n->state) == s.t.node_word && node_state(s.t.node_word) == kNodeAlive;
      if (s.foreign) {
        coh().invalidate(n, sizeof *n);
        s.foreign = n->host_slot != uint64_t(s.j) + 1;
      }
    }
    // Our own row is ours to write: reset under its tier-1 word (a host-mate that holds the word,
    // e.g. while attaching, keeps its ticket).
    bool reset = false;
    if (own) try {
        reset = view_.reset_own_row(s.k);
      } catch (const FencedError&) {
      }
    if (reset) {
      ++r.rows_reset;
      r.fixed(what + (s.foreign ? " (foreign)" : " (stale)") + " reset");
    } else if (r.repair && !s.row_live && !own) {
      orphaned.push_back(s);
    } else {
      report_ticket(r, s.t, what, s.foreign, s.row_live);
    }
  }
  if (orphaned.empty()) return;
  // --repair on rows no live node owns: only tickets every waiter already ignores (void, or
  // skipped after a lease of standstill), and only once the line stood still for a whole lease on
  // our clock (an attacher of that row that waits keeps advancing `waits`), and the row still
  // has no live node. The reset compares the whole line again right before its write-back.
  const uint64_t lease_ns = uint64_t(region_.header()->lease_ms) * 1'000'000;
  const uint64_t now = liveness::mono_ns();
  if (now < first_look + lease_ns + 10'000'000)
    std::this_thread::sleep_for(std::chrono::nanoseconds(first_look + lease_ns + 10'000'000 - now));
  use = row_use_();
  for (const Seen& s : orphaned) {
    const std::string what = describe(s.k, s.j, s.t);
    bool reset = false;
    if (!use.mate[s.j] && !use.other[s.j]) try {
        reset = view_.reset_orphaned_row(s.k, s.j, s.t);
      } catch (const FencedError&) {
      }
    if (reset) {
      ++r.rows_reset;
      r.fixed(what + (s.foreign ? " (foreign)" : " (stale)") + " reset (no host owns the row)");
    } else if (Bakery::same_line(view_.read_ticket(s.k, s.j), s.t)) {
      report_ticket(r, s.t, what, s.foreign, true);
    }
  }
}

// Tier-1 words (host-local: a host's processes CAS them; another host reads whatever memory holds)
// judged as a waiter of that row would (Bakery::classify_tier1): `foreign` (no process of the
// row's host wrote it) is an error, void for waiters at once; `stale` (its node is not ALIVE in
// the word's epoch: a crashed holder's, or forged) is a warning, void once it stood still for a
// lease; a live holder's word that did not move while we looked is a warning (a holder stalled
// inside the lock?), never touched. --repair clears only what waiters already ignore: foreign
// words, and stale ones unchanged for a lease; in our own row by a CAS among our host's
// processes (a takeover), in a row with no live node by the one write of a row by another host
// (the word and the line compared right before it); a row whose host lives clears them itself
// (Bakery::heal_own_row, every beat).
void LockCheck::check_tier1_words(LockReport& r) {
  using Kind = Bakery::Tier1Kind;
  struct Word {
    uint32_t k, j;
    uint64_t w;
    LockLine t;
  };
  std::vector<Word> found;
  for (uint32_t k = 0; k < kLockStripes; ++k)
    for (uint32_t j = 0; j < region_.header()->lock_hosts; ++j)
      if (uint64_t w = view_.read_tier1(k, j)) found.push_back({k, j, w, view_.read_ticket(k, j)});
  if (found.empty()) return;
  const uint64_t first_look = liveness::mono_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a live holder's word moves at once
  auto describe_word = [&](const Word& x, Kind kind) {
    std::string s = "lock stripe " + std::to_string(x.k) + " row " + std::to_string(x.j) +
                    ": tier-1 word (participant " + std::to_string(tier1_participant1(x.w)) + ", node " +
                    std::to_string(tier1_node(x.w)) + ", epoch " + std::to_string(tier1_epoch(x.w)) +
                    ") is " + Bakery::tier1_kind_name(kind);
    const uint32_t node = tier1_node(x.w);
    if (node != 0 && node <= region_.header()->max_nodes) {
      NodeSlot* n = region_.node_slot(node - 1);
      const uint64_t st = coh().read(&n->state);
      coh().invalidate(n, sizeof *n);
      s += " (node " + std::to_string(node) + " is " +
           (node_state(st) == kNodeAlive ? "ALIVE in epoch " + std::to_string(node_epoch(st) & 0xFFFFFF) +
                                               " on row " + std::to_string(int64_t(n->host_slot) - 1)
                                         : std::string("not ALIVE")) +
           ")";
    }
    return s;
  };
  const RowUse use = row_use_();
  std::vector<Word> later;  // --repair: stale words, cleared once they stood still for a lease
  for (const Word& x : found) {
    if (view_.read_tier1(x.k, x.j) != x.w) continue;  // moved: a live holder's
    const Kind kind = view_.classify_tier1(x.w, x.j);
    const std::string what = describe_word(x, kind);
    const bool own = own_row(x.j), row_live = own || use.mate[x.j] || use.other[x.j] != 0;
    if (kind == Kind::holder || kind == Kind::nodeless) {
      ++r.words_held;
      r.warnings.push_back(what + ": it did not move while checked (a holder stalled inside the lock?)");
      continue;
    }
    if (r.repair && kind == Kind::foreign && (own || !row_live)) {
      bool reset = false;
      try {
        reset = view_.clear_orphaned_word(x.k, x.j, x.w, x.t);
      } catch (const FencedError&) {
      }
      if (reset) {
        ++r.words_reset;
        r.fixed(what + ": cleared");
        continue;
      }
    }
    if (r.repair && kind == Kind::stale && (own || !row_live)) {
      later.push_back(x);
      continue;
    }
    const std::string after = row_live ? "; its row's host clears it within a lease and a quarter"
                                       : "; `cxlkv pool check --repair` clears it";
    if (kind == Kind::foreign) {
      ++r.words_foreign;
      r.error(what + ": a stray or hostile write (waiters take it over at once)" + after);
    } else {
      ++r.words_stale;
      r.warnings.push_back(what + ": waiters take it over after a lease of standstill" + after);
    }
  }
  if (later.empty()) return;
  const uint64_t lease_ns = uint64_t(region_.header()->lease_ms) * 1'000'000, now = liveness::mono_ns();
  if (now < first_look + lease_ns + 10'000'000)
    std::this_thread::sleep_for(std::chrono::nanoseconds(first_look + lease_ns + 10'000'000 - now));
  const RowUse use2 = row_use_();
  for (const Word& x : later) {
    const Kind kind = view_.classify_tier1(x.w, x.j);
    const std::string what = describe_word(x, kind);
    bool reset = false;
    if (kind == Kind::stale && (own_row(x.j) || (!use2.mate[x.j] && !use2.other[x.j]))) try {
        reset = view_.clear_orphaned_word(x.k, x.j, x.w, x.t);
      } catch (const FencedError&) {
      }
    if (reset) {
      ++r.words_reset;
      r.fixed(what + ": cleared after a lease of standstill");
    } else if (view_.read_tier1(x.k, x.j) == x.w) {
      ++r.words_stale;
      r.warnings.push_back(what + ": still there after a lease; not cleared (its row has a live host now)");
    }
  }
}

void LockCheck::report_ticket(LockReport& r, const LockLine& t, const std::string& what, bool foreign,
                              bool row_live) {
  if (foreign) {
    ++r.tickets_foreign;
    r.error(what + " names node " + std::to_string(t.node) +
            " of another row: a stray or hostile write (waiters ignore it)" +
            (row_live ? "; its row's host resets it within a quarter lease"
                      : "; `cxlkv pool check --repair` resets it"));
  } else {
    ++r.tickets_stale;
    r.warnings.push_back(what + " is stale (its holder is gone; waiters ignore it)" +
                         (row_live ? "" : "; `cxlkv pool check --repair` resets it"));
  }
}

}  // namespace cxlkv
