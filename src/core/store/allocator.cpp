// Block allocator: a global chunk map plus per-node home chunks (TraCT's chunk allocator with
// per-node heaps). A node carves a FREE chunk for a namespace and allocates from it first, so the
// common path touches only that chunk's descriptors, which other nodes write only when they free
// one of its blocks. Block descriptors are the single source of truth (free/used, owner, slot),
// so a crash loses nothing that reclaim_node() cannot restore, and `pool check` can recount
// capacity == free + ready + in_flight from them alone.
#include <cstring>
#include <random>

#include "pool.h"

namespace cxlkv {

using namespace format;

// noipa (no inlining, no clones): tests/cpp/repro/stale_alloc_repro.sh stops here under gdb with a condition
// on `chunk`.
[[gnu::noipa]] bool Pool::claim_free_block(const NsHandle& ns, uint64_t chunk, uint64_t slot, uint32_t* block,
                                           uint32_t start) {
  uint32_t n = ns.geo.blocks;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t b = (start + i) % n;
    if (!block_on_device(ns, chunk, b)) continue;  // placement.cpp: a device-bound handle
    uint64_t* d = block_desc(chunk, b);
    uint64_t w = coh_.read(d);
    if (w != 0) continue;
    // Built here, not before the loop: the gdb reproducer's condition on `chunk` must not be
    // evaluated inside an inlined helper at the function's first line.
    const uint64_t used = make_block_word(kBlockUsed, uint8_t(node_id_), my_epoch8(), slot);
    if (coh_.claim(d, w, used)) {
      coh_.fault("alloc.claimed");
      // The caller saw the chunk ACTIVE for `ns` before the scan; it may have been drained and
      // re-carved for another namespace since (its descs are zero again). Holding the desc now
      // stops any further drain, so one re-check after the claim is enough.
      uint64_t cw = coh_.read(chunk_word(chunk));
      if ((chunk_state(cw) != kChunkActive && chunk_state(cw) != kChunkDraining) || chunk_ns(cw) != ns.id) {
        coh_.publish_shared(d, 0);
        return false;
      }
      *block = b;
      return true;
    }
  }
  return false;
}

bool Pool::carve_chunk(const NsHandle& ns, uint64_t* out) {
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t* cw = chunk_word(c);
    uint64_t w = coh_.read(cw);
    if (chunk_state(w) != kChunkFree || !chunk_has_device_blocks(ns, c)) continue;
    if (!coh_.claim(cw, w, make_chunk_word(kChunkCarving, uint8_t(node_id_), ns.id))) continue;
    coh_.fault("alloc.carving");
    init_chunk(ns, c);
    *out = c;
    return true;
  }
  return false;
}

void Pool::init_chunk(const NsHandle& ns, uint64_t c) {
  // Descs of a never-used chunk are zero already; reset anyway so the invariant does not depend
  // on history (a drained chunk is all FENCED, a devdax may be reused across pools).
  uint64_t* d = block_desc(c, 0);
  coh_.invalidate(d, desc_bytes_);  // multihost: write back zeros over fresh lines, not stale ones
  coh_.check_fence();
  std::memset(d, 0, desc_bytes_);
  coh_.flush(d, desc_bytes_);
  coh_.publish_shared(chunk_word(c), make_chunk_word(kChunkActive, 0, ns.id));
}

// Takes a chunk from the namespace that holds the most chunks, if it holds more than `ns`:
// namespaces that share a pool converge to a fair share of chunks instead of the first one to
// fill the pool keeping it.
bool Pool::steal_chunk(const NsHandle& ns, uint64_t* out) {
  std::vector<NsHandle> handles(hdr_->max_namespaces + 1);
  for (auto& [h, l] : list_namespaces()) handles[h.id] = h;
  std::vector<uint64_t> held(hdr_->max_namespaces + 1, 0);
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh_.read(chunk_word(c));
    if (chunk_state(w) == kChunkActive && chunk_ns(w) <= hdr_->max_namespaces) ++held[chunk_ns(w)];
  }
  uint32_t donor = 0;
  for (uint32_t id = 1; id <= hdr_->max_namespaces; ++id)
    if (id != ns.id && handles[id].id && held[id] > held[donor]) donor = id;
  if (!donor || held[donor] <= held[ns.id] + 1) return false;
  uint64_t start = std::random_device{}() % hdr_->chunk_count;
  int tries = 0;
  for (uint64_t i = 0; i < hdr_->chunk_count && tries < 4; ++i) {
    uint64_t c = (start + i) % hdr_->chunk_count;
    uint64_t w = coh_.read(chunk_word(c));
    if (chunk_state(w) != kChunkActive || chunk_ns(w) != donor || !chunk_has_device_blocks(ns, c)) continue;
    ++tries;
    if (drain_chunk(c, w, handles[donor], ns)) {
      *out = c;
      return true;
    }
  }
  return false;
}

