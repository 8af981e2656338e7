// Block allocator: a global chunk map plus per-node home chunks (TraCT's chunk allocator with
// per-node heaps). A node carves a FREE chunk for a namespace and allocates from it first, so the
// common path touches only that chunk's descriptors, which other nodes write only when they free
// one of its blocks. Block descriptors are the single source of truth (free/used, owner, slot),
// so a crash loses nothing that reclaim_node() cannot restore, and `pool check` can recount
// capacity == free + ready + in_flight from them alone.
#include <cstring>
#include <random>

#include "allocator.h"

#include "clock.h"

namespace cxlkv {

using namespace format;

// noipa (no inlining, no clones): tests/cpp/repro/stale_alloc_repro.sh stops here under gdb with a condition
// on `chunk`.
[[gnu::noipa]] bool Allocator::claim_free_block(const NsHandle& ns, uint64_t chunk, Writer w, uint64_t slot,
                                                uint32_t* block, uint32_t start) {
  const Coherence& coh = region_.coh();
  uint32_t n = ns.geo.blocks;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t b = (start + i) % n;
    if (!block_on_device(ns, chunk, b)) continue;  // placement.cpp: a device-bound handle
    uint64_t* d = region_.block_desc(chunk, b);
    uint64_t dw = coh.read(d);
    if (dw != 0) continue;
    // Built here, not before the loop: the gdb reproducer's condition on `chunk` must not be
    // evaluated inside an inlined helper at the function's first line.
    const uint64_t used = make_block_word(kBlockUsed, w.node, w.epoch8, slot);
    if (coh.claim(d, dw, used)) {
      coh.fault("alloc.claimed");
      // The caller saw the chunk ACTIVE for `ns` before the scan; it may have been drained and
      // re-carved for another namespace since (its descs are zero again). Holding the desc now
      // stops any further drain, so one re-check after the claim is enough.
      uint64_t cw = coh.read(region_.chunk_word(chunk));
      if ((chunk_state(cw) != kChunkActive && chunk_state(cw) != kChunkDraining) || chunk_ns(cw) != ns.id) {
        coh.publish_shared(d, 0);
        return false;
      }
      *block = b;
      return true;
    }
  }
  return false;
}

bool Allocator::carve_chunk(Writer w, const NsHandle& ns, uint64_t* out) {
  const Coherence& coh = region_.coh();
  for (uint64_t c = 0; c < hdr().chunk_count; ++c) {
    uint64_t* cw = region_.chunk_word(c);
    uint64_t cur = coh.read(cw);
    if (chunk_state(cur) != kChunkFree || !chunk_has_device_blocks(ns, c)) continue;
    if (!coh.claim(cw, cur, make_chunk_word(kChunkCarving, w.node, ns.id))) continue;
    coh.fault("alloc.carving");
    init_chunk(ns, c);
    *out = c;
    return true;
  }
  return false;
}

void Allocator::init_chunk(const NsHandle& ns, uint64_t c) {
  const Coherence& coh = region_.coh();
  const uint64_t desc_bytes = region_.desc_bytes();
  // Descs of a never-used chunk are zero already; reset anyway so the invariant does not depend
  // on history (a drained chunk is all FENCED, a devdax may be reused across pools).
  uint64_t* d = region_.block_desc(c, 0);
  coh.invalidate(d, desc_bytes);  // multihost: write back zeros over fresh lines, not stale ones
  coh.check_fence();
  std::memset(d, 0, desc_bytes);
  coh.flush(d, desc_bytes);
  coh.publish_shared(region_.chunk_word(c), make_chunk_word(kChunkActive, 0, ns.id));
}

