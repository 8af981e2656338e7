// LockCheck: `pool check` of the cross-host lock area (multihost), lock_check.cpp. Every ticket and
// tier-1 word is untrusted input, judged the way a waiter judges it (Bakery) and reported with its
// stripe, row and evidence; with `repair` it clears only what waiters already ignore, never a live
// holder's line. Handed the region, the Bakery to read through and who this attachment is; it asks
// the node table back only which rows have a live node now (RowUse, a callback: the judge's
// verdicts are the node table's). It knows no Pool: Pool::check merges its LockReport.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "arbiter.h"
#include "region.h"

namespace cxlkv {

// Which rows of the lock area have a live node now, as the node table's judge sees it (undecided
// counts as live; this attachment is left out).
struct RowUse {
  std::vector<bool> mate;       // a live host-mate (same host id, shares rows) is on the row
  std::vector<uint32_t> other;  // a live node of another host id is on the row (its id), else 0
};

// What the lock check found and, with `repair`, what it cleared.
// What a lock-area check counts (LockReport; `pool check`'s CheckReport::lock sums them).
struct LockFindings {
  uint64_t tickets_foreign = 0;  // names a live node of another row: a stray or hostile write
  uint64_t tickets_stale = 0;    // its holder was reclaimed or never had a node; void for waiters
  uint64_t tickets_stuck = 0;    // a live holder's ticket that did not move while we looked
  uint64_t rows_reset = 0;       // tickets reset (our own row always; orphaned rows with repair)
  uint64_t words_foreign = 0;    // tier-1 words no process of their row's host can have written
  uint64_t words_stale = 0;      // tier-1 words naming a node not ALIVE in the word's epoch
  uint64_t words_held = 0;       // tier-1 words of a live holder that did not move while we looked
  uint64_t words_reset = 0;      // tier-1 words cleared (repair: what waiters already ignore)
  LockFindings& operator+=(const LockFindings& o) {
    tickets_foreign += o.tickets_foreign, tickets_stale += o.tickets_stale, tickets_stuck += o.tickets_stuck;
    rows_reset += o.rows_reset, words_foreign += o.words_foreign, words_stale += o.words_stale;
    words_held += o.words_held, words_reset += o.words_reset;
    return *this;
  }
};

struct LockReport : LockFindings {
  bool repair = false;  // input: `pool check --repair`
  std::vector<std::string> errors, warnings, repaired;
  void error(const std::string& what) { errors.push_back(what); }
  void fixed(const std::string& what) { repaired.push_back(what); }
};

class LockCheck {
 public:
  // view: our Bakery, or for a row-less observer one that owns no row; own_row: this attachment's
  // row (-1: none); attached: this attachment holds a node slot; row_use: reads the node table now.
  LockCheck(Region& region, Bakery& view, int64_t own_row, bool attached, std::function<RowUse()> row_use)
      : region_(region), view_(view), own_row_(own_row), attached_(attached), row_use_(std::move(row_use)) {}
  // Tier-1 words first, then the tickets (both may sleep a lease to see what stands still).
  void run(LockReport& r);

 private:
  void check_tier1_words(LockReport& r);
  void report_ticket(LockReport& r, const format::LockLine& t, const std::string& what, bool foreign,
                     bool row_live);
  bool own_row(uint32_t row) const { return own_row_ >= 0 && row == uint64_t(own_row_); }
  Coherence& coh() { return region_.coh(); }

  Region& region_;
  Bakery& view_;
  const int64_t own_row_;
  const bool attached_;
  const std::function<RowUse()> row_use_;
};

}  // namespace cxlkv
