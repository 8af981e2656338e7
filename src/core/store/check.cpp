// `pool check` (Checker, check.h): the run and its sections but the index's (check_blocks.cpp).
// Run after a reap, so what a dead process left has been reclaimed; what remains is reported.
// Findings that a live node may legitimately cause in passing (an entry in WRITING, a pin being
// validated) are re-read after a short pause before they count.
//
// With repair (`pool check --repair`), what nobody else would ever release is released too, each
// on evidence re-read after that pause, and listed in CheckReport::repaired instead of errors:
//   - entries in WRITING/EVICTING whose node can never finish them (Index::abandoned_by);
//   - CONDEMNED entries no pin holds any more (an observer frees them only with repair; an attached
//     checker always did, as any attached node may);
//   - blocks USED by a gone incarnation that no entry points to (what a releaser that died between
//     its two steps leaves when it had no node id, Index::tombstone_then_free);
//   - quota usage counters that differ from the blocks' recount (booked into this node's counters);
//   - lock-area lines waiters already ignore (nodes/lock_check.h).
#include <algorithm>
#include <chrono>
#include <thread>

#include "check.h"
#include "liveness.h"

namespace cxlkv {

using namespace format;

CheckReport Checker::run(bool repair, int64_t watch_ms) {
  CheckReport r;
  r.repair = repair;
  if (repair) peers_.become_writer();  // a row-less observer (host_slot.cpp): repairing is writing
  watch_undecided_nodes(r, watch_ms);
  // Reclaims of this attachment since it opened the pool (the reap at open included) or since
  // its last check: an observer `pool check` reports what its own open reclaimed (F20).
  r.reclaimed_nodes = peers_.take_reclaimed();
  // The sections, in order. A new one takes the report (r.repair says whether it may fix).
  check_ns_lock(r);
  check_namespaces(r);
  check_index(r);
  check_quotas(r);
  check_pins(r);
  check_lock_area(r);  // the cross-host lock area (multihost), if the pool has one
  if (r.duplicate_keys)
    r.warnings.push_back(
        std::to_string(r.duplicate_keys) +
        " keys are stored twice (a benign race between two writers; the copy is reclaimed by eviction)");
  return r;
}

// Nodes of another kernel are judged by their lease: watch until each one is decided (alive once
// its beat moves, dead after a lease of silence, then reclaimed), at most watch_ms (< 0: a lease
// and a quarter). A check that could not judge a node must not call the pool consistent.
void Checker::watch_undecided_nodes(CheckReport& r, int64_t watch_ms) {
  const uint64_t lease_ns = uint64_t(hdr().lease_ms) * 1'000'000;
  const uint64_t watch_ns =
      watch_ms < 0 ? lease_ns + lease_ns / 4 + 100'000'000 : uint64_t(watch_ms) * 1'000'000;
  const uint64_t deadline = liveness::mono_ns() + watch_ns;
  uint64_t undecided = 0;
  peers_.reap_for_check(&undecided);
  while (undecided && liveness::mono_ns() < deadline) {
    peers_.beat_while_watching();
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<uint64_t>(20, hdr().lease_ms / 8 + 1)));
    undecided = 0;
    peers_.reap_for_check(&undecided);
  }
  r.undecided_nodes = undecided;
  if (undecided)
    r.error(std::to_string(undecided) + " nodes of another kernel are undecided (judged by their " +
            "heartbeat lease, which this check did not watch long enough): `cxlkv pool check` watches " +
            "up to a lease");
}

bool Checker::node_attached(uint8_t node) {
  if (node == 0 || node > hdr().max_nodes) return false;
  uint8_t st = node_state(coh_.read(&region_.node_slot(node - 1)->state));
  return st == kNodeAlive || st == kNodeClaimed;
}

void Checker::entry_ref(uint64_t slot, uint64_t* chunk, uint64_t* block) {
  IndexEntry* e = entry(slot);
  coh_.invalidate(e, sizeof *e);
  *chunk = e->chunk, *block = e->block;
}

// Namespace-table lock (F13): a holder that is out of range or not attached never releases it.
void Checker::check_ns_lock(CheckReport& r) {
  if (uint64_t stale = namespaces_.break_stale_lock())
    r.error("namespace-table lock was held by node " + std::to_string(stale) +
            ", which is not attached (stale lock, now broken)");
}

void Checker::check_namespaces(CheckReport& r) {
  for (uint32_t id = 1; id <= hdr().max_namespaces; ++id) {
    uint64_t w = coh_.read(&region_.ns_entry(id)->state);
    if (ns_state(w) == kNsCreating && !node_attached(ns_node(w)))
      r.error("namespace " + std::to_string(id) + " stuck in CREATING");
    if (ns_state(w) > kNsReady) r.error("namespace " + std::to_string(id) + " has an invalid state");
    uint64_t bb = region_.ns_entry(id)->layout.block_bytes;
    if (ns_state(w) == kNsReady && (bb == 0 || bb > kMaxBlockBytes))
      r.error("namespace " + std::to_string(id) + " has an impossible block size (ignored)");
  }
}