// Takes a chunk from the namespace that holds the most chunks, if it holds more than `ns`:
// namespaces that share a pool converge to a fair share of chunks instead of the first one to
// fill the pool keeping it.
bool Allocator::steal_chunk(Writer w, const NsHandle& ns, uint64_t* out) {
  const Coherence& coh = region_.coh();
  std::vector<NsHandle> handles(hdr().max_namespaces + 1);
  for (const NsHandle& h : peers_.namespace_handles()) handles[h.id] = h;
  std::vector<uint64_t> held(hdr().max_namespaces + 1, 0);
  for (uint64_t c = 0; c < hdr().chunk_count; ++c) {
    uint64_t cw = coh.read(region_.chunk_word(c));
    if (chunk_state(cw) == kChunkActive && chunk_ns(cw) <= hdr().max_namespaces) ++held[chunk_ns(cw)];
  }
  uint32_t donor = 0;
  for (uint32_t id = 1; id <= hdr().max_namespaces; ++id)
    if (id != ns.id && handles[id].id && held[id] > held[donor]) donor = id;
  if (!donor || held[donor] <= held[ns.id] + 1) return false;
  uint64_t start = std::random_device{}() % hdr().chunk_count;
  int tries = 0;
  for (uint64_t i = 0; i < hdr().chunk_count && tries < 4; ++i) {
    uint64_t c = (start + i) % hdr().chunk_count;
    uint64_t cw = coh.read(region_.chunk_word(c));
    if (chunk_state(cw) != kChunkActive || chunk_ns(cw) != donor || !chunk_has_device_blocks(ns, c)) continue;
    ++tries;
    if (drain_chunk(w, c, cw, handles[donor], ns)) {
      *out = c;
      return true;
    }
  }
  return false;
}

bool Allocator::drain_chunk(Writer w, uint64_t c, uint64_t active_word, const NsHandle& donor,
                            const NsHandle& ns) {
  const Coherence& coh = region_.coh();
  uint64_t* cw = region_.chunk_word(c);
  uint64_t cur = active_word;
  if (!coh.claim(cw, cur, make_chunk_word(kChunkDraining, w.node, donor.id))) return false;
  const uint64_t fenced = make_block_word(kBlockFenced, w.node, w.epoch8, 0);
  bool ok = true;
  for (uint32_t done = 0; done < donor.geo.blocks && ok; ++done) {
    uint64_t* d = region_.block_desc(c, done);
    uint64_t dw = coh.read(d);
    if (dw == 0) {
      ok = coh.claim(d, dw, fenced);
      continue;
    }
    // A used block: the index evicts its entry if it is READY, unpinned and points back here.
    ok = peers_.evict_owner(c, done, dw, fenced);
  }
  if (!ok) {
    // Roll back: unfence what we fenced, give the chunk back to its namespace.
    for (uint32_t b = 0; b < donor.geo.blocks; ++b) {
      uint64_t* d = region_.block_desc(c, b);
      uint64_t dw = coh.read(d);
      if (dw == fenced) coh.claim(d, dw, 0);
    }
    coh.publish_shared(cw, active_word);
    return false;
  }
  coh.publish_shared(cw, make_chunk_word(kChunkCarving, w.node, ns.id));
  init_chunk(ns, c);
  return true;
}

