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
// Repairs: our own row is ours to write, so its stale tickets are reset by every check. A row
// with no live node (orphaned) is reset only with --repair, and only if the ticket is still the
// one we saw: it is the one write of a row by another host, safe as long as no host starts using
// that row during the check (a host that attaches there probes or is configured there and writes
// its first ticket after its attach publishes it; a row is orphaned only while no node names it).
#include <chrono>
#include <thread>

#include "pool.h"

namespace cxlkv {

using namespace format;

namespace {
bool same_ticket(const LockLine& a, const LockLine& b) {
  return a.choosing == b.choosing && a.number == b.number && a.node == b.node && a.node_word == b.node_word;
}
std::string describe(uint32_t k, uint32_t j, const LockLine& t) {
  return "lock stripe " + std::to_string(k) + " row " + std::to_string(j) + ": ticket (choosing " +
         std::to_string(t.choosing) + ", number " + std::to_string(t.number) + ", node " +
         std::to_string(t.node) + ")";
}
}  // namespace

void Pool::check_lock_area(CheckReport& r) {
  const bool repair = r.repair;
  const uint32_t hosts = hdr_->lock_hosts;
  struct Seen {
    uint32_t k, j;
    LockLine t;
  };
  std::vector<Seen> seen;
  for (uint32_t k = 0; k < kLockStripes; ++k)
    for (uint32_t j = 0; j < hosts; ++j) {
      LockLine t = bakery_->read_ticket(k, j);
      if (t.choosing || t.number) seen.push_back({k, j, t});  // a release leaves node/node_word
    }
  if (seen.empty()) return;
  // A live holder's ticket moves within microseconds: judge only what stood still.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RowUse use = row_use();
  for (const Seen& s : seen) {
    if (!same_ticket(bakery_->read_ticket(s.k, s.j), s.t)) continue;
    const bool own = s.j == host_slot_;
    const bool row_live = own ? node_id_ != 0 || use.mate[s.j] : use.mate[s.j] || use.other[s.j] != 0;
    const std::string what = describe(s.k, s.j, s.t);
    if (s.t.node != 0 && bakery_->ticket_owner_attached(s.t, s.j)) {
      ++r.lock_tickets_stuck;
      r.warnings.push_back(what + " of live node " + std::to_string(s.t.node) +
                           " did not move while checked (a holder stalled inside the lock?)");
      continue;
    }
    bool foreign = false;
    if (s.t.node != 0 && s.t.node <= hdr_->max_nodes) {
      NodeSlot* n = node_slot(uint32_t(s.t.node - 1));
      foreign = coh_.read(&n->state) == s.t.node_word && node_state(s.t.node_word) == kNodeAlive;
      if (foreign) {
        coh_.invalidate(n, sizeof *n);
        foreign = n->host_slot != uint64_t(s.j) + 1;
      }
    }
    bool reset = false;
    if (own || (repair && !row_live)) {
      try {
        reset = bakery_->reset_orphaned_row(s.k, s.j, s.t);
      } catch (const FencedError&) {
      }
    }
    if (reset) {
      ++r.lock_rows_reset;
      r.fixed(what + (foreign ? " (foreign)" : " (stale)") + " reset");
      continue;
    }
    if (foreign) {
      ++r.lock_tickets_foreign;
      r.error(what + " names node " + std::to_string(s.t.node) +
              " of another row: a stray or hostile write (waiters ignore it)" +
              (row_live ? "; its row's host overwrites it on its next lock"
                        : "; `cxlkv pool check --repair` resets it"));
    } else {
      ++r.lock_tickets_stale;
      r.warnings.push_back(what + " is stale (its holder is gone; waiters ignore it)" +
                           (row_live ? "" : "; `cxlkv pool check --repair` resets it"));
    }
  }
}

}  // namespace cxlkv