// Pins: only attached nodes may hold pins.
void Checker::check_pins(CheckReport& r) {
  for (uint32_t i = 0; i < hdr().max_nodes; ++i) {
    uint8_t st = node_state(coh_.read(&region_.node_slot(i)->state));
    uint64_t hw = std::min<uint64_t>(coh_.read(&region_.node_fixed(i)->pin_hw), hdr().pin_slots);
    if (st == kNodeFree) hw = hdr().pin_slots;  // a free slot's whole pin array must be clear
    for (uint64_t p = 0; p < hw; ++p) {
      if (coh_.read_hint(&region_.pins(i)[p]) == 0) continue;
      if (st == kNodeFree || !node_attached(uint8_t(i + 1))) {
        ++r.orphan_pins;
        r.error("node " + std::to_string(i + 1) + " (not attached) still holds a pin");
      }
    }
  }
}

// `pool check`: every row readable and well-formed, every entry's rows naming rows in use, and
// each row's usage recounted from the blocks (entries that hold a block pointing back). A live
// pool may differ by the puts in flight (a warning); --repair books the difference into this
// node's counters.
void Checker::check_quotas(CheckReport& r) {
  std::vector<QuotaInfo> rows = quotas_.rows(hdr().max_nodes);
  if (rows.empty()) return;  // no row was ever used: nothing to recount (check stays one index pass)
  std::vector<bool> in_use(kQuotaRows + 1, false);
  for (const QuotaInfo& q : rows) {
    if (!q.readable) {
      r.error("quota row " + std::to_string(q.row) +
              " is unreadable (checksum or field out of range): " + "no limit is enforced from it");
      continue;
    }
    in_use[q.row] = true;
    if (q.kind == kQuotaNamespace && quotas_.block_bytes_of(q.ns_id) == 0)
      r.error("quota row " + std::to_string(q.row) + " names namespace " + std::to_string(q.ns_id) +
              ", which does not exist");
  }
  std::vector<int64_t> held(kQuotaRows + 1, 0);
  uint64_t bad_rows = 0;
  for (uint64_t slot = 0; slot <= slot_mask(); ++slot) {
    const uint64_t w = coh_.read(&entry(slot)->state);
    const uint8_t st = entry_state(w);
    if (st != kWriting && st != kReady && st != kEvicting && st != kCondemned) continue;
    IndexEntry e;
    if (!snapshot(slot, w, &e) || (!e.tenant_row && !e.ns_row)) continue;
    if (e.tenant_row > kQuotaRows || e.ns_row > kQuotaRows || (e.tenant_row && !in_use[e.tenant_row]) ||
        (e.ns_row && !in_use[e.ns_row])) {
      ++bad_rows;
      continue;
    }
    if (e.chunk >= hdr().chunk_count || e.block >= desc_bytes() / 8) continue;
    const uint64_t dw = coh_.read(block_desc(e.chunk, e.block));
    if (block_state(dw) != kBlockUsed || block_slot(dw) != slot) continue;
    const int64_t bytes = int64_t(quotas_.block_bytes_of(e.ns_id));
    if (e.tenant_row) held[e.tenant_row] += bytes;
    if (e.ns_row) held[e.ns_row] += bytes;
  }
  if (bad_rows)
    r.error(std::to_string(bad_rows) +
            " index entries name quota rows not in use (their blocks are charged to nobody)");
  for (const QuotaInfo& q : rows) {
    if (!q.readable) continue;
    const int64_t counted = quotas_.raw_usage(q.row, hdr().max_nodes);
    if (counted == held[q.row]) continue;
    const std::string who =
        q.kind == kQuotaTenant ? "tenant '" + q.tenant + "'" : "namespace " + std::to_string(q.ns_id);
    const std::string what = "quota usage of " + who + ": counters say " + std::to_string(counted) +
                             " bytes, its blocks hold " + std::to_string(held[q.row]);
    if (r.repair && node_id_ && !read_only_) {
      const int64_t diff = held[q.row] - counted;
      quotas_.book(node_id_, uint8_t(q.row), uint64_t(diff > 0 ? diff : -diff), diff > 0);
      r.fixed(what + " (booked the difference)");
    } else {
      r.warnings.push_back(what + (r.repair ? " (not repaired: no node slot)" : ""));
    }
  }
}

// The lock area (nodes/lock_check.h): LockCheck judges, with the node side's view of the lock and
// its row use (Peers::check_lock_area); its findings join the report.
void Checker::check_lock_area(CheckReport& r) {
  LockReport l;
  l.repair = r.repair;
  if (!peers_.check_lock_area(l)) return;
  r.lock += l;
  for (auto& e : l.errors) r.error(e);
  r.warnings.insert(r.warnings.end(), l.warnings.begin(), l.warnings.end());
  for (auto& f : l.repaired) r.fixed(f);
}

}  // namespace cxlkv
