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

bool Pool::claim_free_block(const NsHandle& ns, uint64_t chunk, uint64_t slot, uint32_t* block, uint32_t start) {
  uint32_t n = ns.geo.blocks;
  uint64_t used = make_block_word(kBlockUsed, uint8_t(node_id_), slot);
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t b = (start + i) % n;
    uint64_t* d = block_desc(chunk, b);
    uint64_t w = coh_.read(d);
    if (w != 0) continue;
    if (coh_.claim(d, w, used)) {
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
    if (chunk_state(w) != kChunkFree) continue;
    if (!coh_.claim(cw, w, make_chunk_word(kChunkCarving, uint8_t(node_id_), ns.id))) continue;
    // Descs of a never-used chunk are zero already; reset anyway so the invariant does not
    // depend on history (a chunk freed by a crashed carver, a devdax reused across pools).
    uint64_t* d = block_desc(c, 0);
    std::memset(d, 0, desc_bytes_);
    coh_.flush(d, desc_bytes_);
    coh_.publish(cw, make_chunk_word(kChunkActive, 0, ns.id));
    *out = c;
    return true;
  }
  return false;
}

bool Pool::alloc_block(const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block) {
  constexpr uint64_t kStealBackoffUs = 20'000;
  NsAlloc st;
  {
    std::lock_guard<std::mutex> g(alloc_mu_);
    st = alloc_[ns.id];
  }
  auto remember = [&](uint64_t c, uint32_t next, uint64_t steal_after) {
    std::lock_guard<std::mutex> g(alloc_mu_);
    alloc_[ns.id] = NsAlloc{c, next, steal_after};
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
  if (now < st.steal_after_us) return false;
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
  return false;
}

void Pool::free_block(uint64_t chunk, uint32_t block) { coh_.publish(block_desc(chunk, block), 0); }

Pool::Occupancy Pool::occupancy() {
  Occupancy o{};
  std::vector<format::ChunkGeometry> geo(hdr_->max_namespaces + 1);
  for (auto& [h, l] : list_namespaces()) geo[h.id] = h.geo;
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh_.read(chunk_word(c));
    if (chunk_state(w) == kChunkFree) { ++o.free_chunks; continue; }
    if (chunk_state(w) != kChunkActive) continue;
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
