// Device placement in a striped pool (docs/ARCHITECTURE.md "Device interleaving"). By default a
// namespace's blocks go anywhere: the pool is interleaved stripe by stripe over its devices, so
// a large copy spreads over all of them. A handle bound to device d (SAC §4.3.3: one request's
// KV on one device, requests spread round-robin) takes only blocks whose whole payload lies in a
// stripe of device d: the allocator skips the other blocks of a chunk (they stay free for other
// handles), never carves or steals a chunk that holds no such block, and evicts only victims on
// d. The rule needs no format field: a block's device is a function of its offset.
#include <algorithm>

#include "allocator.h"
#include "errors.h"

namespace cxlkv {

using namespace format;

NsHandle Allocator::bind_device(const NsHandle& ns, int device, const std::string& path) const {
  NsHandle h = ns;
  h.device = -1;
  if (device < 0) return h;
  if (uint32_t(device) >= stripes_.devices)
    throw ArgumentError("device " + std::to_string(device) + " out of range: pool " + path + " has " +
                        std::to_string(stripes_.devices) + " device(s), 0.." +
                        std::to_string(stripes_.devices - 1));
  if (!stripes_.striped()) return h;  // one device: every block is on it
  if (ns.geo.block_stride > stripes_.stripe)
    throw ArgumentError("namespace '" + ns.name + "': a block of " + std::to_string(ns.geo.block_stride) +
                        " bytes is larger than the stripe (" + std::to_string(stripes_.stripe) +
                        " bytes) and can never lie on one device; create the pool with a larger stripe size");
  h.device = device;
  return h;
}

bool Allocator::block_on_device(const NsHandle& ns, uint64_t chunk, uint32_t block) const {
  if (ns.device < 0) return true;
  uint64_t off = hdr().arena_off + chunk * region_.chunk_stride() + region_.desc_bytes() +
                 uint64_t(block) * ns.geo.block_stride;
  return range_device(stripes_, off, ns.geo.block_stride) == ns.device;
}

bool Allocator::chunk_has_device_blocks(const NsHandle& ns, uint64_t chunk) const {
  if (ns.device < 0) return true;
  for (uint32_t b = 0; b < ns.geo.blocks; ++b)
    if (block_on_device(ns, chunk, b)) return true;
  return false;
}

std::vector<DeviceUse> Allocator::device_usage(const std::vector<std::string>& paths) {
  const PoolHeader* hdr_ = region_.header();
  const Coherence& coh = region_.coh();
  const uint32_t n = stripes_.devices;
  std::vector<DeviceUse> out(n);
  for (uint32_t d = 0; d < n; ++d) {
    out[d].path = paths.at(d);
    out[d].pool_bytes = stripes_.striped() ? device_stripes(stripes_, hdr_->pool_bytes, d) * stripes_.stripe
                                           : hdr_->pool_bytes;
    out[d].device_bytes = device_need_bytes(stripes_, hdr_->pool_bytes, d);
  }
  // Bytes of [off, off + len) on each device (a block may cross a stripe boundary).
  auto spread = [&](uint64_t off, uint64_t len, uint64_t DeviceUse::* field) {
    while (len) {
      uint64_t take = stripes_.striped() ? std::min(len, stripes_.stripe - off % stripes_.stripe) : len;
      out[stripe_device(stripes_, off)].*field += take;
      off += take, len -= take;
    }
  };
  std::vector<ChunkGeometry> geo(hdr_->max_namespaces + 1);
  for (const NsHandle& h : peers_.namespace_handles()) geo[h.id] = h.geo;
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh.read(region_.chunk_word(c));
    if (chunk_state(w) != kChunkActive || chunk_ns(w) == 0 || chunk_ns(w) > hdr_->max_namespaces) continue;
    const ChunkGeometry& g = geo[chunk_ns(w)];
    for (uint32_t b = 0; b < g.blocks; ++b) {
      uint64_t off =
          hdr_->arena_off + c * region_.chunk_stride() + region_.desc_bytes() + uint64_t(b) * g.block_stride;
      spread(off, g.block_stride, &DeviceUse::capacity_bytes);
      if (coh.read(region_.block_desc(c, b)) != 0) spread(off, g.block_stride, &DeviceUse::used_bytes);
    }
  }
  return out;
}

std::vector<NamespaceUse> Allocator::namespace_usage() {
  const PoolHeader* hdr_ = region_.header();
  const Coherence& coh = region_.coh();
  // Geometry from the validated namespace list; a chunk word naming an id outside it (or out of
  // range) counts for nobody.
  std::vector<ChunkGeometry> geo(hdr_->max_namespaces + 1);
  std::vector<NamespaceUse> by_id(hdr_->max_namespaces + 1);
  for (const NsHandle& h : peers_.namespace_handles()) geo[h.id] = h.geo, by_id[h.id].id = h.id;
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t w = coh.read(region_.chunk_word(c));
    if (chunk_state(w) != kChunkActive || chunk_ns(w) == 0 || chunk_ns(w) > hdr_->max_namespaces) continue;
    NamespaceUse& u = by_id[chunk_ns(w)];
    if (u.id == 0) continue;
    const ChunkGeometry& g = geo[u.id];
    ++u.chunks;
    u.capacity_blocks += g.blocks;
    for (uint32_t b = 0; b < g.blocks; ++b) u.used_blocks += coh.read(region_.block_desc(c, b)) != 0;
  }
  std::vector<NamespaceUse> out;
  for (const NamespaceUse& u : by_id)
    if (u.id != 0) out.push_back(u);
  return out;
}

}  // namespace cxlkv
