// `pool check` of the index (Checker, check.h): entries (states, references, probe window,
// duplicates, block-less intents against the cap, stuck entries), then chunks and block
// descriptors: accounting capacity == free + ready + in_flight + condemned + leaked. A finding
// about an entry or a block counts only if it is unchanged after a pause (an eviction that hands
// the block to a new entry between our two reads is not an inconsistency).
#include <chrono>
#include <iterator>
#include <set>
#include <thread>

#include "check.h"
#include "key_hash.h"

namespace cxlkv {

using namespace format;

namespace {
const char* entry_state_name(uint8_t st) {
  static constexpr const char* kNames[] = {"EMPTY", "WRITING", "READY", "EVICTING", "TOMBSTONE", "CONDEMNED"};
  return st < std::size(kNames) ? kNames[st] : "an unknown state";
}
void pause_before_reread() { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }
}  // namespace

void Checker::check_index(CheckReport& r) {
  NsById ns;
  for (auto& [h, l] : namespaces_.list()) ns[h.id] = h;
  check_entries(r, ns);  // first: a block freed by its repairs is counted free below
  check_blocks(r, ns);
}

void Checker::check_entries(CheckReport& r, const NsById& ns) {
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
  std::vector<uint64_t> intents_of(size_t(hdr().max_nodes) + 1, 0);  // [node]: block-less WRITING entries
  for (uint64_t slot = 0; slot <= slot_mask(); ++slot) {
    uint64_t w = coh_.read(&entry(slot)->state);
    uint8_t st = entry_state(w);
    if (st == kEmpty || st == kTombstone) continue;
    if (st == kWriting && entry_node(w) <= hdr().max_nodes) {
      uint64_t chunk, block;
      entry_ref(slot, &chunk, &block);
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
        entry_ref(slot, &s.chunk, &s.block);
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
    const uint64_t home = key_hash(e.key, e.ns_id, slot_mask()).home;
    if (((slot - home) & slot_mask()) >= kMaxProbe)
      findings.push_back({slot, w, at + " is outside its key's probe window"});
    if (!keys.emplace(e.ns_id, std::string(reinterpret_cast<char*>(e.key), 32)).second) ++r.duplicate_keys;
  }
  report_intents(r, intents_of);

  // Re-read suspects once after a pause: only what did not move is a finding (or repaired). Before
  // the blocks are counted, so that a block freed here is counted free.
  if (!suspects.empty() || !findings.empty()) pause_before_reread();
  for (const auto& f : findings)
    if (coh_.read(&entry(f.slot)->state) == f.word) r.error(f.what);
  for (const Suspect& s : suspects) {
    const uint64_t w = coh_.read(&entry(s.slot)->state);
    uint64_t chunk, block;
    entry_ref(s.slot, &chunk, &block);
    if (w != s.word || chunk != s.chunk || block != s.block) continue;  // it moved: not stuck
    const std::string why = index_.abandoned_by(s.slot, w, true);
    const uint8_t node = entry_node(w);
    std::string wait;  // why it is not released (yet), when no evidence says it is abandoned
    if (why.empty() && node_state(coh_.read(&region_.node_slot(node - 1)->state)) == kNodeFree)
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
}

// Bounded intents: a node at its cap gets no more (its reserves report `capped`), and other
// nodes' puts are unaffected; one above it was not built with the cap (or counted wrong).
void Checker::report_intents(CheckReport& r, const std::vector<uint64_t>& intents_of) {
  r.intent_cap = peers_.intent_cap_per_node();
  for (uint32_t n = 1; n <= hdr().max_nodes; ++n) {
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
}

// Chunks and block descriptors: every block of an ACTIVE chunk counted once (free, ready, in
// flight, condemned, or leaked after a re-read), then the accounting.
void Checker::check_blocks(CheckReport& r, const NsById& ns) {
  struct LeakSuspect {
    uint64_t chunk;
    uint32_t block;
    uint64_t desc;  // as first read
  };
  std::vector<LeakSuspect> leak_suspects;
  uint64_t condemned_pinned = 0;
  for (uint64_t c = 0; c < hdr().chunk_count; ++c) {
    uint64_t w = coh_.read(region_.chunk_word(c));
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
    for (uint32_t b = 0; b < desc_bytes() / 8; ++b) {
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
      if (block_state(dw) != kBlockUsed || slot > slot_mask()) {
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
      } else if (nodes_.incarnation_alive(block_node(dw), block_epoch(dw))) {
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
    if (r.repair && dw == l.desc && !nodes_.incarnation_alive(block_node(dw), block_epoch(dw))) {
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

}  // namespace cxlkv