bool Allocator::alloc_block(Writer w, const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block) {
  constexpr uint64_t kStealBackoffUs = 20'000;
  const Coherence& coh = region_.coh();
  const AllocCursors::Cursor st = cursors_.get(placement_key(ns));
  auto remember = [&](uint64_t c, uint32_t next, uint64_t steal_after) {
    cursors_.set(placement_key(ns), AllocCursors::Cursor{c, next, steal_after});
  };
  auto mine = [&](uint64_t c) {
    uint64_t cw = coh.read(region_.chunk_word(c));
    return chunk_state(cw) == kChunkActive && chunk_ns(cw) == ns.id;
  };
  // 1. This node's home chunk, from where the last allocation stopped.
  if (st.home != ~0ull && st.home < hdr().chunk_count && mine(st.home) &&
      claim_free_block(ns, st.home, w, slot, block, st.cursor)) {
    remember(st.home, *block + 1, st.steal_after_us);
    *chunk = st.home;
    return true;
  }
  // 2. A fresh chunk from the global map.
  uint64_t c;
  while (carve_chunk(w, ns, &c)) {
    if (claim_free_block(ns, c, w, slot, block, 0)) {
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
    uint64_t start = std::random_device{}() % hdr().chunk_count;
    for (uint64_t i = 0; i < hdr().chunk_count; ++i) {
      c = (start + i) % hdr().chunk_count;
      if (!mine(c)) continue;
      if (claim_free_block(ns, c, w, slot, block, 0)) {
        remember(c, *block + 1, 0);
        *chunk = c;
        return true;
      }
    }
    remember(st.home, st.cursor, now + kStealBackoffUs);
  }
  // 4. A chunk of a namespace that holds more chunks than this one.
  if (steal_chunk(w, ns, &c) && claim_free_block(ns, c, w, slot, block, 0)) {
    remember(c, *block + 1, 0);
    *chunk = c;
    return true;
  }
  return false;
}

// Block descs share lines (8 per line): publish_shared (a multihost write-back of the whole line
// must not put back stale neighbours).
void Allocator::free_block(uint64_t chunk, uint32_t block) const {
  region_.coh().publish_shared(region_.block_desc(chunk, block), 0);
}

void Allocator::release_of_node(uint8_t dead) {
  const Coherence& coh = region_.coh();
  const uint32_t nblocks = uint32_t(region_.desc_bytes() / 8);
  for (uint64_t c = 0; c < hdr().chunk_count; ++c) {
    uint64_t* cw = region_.chunk_word(c);
    uint64_t w = coh.read(cw);
    if (chunk_state(w) == kChunkCarving && chunk_node(w) == dead) {
      coh.claim(cw, w, 0);
      continue;
    }
    if (chunk_state(w) == kChunkDraining && chunk_node(w) == dead) {
      // Undo a half-done drain: unfence, and the chunk goes back to its namespace.
      for (uint32_t b = 0; b < nblocks; ++b) {
        uint64_t* d = region_.block_desc(c, b);
        uint64_t dw = coh.read(d);
        if (block_state(dw) == kBlockFenced && block_node(dw) == dead) coh.claim(d, dw, 0);
      }
      uint64_t back = make_chunk_word(kChunkActive, 0, chunk_ns(w));
      if (!coh.claim(cw, w, back)) continue;
      w = back;
    }
    if (chunk_state(w) != kChunkActive) continue;
    for (uint32_t b = 0; b < nblocks; ++b) {
      uint64_t* d = region_.block_desc(c, b);
      uint64_t dw = coh.read(d);
      if (block_state(dw) != kBlockUsed || block_node(dw) != dead) continue;
      if (peers_.entry_points_back(block_slot(dw), c, b)) continue;
      coh.claim(d, dw, 0);
    }
  }
}

Occupancy Allocator::occupancy() {
  const Coherence& coh = region_.coh();
  Occupancy o{};
  std::vector<format::ChunkGeometry> geo(hdr().max_namespaces + 1);
  for (const NsHandle& h : peers_.namespace_handles()) geo[h.id] = h.geo;
  for (uint64_t c = 0; c < hdr().chunk_count; ++c) {
    uint64_t w = coh.read(region_.chunk_word(c));
    if (chunk_state(w) == kChunkFree) {
      ++o.free_chunks;
      continue;
    }
    if (chunk_state(w) != kChunkActive) continue;  // CARVING/DRAINING: changing hands
    ++o.active_chunks;
    uint32_t ns = chunk_ns(w);
    if (ns == 0 || ns > hdr().max_namespaces) continue;
    uint32_t n = geo[ns].blocks;
    o.capacity += n;
    for (uint32_t b = 0; b < n; ++b) (coh.read(region_.block_desc(c, b)) == 0 ? o.free : o.used)++;
  }
  return o;
}

}  // namespace cxlkv
