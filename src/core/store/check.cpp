// `pool check`: recomputes every invariant of format.h from the pool itself. Run after
// reap_dead_nodes(), so what a dead process left has been reclaimed; what remains is reported.
// Findings that a live node may legitimately cause in passing (an entry in WRITING, a pin being
// validated) are re-read after a short pause before they count.
//
// With repair (`pool check --repair`), what nobody else would ever release is released too, each
// on evidence re-read after that pause, and listed in CheckReport::repaired instead of errors:
//   - entries in WRITING/EVICTING whose node can never finish them (Index::abandoned_by);
//   - CONDEMNED entries no pin holds any more (an observer frees them only with repair; an attached
//     checker always did, as any attached node may);
//   - blocks USED by a gone incarnation that no entry points to (what a releaser that died between
//     its two steps leaves when it had no node id, Index::tombstone_then_free).
#include <chrono>
#include <cstring>
#include <iterator>
#include <map>
#include <set>
#include <thread>

#include "key_hash.h"
#include "liveness.h"
#include "pool.h"

namespace cxlkv {

using namespace format;

namespace {
const char* entry_state_name(uint8_t st) {
  static constexpr const char* kNames[] = {"EMPTY", "WRITING", "READY", "EVICTING", "TOMBSTONE", "CONDEMNED"};
  return st < std::size(kNames) ? kNames[st] : "an unknown state";
}
void pause_before_reread() { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }
}  // namespace

CheckReport Pool::check(bool repair, int64_t watch_ms) {
  CheckReport r;
  r.repair = repair;
  if (repair) become_writer();  // a row-less observer (host_slot.cpp): repairing is writing
  watch_undecided_nodes(r, watch_ms);
  // Reclaims of this attachment since it opened the pool (the reap at open included) or since
  // its last check: an observer `pool check` reports what its own open reclaimed (F20).
  r.reclaimed_nodes = reaped_unreported_.exchange(0, std::memory_order_relaxed);
  // The sections, in order. A new one takes the report (r.repair says whether it may fix).
  check_ns_lock(r);
  check_namespaces(r);
  check_index(r);
  check_quotas(r);
  check_pins(r);
  if (bakery_ || row_less_) check_lock_area(r);  // the cross-host lock area (multihost): lock_check.cpp
  if (r.duplicate_keys)
    r.warnings.push_back(
        std::to_string(r.duplicate_keys) +
        " keys are stored twice (a benign race between two writers; the copy is reclaimed by eviction)");
  return r;
}

// Nodes of another kernel are judged by their lease: watch until each one is decided (alive once
// its beat moves, dead after a lease of silence, then reclaimed), at most watch_ms (< 0: a lease
// and a quarter). A check that could not judge a node must not call the pool consistent.
void Pool::watch_undecided_nodes(CheckReport& r, int64_t watch_ms) {
  const uint64_t lease_ns = uint64_t(hdr_->lease_ms) * 1'000'000;
  const uint64_t watch_ns =
      watch_ms < 0 ? lease_ns + lease_ns / 4 + 100'000'000 : uint64_t(watch_ms) * 1'000'000;
  const uint64_t deadline = liveness::mono_ns() + watch_ns;
  uint64_t undecided = 0;
  reap_pass(&undecided);
  while (undecided && liveness::mono_ns() < deadline) {
    if (emu_.base) heartbeat_tick();  // an emulated host beats from its own thread
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<uint64_t>(20, hdr_->lease_ms / 8 + 1)));
    undecided = 0;
    reap_pass(&undecided);
  }
  r.undecided_nodes = undecided;
  if (undecided)
    r.error(std::to_string(undecided) + " nodes of another kernel are undecided (judged by their " +
            "heartbeat lease, which this check did not watch long enough): `cxlkv pool check` watches " +
            "up to a lease");
}

bool Pool::node_attached(uint8_t node) {
  if (node == 0 || node > hdr_->max_nodes) return false;
  uint8_t st = node_state(coh_.read(&node_slot(node - 1)->state));
  return st == kNodeAlive || st == kNodeClaimed;
}

// Namespace-table lock (F13): a holder that is out of range or not attached never releases it.
void Pool::check_ns_lock(CheckReport& r) {
  if (uint64_t stale = break_stale_ns_lock())
    r.error("namespace-table lock was held by node " + std::to_string(stale) +
            ", which is not attached (stale lock, now broken)");
}