bool Pool::drain_chunk(uint64_t c, uint64_t active_word, const NsHandle& donor, const NsHandle& ns) {
  uint64_t* cw = chunk_word(c);
  uint64_t w = active_word;
  if (!coh_.claim(cw, w, make_chunk_word(kChunkDraining, uint8_t(node_id_), donor.id))) return false;
  const uint64_t fenced = make_block_word(kBlockFenced, uint8_t(node_id_), my_epoch8(), 0);
  uint32_t done = 0;
  bool ok = true;
  for (; done < donor.geo.blocks && ok; ++done) {
    uint64_t* d = block_desc(c, done);
    uint64_t dw = coh_.read(d);
    if (dw == 0) {
      ok = coh_.claim(d, dw, fenced);
      continue;
    }
    // A used block: evict its entry if it is READY, unpinned and points back here.
    uint64_t slot = block_slot(dw);
    ok = false;
    if (block_state(dw) != kBlockUsed || slot > slot_mask_) break;
    uint64_t ew = coh_.read(&entry(slot)->state);
    IndexEntry e;
    if (entry_state(ew) != kReady || !snapshot(slot, ew, &e) || e.chunk != c || e.block != done) break;
    uint64_t ev = make_entry_word(kEvicting, uint8_t(node_id_), entry_gen(ew), entry_tag(ew));
    if (!coh_.claim(&entry(slot)->state, ew, ev)) break;
    if (is_pinned(slot, entry_gen(ev))) {
      coh_.publish(&entry(slot)->state, ew);
      count(kEvictSkippedPinned);
      break;
    }
    uint64_t cur = coh_.read(d);
    ok = cur == dw && coh_.claim(d, cur, fenced);
    if (ok) quota_release(e);  // quota_protocol.cpp
    coh_.publish(&entry(slot)->state, make_entry_word(kTombstone, 0, entry_gen(ev), entry_tag(ev)));
    count(kEvictions);
  }
  if (!ok) {
    // Roll back: unfence what we fenced, give the chunk back to its namespace.
    for (uint32_t b = 0; b < donor.geo.blocks; ++b) {
      uint64_t* d = block_desc(c, b);
      uint64_t dw = coh_.read(d);
      if (dw == fenced) coh_.claim(d, dw, 0);
    }
    coh_.publish_shared(cw, active_word);
    return false;
  }
  coh_.publish_shared(cw, make_chunk_word(kChunkCarving, uint8_t(node_id_), ns.id));
  init_chunk(ns, c);
  return true;
}

bool Pool::alloc_block(const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block) {
  constexpr uint64_t kStealBackoffUs = 20'000;
  const AllocCursors::Cursor st = alloc_cursors_.get(placement_key(ns));
  auto remember = [&](uint64_t c, uint32_t next, uint64_t steal_after) {
    alloc_cursors_.set(placement_key(ns), AllocCursors::Cursor{c, next, steal_after});
  };
  auto mine = [&](uint64_t c) {
    uint64_t w = coh_.read(chunk_word(c));
    return chunk_state(w) == kChunkActive && chunk_ns(w) == ns.id;
  };
  // 1. This node's home chunk, from where the last allocation stopped.
  if (st.home != ~0ull && st.home < hdr_->chunk_count && mine(st.home) &&
      claim_free_block(ns, st.home, slot, block, st.cursor)) {
    remember(st.home, *block + 1, st.steal_after_us);
    *chunk = st.home;
    return true;
  }
  // 2. A fresh chunk from the global map.
  uint64_t c;
  while (carve_chunk(ns, &c)) {
    if (claim_free_block(ns, c, slot, block, 0)) {
      remember(c, *block + 1, 0);
      *chunk = c;
      return true;
    }
  }
  // 3. A block freed in another chunk of this namespace (deletes, reclaimed writers). Under
  //    steady eviction pressure there are none, so a fruitless scan backs off for a while and
  //    the caller evicts instead.
  uint64_t now = now_mono_us();
  if (now >= st.steal_after_us) {
    uint64_t start = std::random_device{}() % hdr_->chunk_count;
    for (uint64_t i = 0; i < hdr_->chunk_count; ++i) {
      c = (start + i) % hdr_->chunk_count;
      if (!mine(c)) continue;
      if (claim_free_block(ns, c, slot, block, 0)) {
        remember(c, *block + 1, 0);
        *chunk = c;
        return true;
      }
    }
    remember(st.home, st.cursor, now + kStealBackoffUs);
  }
  // 4. A chunk of a namespace that holds more chunks than this one.
  if (steal_chunk(ns, &c) && claim_free_block(ns, c, slot, block, 0)) {
    remember(c, *block + 1, 0);
    *chunk = c;
    return true;
  }
  return false;
}

// Block descs share lines (8 per line): publish_shared (a multihost write-back of the whole line
// must not put back stale neighbours).
void Pool::free_block(uint64_t chunk, uint32_t block) { coh_.publish_shared(block_desc(chunk, block), 0); }

Pool::Occupancy Pool::occupancy() {
  Occupancy o{};
  std::vector<format::ChunkGeometry> geo(hdr_->max_namespaces + 1);
  for (auto& [h, l] : list_namespaces()) geo[h.id] = h.geo;
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh_.read(chunk_word(c));
    if (chunk_state(w) == kChunkFree) {
      ++o.free_chunks;
      continue;
    }
    if (chunk_state(w) != kChunkActive) continue;  // CARVING/DRAINING: changing hands
    ++o.active_chunks;
    uint32_t ns = chunk_ns(w);
    if (ns == 0 || ns > hdr_->max_namespaces) continue;
    uint32_t n = geo[ns].blocks;
    o.capacity += n;
    for (uint32_t b = 0; b < n; ++b) (coh_.read(block_desc(c, b)) == 0 ? o.free : o.used)++;
  }
  return o;
}

}  // namespace cxlkv
