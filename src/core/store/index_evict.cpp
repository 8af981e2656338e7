// Index (index.h): eviction and release. An entry leaves the index by a claim of its state word
// (READY or CONDEMNED -> EVICTING, then a pin check) by one node, which frees its block or hands
// it straight to a new owner; entries nobody will finish (a gone writer's WRITING, an unpinned
// CONDEMNED) are tombstoned by whoever notices first. Every block that leaves an entry books its
// bytes released to the entry's quota rows (Quotas::release); a put over its quota evicts its
// subject's own blocks first (quota_admit).
#include <cstring>
#include <string>

#include "index.h"

namespace cxlkv {

using namespace format;

// Frees the block of an entry this node holds in EVICTING (or WRITING, when a put is abandoned)
// and tombstones the slot. The block is freed only if its descriptor still points to the slot.
void Index::finish_evict(uint64_t slot, uint64_t evicting_word) {
  IndexEntry e;
  snapshot(slot, evicting_word, &e);
  let_go(slot, e, read_desc(e), 0, Write::publish);
  coh_.publish(&entry(slot)->state,
               make_entry_word(kTombstone, 0, entry_gen(evicting_word), entry_tag(evicting_word)));
}

// Evicts one candidate if it is still READY (or CONDEMNED) in the same generation and not pinned. With
// new_owner_slot != ~0 its block is handed straight to that slot (no FREE window in which
// another node could take it); otherwise the block is freed.
bool Index::evict_victim(const Victim& c, const NsHandle* ns, uint64_t* out_chunk, uint32_t* out_block,
                         uint64_t new_owner_slot) {
  uint64_t w = c.word;
  // Pre-check: a pinned entry is skipped without flipping its state, so readers of pinned
  // blocks (leases) do not see a transient EVICTING. The check after the claim is the real one.
  if (is_pinned(c.slot, entry_gen(w))) {
    count(kEvictSkippedPinned);
    return false;
  }
  uint64_t ev = make_entry_word(kEvicting, uint8_t(node_id_), entry_gen(w), entry_tag(w));
  if (!coh_.claim(&entry(c.slot)->state, w, ev)) return false;
  coh_.fault("evict.claimed");
  if (is_pinned(c.slot, entry_gen(ev))) {
    coh_.publish(&entry(c.slot)->state, c.word);
    count(kEvictSkippedPinned);
    return false;
  }
  if (new_owner_slot == ~0ull) {
    finish_evict(c.slot, ev);
    count(kEvictions);
    return true;
  }
  IndexEntry e;
  snapshot(c.slot, ev, &e);
  const BlockDesc desc = ns && validate_ref(*ns, e) ? read_desc(e) : BlockDesc{};
  if (!desc.names(c.slot)) {
    count(kCorruptEntries);
    finish_evict(c.slot, ev);
    return false;
  }
  // A block of a chunk being drained stays with the drainer.
  if (chunk_state(coh_.read(region_.chunk_word(e.chunk))) != kChunkActive) {
    finish_evict(c.slot, ev);
    count(kEvictions);
    return false;
  }
  let_go(c.slot, e, desc, make_block_word(kBlockUsed, uint8_t(node_id_), my_epoch8(), new_owner_slot),
         Write::publish);
  coh_.publish(&entry(c.slot)->state, make_entry_word(kTombstone, 0, entry_gen(ev), entry_tag(ev)));
  *out_chunk = e.chunk;
  *out_block = e.block;
  count(kEvictions);
  return true;
}

// Window eviction: the 128-slot probe window of a key is full. Evicts the oldest unpinned READY
// entry of the window (any namespace) and frees its block.
bool Index::evict_in_window(uint64_t home) {
  for (const Victim& c : evictor_.window(home))
    if (evict_victim(c, nullptr, nullptr, nullptr, ~0ull)) return true;
  return false;
}

// Namespace eviction from the evictor's sampled queue (evictor.h); the block goes straight to
// new_owner_slot.
bool Index::evict_from_queue(const NsHandle& ns, uint64_t* out_chunk, uint32_t* out_block,
                             uint64_t new_owner_slot) {
  // A device-bound handle takes over only blocks on its device (placement.cpp).
  Evictor::Accept on_device;
  if (ns.device >= 0)
    on_device = [&](const IndexEntry& e) {
      return validate_ref(ns, e) && allocator_.block_on_device(ns, e.chunk, e.block);
    };
  return evictor_.from_queue(Allocator::placement_key(ns), ns.id, on_device, [&](const Victim& c) {
    return evict_victim(c, &ns, out_chunk, out_block, new_owner_slot);
  });
}

// The index's half of draining a chunk (Allocator::Peers): used block (c, b), its descriptor read
// as `dw`, is taken from its entry if that is READY, unpinned and points back here: the entry is
// tombstoned and the descriptor fenced.
bool Index::evict_owner(uint64_t c, uint32_t b, uint64_t dw, uint64_t fenced) {
  uint64_t slot = block_slot(dw);
  if (block_state(dw) != kBlockUsed || slot > slot_mask()) return false;
  uint64_t ew = coh_.read(&entry(slot)->state);
  IndexEntry e;
  if (entry_state(ew) != kReady || !snapshot(slot, ew, &e) || e.chunk != c || e.block != b) return false;
  uint64_t ev = make_entry_word(kEvicting, uint8_t(node_id_), entry_gen(ew), entry_tag(ew));
  if (!coh_.claim(&entry(slot)->state, ew, ev)) return false;
  if (is_pinned(slot, entry_gen(ev))) {
    coh_.publish(&entry(slot)->state, ew);
    count(kEvictSkippedPinned);
    return false;
  }
  const BlockDesc desc = read_desc(e);  // (c, b): e names them
  const bool ok = desc.word == dw && let_go(slot, e, desc, fenced, Write::claim);
  coh_.publish(&entry(slot)->state, make_entry_word(kTombstone, 0, entry_gen(ev), entry_tag(ev)));
  count(kEvictions);
  return ok;
}

// READY -> CONDEMNED: the entry leaves the index at once (no later lookup, on any node, finds
// it), whoever holds pins on it; its block stays USED until reclaim_condemned() sees no pin.
void Index::condemn(uint64_t slot, uint64_t ready_word) {
  uint64_t cw = make_entry_word(kCondemned, 0, entry_gen(ready_word), entry_tag(ready_word));
  if (coh_.claim(&entry(slot)->state, ready_word, cw)) count(kCondemnedEntries);
}

// CONDEMNED -> EVICTING -> TOMBSTONE if no pin names the entry; otherwise it stays CONDEMNED
// for the next evictor, reclaim or `pool check`. True if the slot was freed.
bool Index::reclaim_condemned(uint64_t slot, uint8_t as) {
  uint64_t w = coh_.read(&entry(slot)->state);
  if (entry_state(w) != kCondemned || is_pinned(slot, entry_gen(w))) return false;
  // Without a node id of its own (an observer, or a reclaim at open before the attach) it holds
  // the entry as release_abandoned does: under the reclaimed node's id, or, with none, by a
  // tombstone claim. No pin can be taken on a CONDEMNED entry any more (a pin is validated
  // against the READY word), so the check above is final.
  if (node_id_ == 0) return release_abandoned(slot, w, as);
  uint64_t ev = make_entry_word(kEvicting, uint8_t(node_id_), entry_gen(w), entry_tag(w));
  if (!coh_.claim(&entry(slot)->state, w, ev)) return false;
  if (is_pinned(slot, entry_gen(ev))) {
    coh_.publish(&entry(slot)->state, w);
    return false;
  }
  finish_evict(slot, ev);
  return true;
}

// Frees index slot `slot`, read as word w: an entry nobody will finish (see abandoned_by), or
// CONDEMNED with no pin. Of several who notice (reclaimers, `pool check --repair`) exactly one
// wins the claim of w, and only the winner frees the block.
// The winner holds the entry EVICTING under a node id first and tombstones it last,
// as every eviction does: under `as`, the node whose reclaim this is (its slot stays RECLAIMING
// until the reclaim ends, so a reclaimer dying here leaves the entry to that node's next reclaim,
// which finds the block still named by the entry), else under this node's own id. Claiming
// TOMBSTONE first, as before, left the block USED with no entry pointing back, and when its writer
// was alive and later closed cleanly no reclaim ever visited it (a leak only `pool check --repair`
// found). The entry is held, so no other slot can take the block meanwhile.
// The entry may be pinned: a dead evictor may have claimed EVICTING before its own pin check, with
// a reader still copying the block. Such an entry becomes CONDEMNED (out of the index, its block
// freed by reclaim_condemned once the pin is gone) instead of freed under the reader.
bool Index::release_abandoned(uint64_t slot, uint64_t w, uint8_t as) {
  const uint8_t holder = as ? as : uint8_t(node_id_);
  if (holder == 0) return tombstone_then_free(slot, w);
  const uint64_t ev = make_entry_word(kEvicting, holder, entry_gen(w), entry_tag(w));
  uint64_t seen = ev;  // Coherence::claim's expected word (it writes back what it found)
  // w == ev: the node we reclaim was evicting it (or died releasing it): as its one reclaimer
  // (its slot RECLAIMING is ours) we hold the entry already.
  if (w != ev && !coh_.claim(&entry(slot)->state, w, ev)) return false;
  coh_.fault("release.claimed");
  if (is_pinned(slot, entry_gen(ev))) {
    if (coh_.claim(&entry(slot)->state, seen, make_entry_word(kCondemned, 0, entry_gen(ev), entry_tag(ev))))
      count(kCondemnedEntries);
    return false;
  }
  // Claims, not publishes, from here on: a reclaimer judged dead while only slow may still be
  // here beside the next one; whichever comes second finds the words changed and does nothing.
  IndexEntry e;
  if (!snapshot(slot, ev, &e)) return false;
  let_go(slot, e, read_desc(e), 0, Write::claim);
  return coh_.claim(&entry(slot)->state, seen, make_entry_word(kTombstone, 0, entry_gen(ev), entry_tag(ev)));
}

// release_abandoned without a node id to hold EVICTING under (`pool check` as an observer, outside
// any reclaim): the tombstone comes first, by claim, and the block is freed by a claim of the
// descriptor word read before (a block handed out again since, a new word, is never freed). An
// observer dying between the two steps leaves the block USED with no entry pointing back: its
// owner's reclaim frees it, or the next `pool check --repair` once that owner's incarnation is gone.
bool Index::tombstone_then_free(uint64_t slot, uint64_t w) {
  IndexEntry* e = entry(slot);
  coh_.invalidate(e, sizeof *e);
  // Its block and whom it was charged to; of a writer that is gone: nothing changes them any more.
  IndexEntry ref{};
  ref.chunk = e->chunk, ref.block = e->block;
  ref.ns_id = e->ns_id, ref.tenant_row = e->tenant_row, ref.ns_row = e->ns_row;
  // Read before the tombstone: once the entry is gone the block may be freed and taken again (its
  // owner's reclaim), even for this slot, under a new word that the claim in let_go must not match.
  const BlockDesc desc = read_desc(ref);
  if (!coh_.claim(&e->state, w, make_entry_word(kTombstone, 0, entry_gen(w), entry_tag(w)))) return false;
  let_go(slot, ref, desc, 0, Write::claim);
  return true;
}

Index::BlockDesc Index::read_desc(const IndexEntry& e) const {
  if (e.chunk >= hdr().chunk_count || e.block >= region_.desc_bytes() / 8) return {};
  uint64_t* d = block_desc(e.chunk, e.block);
  return {d, coh_.read(d)};
}

// The one step by which a block leaves entry `slot` (index.h: only while its descriptor names the
// slot, and every such release books the block's bytes released to the entry's quota rows): if
// `desc`, as read, names the slot, the descriptor becomes `to` (0: freed; a USED word of another
// slot: handed over; FENCED: taken by a drainer) and e's rows book the bytes released
// (quotas.cpp). True if the block left the entry.
// How the descriptor is written is the caller's concurrency, not a choice of style:
// - Write::publish: the caller is the one holder of the entry in EVICTING, and no one else writes
//   a descriptor while a held entry names it (Allocator::release_of_node frees only blocks no
//   entry points back to; a drainer must claim the entry from READY first; a reclaimer of this
//   node, should it be judged dead meanwhile, claims). Descriptors share lines (8 a line), hence
//   publish_shared, as Allocator::free_block.
// - Write::claim, from the word read: another writer may be beside us, and whichever comes second
//   finds the word changed and neither writes nor books: a reclaimer judged dead while only slow
//   beside the next one (release_abandoned), a block freed and taken again once an observer's
//   tombstone took the entry away (tombstone_then_free), a descriptor changed since the drainer
//   judged its chunk by it (evict_owner).
bool Index::let_go(uint64_t slot, const IndexEntry& e, BlockDesc desc, uint64_t to, Write how) {
  if (!desc.names(slot)) return false;
  if (how == Write::publish)
    coh_.publish_shared(desc.d, to);
  else if (!coh_.claim(desc.d, desc.word, to))
    return false;
  quotas_.release(node_id_, e);
  return true;
}

// Step 2 of the reclaim of node `dead` (nodes.cpp holds its slot RECLAIMING): entries it held in
// WRITING or EVICTING are released, under its id (release_abandoned says why). The same scan
// releases what no reclaim of a node would visit: entries whose node slot is FREE (abandoned_by),
// and CONDEMNED entries that no pin holds any more (the dead node's pins were maybe the last).
void Index::release_of_node(uint8_t dead) {
  for (uint64_t slot = 0; slot <= slot_mask(); ++slot) {
    const uint64_t w = coh_.read(&entry(slot)->state);
    const uint8_t st = entry_state(w);
    if (st == kCondemned) reclaim_condemned(slot, dead);
    if (st != kWriting && st != kEvicting) continue;
    if (entry_node(w) == dead || !abandoned_by(slot, w, false).empty()) release_abandoned(slot, w, dead);
  }
}

// Whether index slot `slot` holds an entry (READY, in flight or CONDEMNED) whose block is
// (chunk, block): the allocator frees a dead node's block only when none does.
bool Index::entry_points_back(uint64_t slot, uint64_t chunk, uint32_t block) {
  if (slot > slot_mask()) return false;
  IndexEntry* e = entry(slot);
  const uint8_t st = entry_state(coh_.read(&e->state));
  coh_.invalidate(e, sizeof *e);
  return (st == kReady || st == kWriting || st == kEvicting || st == kCondemned) && e->chunk == chunk &&
         e->block == block;
}

// Why the node holding index slot `slot` in WRITING/EVICTING (word w) can never finish it, or ""
// if it still may (format.h L4: such entries exist only while their node's slot is CLAIMED,
// ALIVE or RECLAIMING). Evidence, never a guess:
//   - the node's slot is FREE: every incarnation that could have claimed the entry has ended (a
//     clean close has finished its puts; a reclaim tombstones the entries). This is what a
//     co-tenant leaves who writes FREE over a live node's state word: that node is fenced (L3)
//     and never finishes; no reclaim runs for a FREE slot. Only once its process has closed the
//     pool, where that can be known (owner_closed): until then it may still be inside the put.
//   - by_epoch, for WRITING: the slot is attached again, and the block the entry points to was
//     claimed for this slot by the same node id in another epoch (the descriptor records the low
//     8 bits of the claimer's epoch; the entry word records no epoch). Equal low bits of two
//     epochs only hide a gone writer, never accuse a live one. Callers re-read after a pause:
//     a new incarnation's entry may still point to its slot's old block until it allocates.
// A slot RECLAIMING, or ALIVE and judged dead, is its reclaimer's business.
std::string Index::abandoned_by(uint64_t slot, uint64_t w, bool by_epoch) {
  const uint8_t node = entry_node(w);
  if (node == 0 || node > hdr().max_nodes) return "it names no node (" + std::to_string(node) + ")";
  if (node == node_id_) return "";
  const uint64_t nw = coh_.read(&region_.node_slot(node - 1)->state);
  const uint8_t nst = node_state(nw);
  if (nst == kNodeFree)
    return peers_.owner_closed(node) ? "node " + std::to_string(node) + " is not attached" : "";
  if (!by_epoch || entry_state(w) != kWriting || (nst != kNodeAlive && nst != kNodeClaimed)) return "";
  IndexEntry* e = entry(slot);
  coh_.invalidate(e, sizeof *e);
  if (e->chunk >= hdr().chunk_count || e->block >= region_.desc_bytes() / 8) return "";
  const uint64_t dw = coh_.read(block_desc(e->chunk, e->block));
  if (block_state(dw) != kBlockUsed || block_slot(dw) != slot || block_node(dw) != node) return "";
  if (block_epoch(dw) == uint8_t(node_epoch(nw))) return "";
  return "node " + std::to_string(node) +
         "'s incarnation that claimed it is gone (the slot was attached again)";
}

bool Index::remove(const NsHandle& ns, const Key& key) {
  Found f;
  if (!find(ns, key, nullptr, &f)) return false;
  uint64_t w = f.word;
  if (is_pinned(f.slot, entry_gen(w))) return false;
  uint64_t ev = make_entry_word(kEvicting, uint8_t(node_id_), entry_gen(w), entry_tag(w));
  if (!coh_.claim(&entry(f.slot)->state, w, ev)) return false;
  coh_.fault("evict.claimed");
  if (is_pinned(f.slot, entry_gen(ev))) {
    coh_.publish(&entry(f.slot)->state, f.word);
    return false;
  }
  finish_evict(f.slot, ev);
  count(kDeletes);
  return true;
}

// Charges the block a put is about to take to the rows its entry names, then, for each row over
// its limit, evicts the subject's own oldest unpinned blocks of this namespace (tails of chains
// first: the evictor's order) until it fits. The first such block is handed straight to `slot`
// (*got: the caller allocates nothing), so a subject at its limit never takes a block from the
// free pool or from anyone else. False: over the limit with nothing of its own left to evict;
// the charge is returned and puts_over_quota counted.
bool Index::quota_admit(const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block, bool* got,
                        QuotaCharge* charged) {
  *got = false;
  *charged = QuotaCharge{};
  const IndexEntry* e = entry(slot);                   // ours (WRITING): the rows we wrote with the key
  const uint8_t rows[2] = {e->tenant_row, e->ns_row};  // read once: what is charged and refunded
  if (!rows[0] && !rows[1]) return true;
  *charged = QuotaCharge{rows[0], rows[1]};
  for (uint8_t r : rows) quotas_.book(node_id_, r, ns.block_bytes, true);
  constexpr int kMaxOwnEvictions = 64;  // bounds a put whatever the counters say
  for (uint8_t r : rows) {
    if (!r || r > kQuotaRows) continue;
    const uint64_t limit = quotas_.limit(r);
    if (!limit) continue;
    for (int n = 0; quotas_.usage(r, hdr().max_nodes) > limit; ++n) {
      Evictor::Accept own = [&](const IndexEntry& v) {
        return (v.tenant_row == r || v.ns_row == r) &&
               (ns.device < 0 || (validate_ref(ns, v) && allocator_.block_on_device(ns, v.chunk, v.block)));
      };
      const uint32_t key =
          Allocator::placement_key(ns) | (uint32_t(r) << 24);  // a queue per (subject, namespace)
      bool evicted =
          n < kMaxOwnEvictions && evictor_.from_queue(
                                      key, ns.id, own,
                                      [&](const Victim& c) {
                                        return *got ? evict_victim(c, &ns, nullptr, nullptr, ~0ull)
                                                    : (*got = evict_victim(c, &ns, chunk, block, slot));
                                      });
      if (!evicted) {
        if (*got) {  // the block handed over is ours now: give it back
          uint64_t* d = block_desc(*chunk, *block);
          uint64_t dw = coh_.read(d);
          if (block_state(dw) == kBlockUsed && block_slot(dw) == slot) allocator_.free_block(*chunk, *block);
          *got = false;
        }
        quotas_.refund(node_id_, *charged, ns.block_bytes);
        *charged = QuotaCharge{};
        count(kPutsOverQuota);
        return false;
      }
      count(kQuotaEvictions);
    }
  }
  return true;
}

}  // namespace cxlkv
