// `pool check`: recomputes every invariant of format.h from the pool itself. Run after
// reap_dead_nodes(), so what a dead process left has been reclaimed; what remains is reported.
// Findings that a live node may legitimately cause in passing (an entry in WRITING, a pin being
// validated) are re-read after a short pause before they count.
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "key_hash.h"
#include "liveness.h"
#include "pool.h"

namespace cxlkv {

using namespace format;

CheckReport Pool::check(bool repair) {
  CheckReport r;
  auto err = [&](const std::string& s) {
    r.ok = false;
    if (r.errors.size() < 100) r.errors.push_back(s);
  };
  // Nodes of another kernel are judged by their lease: watch until each one is decided (alive
  // once its beat moves, dead after a lease of silence, then reclaimed), at most a lease and a
  // quarter. A check that could not judge a node must not call the pool consistent.
  {
    const uint64_t lease_ns = uint64_t(hdr_->lease_ms) * 1'000'000;
    const uint64_t deadline = liveness::mono_ns() + lease_ns + lease_ns / 4 + 100'000'000;
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
      err(std::to_string(undecided) + " nodes of another kernel are undecided (their heartbeat was " +
          "watched for a lease without a verdict): run the check again");
  }
  // Reclaims of this attachment since it opened the pool (the reap at open included) or since
  // its last check: an observer `pool check` reports what its own open reclaimed (F20).
  r.reclaimed_nodes = reaped_unreported_.exchange(0, std::memory_order_relaxed);
  auto node_alive = [&](uint8_t node) {
    if (node == 0 || node > hdr_->max_nodes) return false;
    uint8_t st = node_state(coh_.read(&node_slot(node - 1)->state));
    return st == kNodeAlive || st == kNodeClaimed;
  };

  // Namespace-table lock (F13): a holder that is out of range or not attached never releases it.
  if (uint64_t stale = break_stale_ns_lock())
    err("namespace-table lock was held by node " + std::to_string(stale) +
        ", which is not attached (stale lock, now broken)");

  // Namespaces.
  std::map<uint32_t, NsHandle> ns;
  for (auto& [h, l] : list_namespaces()) ns[h.id] = h;
  for (uint32_t id = 1; id <= hdr_->max_namespaces; ++id) {
    uint64_t w = coh_.read(&ns_entry(id)->state);
    if (ns_state(w) == kNsCreating && !node_alive(ns_node(w)))
      err("namespace " + std::to_string(id) + " stuck in CREATING");
    if (ns_state(w) > kNsReady) err("namespace " + std::to_string(id) + " has an invalid state");
    uint64_t bb = ns_entry(id)->layout.block_bytes;
    if (ns_state(w) == kNsReady && (bb == 0 || bb > kMaxBlockBytes))
      err("namespace " + std::to_string(id) + " has an impossible block size (ignored)");
  }

  // Index entries: states, references, probe distance, duplicates. A finding about a READY entry
  // counts only if the entry is unchanged after the pause below (an eviction that hands the
  // block to a new entry between our two reads is not an inconsistency).
  std::set<std::pair<uint32_t, std::string>> keys;
  std::vector<uint64_t> suspects;
  struct EntryFinding {
    uint64_t slot, word;
    std::string what;
  };
  std::vector<EntryFinding> findings;
  for (uint64_t slot = 0; slot <= slot_mask_; ++slot) {
    uint64_t w = coh_.read(&entry(slot)->state);
    uint8_t st = entry_state(w);
    if (st == kEmpty || st == kTombstone) continue;
    if (st == kCondemned && reclaim_condemned(slot)) continue;  // freed now that nothing pins it
    if (st == kCondemned) continue;  // still pinned by a reader: counted with the blocks below
    if (st > kCondemned) {
      err("index slot " + std::to_string(slot) + " has invalid state " + std::to_string(st));
      continue;
    }
    if (st == kWriting || st == kEvicting) {
      if (!node_alive(entry_node(w))) suspects.push_back(slot);
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
    if (!validate_ref(it->second, e)) {
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

  // Chunks and block descriptors: accounting capacity == free + ready + in_flight.
  std::vector<std::pair<uint64_t, uint32_t>> leak_suspects;
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh_.read(chunk_word(c));
    uint8_t st = chunk_state(w);
    if (st == kChunkFree) {
      ++r.free_chunks;
      continue;
    }
    if (st == kChunkCarving || st == kChunkDraining) {
      if (!node_alive(chunk_node(w)))
        err("chunk " + std::to_string(c) +
            (st == kChunkCarving ? " stuck in CARVING" : " stuck in DRAINING"));
      continue;  // changing hands right now: its blocks are counted once it is ACTIVE again
    }
    if (st != kChunkActive) {
      err("chunk " + std::to_string(c) + " has invalid state");
      continue;
    }
    ++r.active_chunks;
    auto it = ns.find(chunk_ns(w));
    if (it == ns.end()) {
      err("chunk " + std::to_string(c) + " belongs to unknown namespace " + std::to_string(chunk_ns(w)));
      continue;
    }
    const NsHandle& h = it->second;
    r.capacity_blocks += h.geo.blocks;
    for (uint32_t b = 0; b < desc_bytes_ / 8; ++b) {
      uint64_t dw = coh_.read(block_desc(c, b));
      if (b >= h.geo.blocks) {
        if (dw) err("descriptor beyond the chunk's blocks is in use");
        continue;
      }
      if (dw == 0) {
        ++r.free_blocks;
        continue;
      }
      uint64_t slot = block_slot(dw);
      if (block_state(dw) != kBlockUsed || slot > slot_mask_) {
        err("block " + std::to_string(c) + ":" + std::to_string(b) + " has an invalid descriptor");
        continue;
      }
      uint64_t ew = coh_.read(&entry(slot)->state);
      IndexEntry e;
      bool snap = snapshot(slot, ew, &e);
      bool back = snap && e.chunk == c && e.block == b;
      uint8_t est = entry_state(ew);
      if (back && est == kReady)
        ++r.ready_blocks;
      else if (back && est == kCondemned)
        ++r.condemned_blocks;
      else if (back && (est == kWriting || est == kEvicting))
        ++r.inflight_blocks;
      else if (incarnation_alive(block_node(dw), block_epoch(dw)))
        ++r.inflight_blocks;  // owner is between two steps
      else
        leak_suspects.emplace_back(c, b);
    }
  }

  // Re-read suspects once after a pause: only what did not move is a finding.
  if (!suspects.empty() || !leak_suspects.empty() || !findings.empty())
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (const auto& f : findings)
    if (coh_.read(&entry(f.slot)->state) == f.word) err(f.what);
  for (uint64_t slot : suspects) {
    uint64_t w = coh_.read(&entry(slot)->state);
    uint8_t st = entry_state(w);
    if ((st == kWriting || st == kEvicting) && !node_alive(entry_node(w))) {
      ++r.stuck_entries;
      err("index slot " + std::to_string(slot) + " stuck in " + (st == kWriting ? "WRITING" : "EVICTING") +
          " by dead node " + std::to_string(entry_node(w)));
    }
  }
  for (auto [c, b] : leak_suspects) {
    uint64_t dw = coh_.read(block_desc(c, b));
    if (dw == 0) {
      ++r.free_blocks;
      continue;
    }
    uint64_t slot = block_slot(dw);
    IndexEntry e;
    uint64_t ew = coh_.read(&entry(slot)->state);
    if (snapshot(slot, ew, &e) && e.chunk == c && e.block == b && entry_state(ew) >= kWriting &&
        entry_state(ew) <= kEvicting) {
      (entry_state(ew) == kReady ? r.ready_blocks : r.inflight_blocks)++;
      continue;
    }
    if (snapshot(slot, ew, &e) && e.chunk == c && e.block == b && entry_state(ew) == kCondemned) {
      ++r.condemned_blocks;
      continue;
    }
    ++r.leaked_blocks;
    err("block " + std::to_string(c) + ":" + std::to_string(b) +
        " is leaked (used, but no index entry points to it)");
  }
  if (r.capacity_blocks !=
      r.free_blocks + r.ready_blocks + r.inflight_blocks + r.condemned_blocks + r.leaked_blocks)
    err("accounting: capacity " + std::to_string(r.capacity_blocks) + " != free " +
        std::to_string(r.free_blocks) + " + ready " + std::to_string(r.ready_blocks) + " + in flight " +
        std::to_string(r.inflight_blocks) + " + condemned " + std::to_string(r.condemned_blocks));
  if (r.condemned_blocks)
    r.warnings.push_back(std::to_string(r.condemned_blocks) +
                         " blocks failed their checksum and wait for their readers' pins to be released");

  // Pins: only attached nodes may hold pins.
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    uint8_t st = node_state(coh_.read(&node_slot(i)->state));
    uint64_t hw = std::min<uint64_t>(coh_.read(&node_fixed(i)->pin_hw), hdr_->pin_slots);
    if (st == kNodeFree) hw = hdr_->pin_slots;  // a free slot's whole pin array must be clear
    for (uint64_t p = 0; p < hw; ++p) {
      if (coh_.read_hint(&pins(i)[p]) == 0) continue;
      if (st == kNodeFree || !node_alive(uint8_t(i + 1))) {
        ++r.orphan_pins;
        err("node " + std::to_string(i + 1) + " (not attached) still holds a pin");
      }
    }
  }
  if (r.duplicate_keys)
    r.warnings.push_back(
        std::to_string(r.duplicate_keys) +
        " keys are stored twice (a benign race between two writers; the copy is reclaimed by eviction)");
  // The cross-host lock area (multihost): foreign, stale and stuck tickets (lock_check.cpp).
  if (bakery_) check_lock_area(r, repair);
  return r;
}

}  // namespace cxlkv
