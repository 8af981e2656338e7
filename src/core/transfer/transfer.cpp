// Device transfers (transfer.h): a save in two phases (reserve -> the device writes the block ->
// commit or abort) and a verified load (pin and verify -> the device reads -> recheck -> unpin).
// The index protocol is put()'s (index.cpp): reserve is put's claim and allocation, commit its
// publication; between the two the entry is WRITING and owned by this node, exactly as during a
// CPU copy, only for longer (the device's copy). A node that dies meanwhile leaves a WRITING entry
// of a gone writer, which peers reclaim as after a crash mid-put (F10).
#include "transfer.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "checksum.h"
#include "errors.h"

namespace cxlkv {

using namespace format;

void DeviceTransfers::reserve(const NsHandle& ns, const Key& key, uint16_t depth, Reservation* r,
                              bool with_block) {
  peers_.ensure_usable();
  *r = Reservation{};
  r->key = key;
  r->depth = depth;
  r->with_block = with_block;
  // Bounded intents: counted before the claim, so concurrent reserves of one node never pass the
  // cap together; given back when the claim takes nothing.
  if (!with_block && intents_held_.fetch_add(1, std::memory_order_acq_rel) >= intent_cap()) {
    intents_held_.fetch_sub(1, std::memory_order_acq_rel);
    r->state = Reservation::capped;
    return;
  }
  Index::Claimed c;
  PutResult claimed = PutResult::failed;
  try {
    claimed = index_.claim_entry(ns, key, depth, &c);
  } catch (...) {
    if (!with_block) intents_held_.fetch_sub(1, std::memory_order_acq_rel);
    throw;
  }
  if (!with_block && claimed != PutResult::stored) intents_held_.fetch_sub(1, std::memory_order_acq_rel);
  switch (claimed) {
    case PutResult::present: r->state = Reservation::present; return;
    case PutResult::in_flight: r->state = Reservation::in_flight; return;
    case PutResult::failed: r->state = Reservation::failed; return;
    case PutResult::stored: break;
  }
  if (!with_block) {  // an intent: claim_entry left the entry's chunk kNoChunk, and so it stays
    publish_intents();
    r->state = Reservation::reserved;
    r->slot = c.slot, r->gen = c.gen, r->tag = c.tag;
    r->chunk = kNoChunk;
    return;
  }
  uint64_t chunk = 0;
  uint32_t block = 0;
  try {
    if (!index_.claim_block(ns, c.slot, c.gen, c.tag, &chunk, &block, &r->charged)) {
      r->state = Reservation::failed;
      return;
    }
  } catch (...) {
    index_.finish_evict(c.slot, make_entry_word(kWriting, uint8_t(node_id_), c.gen, c.tag));
    throw;
  }
  r->state = Reservation::reserved;
  r->slot = c.slot, r->gen = c.gen, r->tag = c.tag;
  r->chunk = chunk, r->block = block;
  r->offset = uint64_t(block_payload(ns, chunk, block) - region_.base());
}

// Releases what the reservation still holds: its block if the descriptor names our slot, then
// the entry if it is still our WRITING word (a lost one is somebody else's now: untouched).
void DeviceTransfers::abort(const NsHandle& ns, Reservation* r) {
  if (r->state != Reservation::reserved) return;
  r->state = Reservation::aborted;
  if (!r->with_block) {
    intents_held_.fetch_sub(1, std::memory_order_acq_rel);
    if (!closed() && peers_.mapping_intact()) try {
        publish_intents();
      } catch (const FencedError&) {  // fenced: a reclaimer resets the count with our entries
      }
  }
  if (closed() || !peers_.mapping_intact()) return;  // the pool is gone: its reclaim frees the block
  uint64_t writing = make_entry_word(kWriting, uint8_t(node_id_), r->gen, r->tag);
  IndexEntry* e = entry(r->slot);
  if (coh_.read(&e->state) != writing) return;
  if (r->chunk < hdr().chunk_count && r->block < ns.geo.blocks) {
    uint64_t dw = coh_.read(block_desc(r->chunk, r->block));
    if (block_state(dw) == kBlockUsed && block_slot(dw) == r->slot) {
      allocator_.free_block(r->chunk, r->block);
      quotas_.refund(node_id_, r->charged, ns.block_bytes);  // what claim_block charged
    }
  }
  coh_.claim(&e->state, writing, make_entry_word(kTombstone, 0, r->gen, r->tag));
}

uint64_t DeviceTransfers::intent_cap() const {
  const auto* sw = reinterpret_cast<const SharedWords*>(region_.base() + kSharedWordsOff);
  return intent_cap_of_word(coh_.read(&sw->init.pad[kInitIntentCap]), hdr().index_slots);
}

void DeviceTransfers::publish_intents() {
  if (node_id_ == 0) return;
  coh_.publish(&region_.node_fixed(node_id_ - 1)->intents, intents_held_.load(std::memory_order_relaxed));
}

bool DeviceTransfers::commit(const NsHandle& ns, Reservation* r) {
  if (r->state != Reservation::reserved) return r->state == Reservation::committed;
  if (!r->with_block)
    throw ArgumentError("an intent reservation holds no block: nothing to commit (abort it)");
  peers_.ensure_usable();
  uint64_t writing = make_entry_word(kWriting, uint8_t(node_id_), r->gen, r->tag);
  IndexEntry* e = entry(r->slot);
  // Everything that says where the bytes are is read back from the pool and must still be ours:
  // the state word, the key, the namespace, the block recorded and the block's descriptor.
  bool ours = coh_.read(&e->state) == writing;
  if (ours) {
    coh_.invalidate(e, sizeof *e);
    ours = e->ns_id == ns.id && std::memcmp(e->key, r->key.data(), 32) == 0 && e->chunk == r->chunk &&
           e->block == r->block && r->chunk < hdr().chunk_count && r->block < ns.geo.blocks;
  }
  if (ours) {
    uint64_t dw = coh_.read(block_desc(r->chunk, r->block));
    ours = block_state(dw) == kBlockUsed && block_slot(dw) == r->slot;
  }
  if (!ours) {
    count(kCorruptEntries);
    abort(ns, r);
    return false;
  }
  const char* p = block_payload(ns, r->chunk, r->block);
  coh_.invalidate(p, ns.block_bytes);  // the device wrote memory, not this CPU's cache lines
  Checksum hs;
  hs.update(p, ns.block_bytes);
  coh_.check_fence();
  e->depth = r->depth;
  e->length = uint32_t(ns.block_bytes);
  e->checksum = hs.digest();
  coh_.flush(e, sizeof *e);
  if (!coh_.claim(&e->state, writing, make_entry_word(kReady, 0, r->gen, r->tag))) {
    count(kCorruptEntries);  // changed under us while hashing: never publish over it
    r->state = Reservation::aborted;
    return false;
  }
  r->state = Reservation::committed;
  index_.touch(r->slot, r->depth);
  count(kPuts);
  count(kBytesStored, ns.block_bytes);
  return true;
}

bool DeviceTransfers::verify_block(const VerifiedBlock& b) {
  const char* p = region_.base() + b.offset;
  coh_.invalidate(p, b.length);
  Checksum hs;
  hs.update(p, b.length);
  return hs.digest() == b.checksum && coh_.read(&entry(b.slot)->state) == b.word;
}

size_t DeviceTransfers::pin_verified(const NsHandle& ns, const Key* keys, size_t n,
                                     std::vector<VerifiedBlock>* out) {
  peers_.ensure_usable();
  AccessStamp stamp;
  size_t got = 0;
  for (size_t i = 0; i < n; ++i) {
    Index::Found f;
    PinRef p;
    bool ok = false, exhausted = false;
    for (int attempt = 0; attempt < 3 && !ok && !exhausted; ++attempt) {
      if (!index_.find(ns, keys[i], nullptr, &f)) break;
      ok = index_.pin(f.slot, f.word, &p, &exhausted, /*for_lease=*/true);
    }
    if (!ok) break;
    // A block of another length was not saved by a device transfer of this layout: a miss.
    if (!index_.validate_ref(ns, f.e) || f.e.length != ns.block_bytes) {
      count(kCorruptEntries);
      release({p});
      break;
    }
    VerifiedBlock b{f.slot,      f.word,
                    p.pin_index, uint64_t(block_payload(ns, f.e.chunk, f.e.block) - region_.base()),
                    f.e.length,  f.e.checksum};
    if (!verify_block(b)) {
      count(kChecksumFailures);
      index_.condemn(f.slot, f.word);
      release({p});
      index_.reclaim_condemned(f.slot);
      break;
    }
    index_.touch(f.slot, f.e.depth);
    out->push_back(b);
    ++got;
  }
  count(kHits, got);
  if (got < n) count(kMisses);
  return got;
}

size_t DeviceTransfers::recheck(const std::vector<VerifiedBlock>& blocks) {
  peers_.ensure_usable();
  size_t i = 0;
  for (; i < blocks.size(); ++i) {
    if (verify_block(blocks[i])) continue;
    count(kChecksumFailures);
    index_.condemn(blocks[i].slot, blocks[i].word);  // reclaimed once unpinned (unpin_verified)
    break;
  }
  if (i == blocks.size())
    for (const auto& b : blocks) count(kBytesLoaded, b.length);
  return i;
}

void DeviceTransfers::unpin_verified(std::vector<VerifiedBlock>* blocks) {
  if (blocks->empty() || closed()) {
    blocks->clear();
    return;
  }
  std::vector<PinRef> pins;
  for (const auto& b : *blocks) pins.push_back(PinRef{b.slot, entry_gen(b.word), b.pin_index});
  release(pins);
  if (peers_.mapping_intact())
    for (const auto& b : *blocks) index_.reclaim_condemned(b.slot);  // no-op unless recheck condemned it
  blocks->clear();
}

std::vector<std::pair<uint64_t, uint64_t>> DeviceTransfers::transfer_ranges(uint64_t max_bytes,
                                                                            uint64_t page) const {
  peers_.ensure_usable();
  if (page == 0 || (page & (page - 1)) || max_bytes < page)
    throw ArgumentError("transfer ranges need a power-of-two page and a maximum of at least one page");
  const uint64_t total = peers_.size(), arena = hdr().arena_off, stride = region_.chunk_stride(),
                 desc = region_.desc_bytes();
  // A boundary lies on a page, and between the end of chunk k-1's payload (= chunk k's start) and
  // the start of chunk k's payload: no block is ever split between two ranges.
  auto boundary = [&](uint64_t k, uint64_t* b) {
    const uint64_t start = arena + k * stride, cut = (start + desc) & ~(page - 1);
    *b = cut;
    return cut >= start;
  };
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t at = 0;
  while (at < total) {
    if (total - at <= max_bytes) {
      out.emplace_back(at, total - at);
      break;
    }
    const uint64_t limit = at + max_bytes;
    uint64_t cut = 0;
    bool found = false;
    for (uint64_t k = limit > arena ? std::min<uint64_t>((limit - arena) / stride, hdr().chunk_count) : 0;
         k >= 1; --k) {
      uint64_t b;
      if (boundary(k, &b) && b > at && b <= limit) {
        cut = b, found = true;
        break;
      }
      if (arena + k * stride <= at) break;
    }
    if (!found)
      throw ArgumentError("no chunk boundary on a page within " + std::to_string(max_bytes) +
                          " bytes of offset " + std::to_string(at) +
                          ": the pool cannot be registered in ranges that keep blocks whole");
    out.emplace_back(at, cut - at);
    at = cut;
  }
  return out;
}

}  // namespace cxlkv