void Pool::check_namespaces(CheckReport& r) {
  for (uint32_t id = 1; id <= hdr_->max_namespaces; ++id) {
    uint64_t w = coh_.read(&ns_entry(id)->state);
    if (ns_state(w) == kNsCreating && !node_attached(ns_node(w)))
      r.error("namespace " + std::to_string(id) + " stuck in CREATING");
    if (ns_state(w) > kNsReady) r.error("namespace " + std::to_string(id) + " has an invalid state");
    uint64_t bb = ns_entry(id)->layout.block_bytes;
    if (ns_state(w) == kNsReady && (bb == 0 || bb > kMaxBlockBytes))
      r.error("namespace " + std::to_string(id) + " has an impossible block size (ignored)");
  }
}

// Index entries: states, references, probe distance, duplicates; then chunks and block
// descriptors: accounting capacity == free + ready + in_flight + condemned. A finding about a
// READY entry counts only if the entry is unchanged after the pause (an eviction that hands the
// block to a new entry between our two reads is not an inconsistency).
void Pool::check_index(CheckReport& r) {
  std::map<uint32_t, NsHandle> ns;
  for (auto& [h, l] : list_namespaces()) ns[h.id] = h;
  std::set<std::pair<uint32_t, std::string>> keys;
  struct Suspect {  // an entry in WRITING/EVICTING that may be stuck, as first seen
    uint64_t slot, word, chunk, block;
  };
  std::vector<Suspect> suspects;
  struct EntryFinding {
    uint64_t slot, word;
    std::string what;
  };
  std::vector<EntryFinding> findings;
  auto ref_of = [&](uint64_t slot, uint64_t* chunk, uint64_t* block) {
    IndexEntry* e = entry(slot);
    coh_.invalidate(e, sizeof *e);
    *chunk = e->chunk, *block = e->block;
  };
  std::vector<uint64_t> intents_of(size_t(hdr_->max_nodes) + 1, 0);  // [node]: block-less WRITING entries
  for (uint64_t slot = 0; slot <= slot_mask_; ++slot) {
    uint64_t w = coh_.read(&entry(slot)->state);
    uint8_t st = entry_state(w);
    if (st == kEmpty || st == kTombstone) continue;
    if (st == kWriting && entry_node(w) <= hdr_->max_nodes) {
      uint64_t chunk, block;
      ref_of(slot, &chunk, &block);
      if (chunk == kNoChunk) ++intents_of[entry_node(w)], ++r.intents;
    }
    if (st == kCondemned) {
      // Any attached node may free it once nothing pins it; an observer only with repair.
      if ((node_id_ || r.repair) && index_.reclaim_condemned(slot) && r.repair)
        r.fixed("index slot " + std::to_string(slot) +
                ": freed the block of an entry condemned by a checksum failure (no pin left)");
      continue;  // still pinned (or not repaired): counted with the blocks below
    }
    if (st > kCondemned) {
      r.error("index slot " + std::to_string(slot) + " has invalid state " + std::to_string(st));
      continue;
    }
    if (st == kWriting || st == kEvicting) {
      if (!node_attached(entry_node(w)) || !index_.abandoned_by(slot, w, true).empty()) {
        Suspect s{slot, w, 0, 0};
        ref_of(slot, &s.chunk, &s.block);
        suspects.push_back(s);
      }
      continue;
    }
    IndexEntry e;
    if (!snapshot(slot, w, &e)) continue;
    const std::string at = "index slot " + std::to_string(slot);
    auto it = ns.find(e.ns_id);
    if (it == ns.end()) {
      findings.push_back({slot, w, at + " names unknown namespace " + std::to_string(e.ns_id)});
      continue;
    }
    if (!index_.validate_ref(it->second, e)) {
      findings.push_back({slot, w,
                          at + " points outside its namespace's chunks (chunk " + std::to_string(e.chunk) +
                              ", block " + std::to_string(e.block) + ")"});
      continue;
    }
    uint64_t dw = coh_.read(block_desc(e.chunk, e.block));
    if (block_state(dw) != kBlockUsed || block_slot(dw) != slot)
      findings.push_back({slot, w,
                          at + " points to block " + std::to_string(e.chunk) + ":" + std::to_string(e.block) +
                              " whose descriptor does not point back"});
    const uint64_t home = key_hash(e.key, e.ns_id, slot_mask_).home;
    if (((slot - home) & slot_mask_) >= kMaxProbe)
      findings.push_back({slot, w, at + " is outside its key's probe window"});
    if (!keys.emplace(e.ns_id, std::string(reinterpret_cast<char*>(e.key), 32)).second) ++r.duplicate_keys;
  }

  // Bounded intents: a node at its cap gets no more (its reserves report `capped`), and other
  // nodes' puts are unaffected; one above it was not built with the cap (or counted wrong).
  r.intent_cap = intent_cap();
  for (uint32_t n = 1; n <= hdr_->max_nodes; ++n) {
    if (intents_of[n] < r.intent_cap) continue;
    ++r.nodes_at_intent_cap;
    const std::string what = "node " + std::to_string(n) + " holds " + std::to_string(intents_of[n]) +
                             " block-less intents (reserve without a block); the cap per node is " +
                             std::to_string(r.intent_cap);
    if (intents_of[n] > r.intent_cap)
      r.error(what +
              ": more than the cap (a build without it?); they go when the node closes or is reclaimed");
    else
      r.warnings.push_back(what +
                           ": at its cap, its further intents are refused (other nodes' puts are not)");
  }

  // Re-read suspects once after a pause: only what did not move is a finding (or repaired). Before
  // the blocks are counted, so that a block freed here is counted free.
  if (!suspects.empty() || !findings.empty()) pause_before_reread();
  for (const auto& f : findings)
    if (coh_.read(&entry(f.slot)->state) == f.word) r.error(f.what);
  for (const Suspect& s : suspects) {
    const uint64_t w = coh_.read(&entry(s.slot)->state);
    uint64_t chunk, block;
    ref_of(s.slot, &chunk, &block);
    if (w != s.word || chunk != s.chunk || block != s.block) continue;  // it moved: not stuck
    const std::string why = index_.abandoned_by(s.slot, w, true);
    const uint8_t node = entry_node(w);
    std::string wait;  // why it is not released (yet), when no evidence says it is abandoned
    if (why.empty() && node_state(coh_.read(&node_slot(node - 1)->state)) == kNodeFree)
      wait = "node " + std::to_string(node) +
             " is not attached, but its fenced process still has the pool open: released once it closes";
    else if (why.empty())
      wait = "node " + std::to_string(node) + " is being reclaimed";
    const std::string at = "index slot " + std::to_string(s.slot) + " stuck in " +
                           entry_state_name(entry_state(w)) + " (" + (why.empty() ? wait : why) + ")";
    if (r.repair && !why.empty()) {
      if (index_.release_abandoned(s.slot, w)) r.fixed(at + ": tombstoned, its block freed");
      continue;  // or someone else released it first
    }
    if (!why.empty() || !node_attached(entry_node(w))) {
      ++r.stuck_entries;
      r.error(at + (why.empty() ? "" : "; `pool check --repair` releases it"));
    }
  }

  // Chunks and block descriptors.
  struct LeakSuspect {
    uint64_t chunk;
    uint32_t block;
    uint64_t desc;  // as first read
  };
  std::vector<LeakSuspect> leak_suspects;
  uint64_t condemned_pinned = 0;
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh_.read(chunk_word(c));
    uint8_t st = chunk_state(w);
    if (st == kChunkFree) {
      ++r.free_chunks;
      continue;
    }
    if (st == kChunkCarving || st == kChunkDraining) {
      if (!node_attached(chunk_node(w)))
        r.error("chunk " + std::to_string(c) +
                (st == kChunkCarving ? " stuck in CARVING" : " stuck in DRAINING"));
      continue;  // changing hands right now: its blocks are counted once it is ACTIVE again
    }
    if (st != kChunkActive) {
      r.error("chunk " + std::to_string(c) + " has invalid state");
      continue;
    }
    ++r.active_chunks;
    auto it = ns.find(chunk_ns(w));
    if (it == ns.end()) {
      r.error("chunk " + std::to_string(c) + " belongs to unknown namespace " + std::to_string(chunk_ns(w)));
      continue;
    }
    const NsHandle& h = it->second;
    r.capacity_blocks += h.geo.blocks;
    for (uint32_t b = 0; b < desc_bytes_ / 8; ++b) {
      uint64_t dw = coh_.read(block_desc(c, b));
      if (b >= h.geo.blocks) {
        if (dw) r.error("descriptor beyond the chunk's blocks is in use");
        continue;
      }
      if (dw == 0) {
        ++r.free_blocks;
        continue;
      }
      uint64_t slot = block_slot(dw);
      if (block_state(dw) != kBlockUsed || slot > slot_mask_) {
        r.error("block " + std::to_string(c) + ":" + std::to_string(b) + " has an invalid descriptor");
        continue;
      }
      uint64_t ew = coh_.read(&entry(slot)->state);
      IndexEntry e;
      bool snap = snapshot(slot, ew, &e);
      bool back = snap && e.chunk == c && e.block == b;
      uint8_t est = entry_state(ew);
      if (back && est == kReady) {
        ++r.ready_blocks;
      } else if (back && est == kCondemned) {
        ++r.condemned_blocks;
        condemned_pinned += index_.is_pinned(slot, entry_gen(ew));
      } else if (back && (est == kWriting || est == kEvicting)) {
        ++r.inflight_blocks;
      } else if (incarnation_alive(block_node(dw), block_epoch(dw))) {
        ++r.inflight_blocks;  // owner is between two steps
      } else {
        leak_suspects.push_back({c, b, dw});
      }
    }
  }

  if (!leak_suspects.empty()) pause_before_reread();
  for (const LeakSuspect& l : leak_suspects) {
    uint64_t* d = block_desc(l.chunk, l.block);
    uint64_t dw = coh_.read(d);
    if (dw == 0) {
      ++r.free_blocks;
      continue;
    }
    uint64_t slot = block_slot(dw);
    IndexEntry e;
    uint64_t ew = coh_.read(&entry(slot)->state);
    const bool back = snapshot(slot, ew, &e) && e.chunk == l.chunk && e.block == l.block;
    if (back && entry_state(ew) >= kWriting && entry_state(ew) <= kEvicting) {
      (entry_state(ew) == kReady ? r.ready_blocks : r.inflight_blocks)++;
      continue;
    }
    if (back && entry_state(ew) == kCondemned) {
      ++r.condemned_blocks;
      condemned_pinned += index_.is_pinned(slot, entry_gen(ew));
      continue;
    }
    const std::string at = "block " + std::to_string(l.chunk) + ":" + std::to_string(l.block);
    // Unchanged since first seen, its owner's incarnation gone, no entry pointing back: nobody
    // else frees it (a reclaim of that owner has run or cannot run: its slot moved on).
    if (r.repair && dw == l.desc && !incarnation_alive(block_node(dw), block_epoch(dw))) {
      if (coh_.claim(d, dw, 0)) {
        ++r.free_blocks;
        r.fixed(at + ": freed (used by a gone incarnation of node " + std::to_string(block_node(dw)) +
                ", no index entry pointed to it)");
      } else {  // another repairer freed it first (or it was handed out since: in use again)
        (coh_.read(d) == 0 ? r.free_blocks : r.inflight_blocks)++;
      }
      continue;
    }
    ++r.leaked_blocks;
    // Who claimed it and for which slot, and what that slot holds now: where to look for the cause.
    r.error(at + " is leaked (used by node " + std::to_string(block_node(dw)) + " epoch " +
            std::to_string(block_epoch(dw)) + " for slot " + std::to_string(slot) + ", now " +
            entry_state_name(entry_state(ew)) + "; no index entry points to it)" +
            (r.repair ? "" : "; `pool check --repair` frees it"));
  }
  if (r.capacity_blocks !=
      r.free_blocks + r.ready_blocks + r.inflight_blocks + r.condemned_blocks + r.leaked_blocks)
    r.error("accounting: capacity " + std::to_string(r.capacity_blocks) + " != free " +
            std::to_string(r.free_blocks) + " + ready " + std::to_string(r.ready_blocks) + " + in flight " +
            std::to_string(r.inflight_blocks) + " + condemned " + std::to_string(r.condemned_blocks));
  if (condemned_pinned)
    r.warnings.push_back(std::to_string(condemned_pinned) +
                         " blocks failed their checksum and wait for their readers' pins to be released");
  if (r.condemned_blocks > condemned_pinned)
    r.warnings.push_back(std::to_string(r.condemned_blocks - condemned_pinned) +
                         " blocks failed their checksum and no pin holds them any more: eviction "
                         "reuses them first, `pool check --repair` frees them now");
}

// Pins: only attached nodes may hold pins.
void Pool::check_pins(CheckReport& r) {
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    uint8_t st = node_state(coh_.read(&node_slot(i)->state));
    uint64_t hw = std::min<uint64_t>(coh_.read(&node_fixed(i)->pin_hw), hdr_->pin_slots);
    if (st == kNodeFree) hw = hdr_->pin_slots;  // a free slot's whole pin array must be clear
    for (uint64_t p = 0; p < hw; ++p) {
      if (coh_.read_hint(&pins(i)[p]) == 0) continue;
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
void Pool::check_quotas(CheckReport& r) {
  std::vector<QuotaInfo> rows = quotas_.rows(hdr_->max_nodes);
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
  for (uint64_t slot = 0; slot <= slot_mask_; ++slot) {
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
    if (e.chunk >= hdr_->chunk_count || e.block >= desc_bytes_ / 8) continue;
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
    const int64_t counted = quotas_.raw_usage(q.row, hdr_->max_nodes);
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

}  // namespace cxlkv
