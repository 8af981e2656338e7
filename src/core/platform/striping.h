// Stripe arithmetic of a range interleaved over several devices: which device holds a byte and
// where. Pure functions of a validated StripeGeometry; the mapping layer (striped_mapping.cpp)
// maps by them, the allocator places blocks by them (placement.cpp), and
// tests/cpp/test_striping.cpp checks them against the bytes of real device files. What a pool
// records about its stripes (the stripe table, the device labels) is format/stripe_table.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace cxlkv {

struct StripeGeometry {
  uint32_t devices = 1;  // 1: not striped (stripe and label unused)
  uint64_t stripe = 0;   // stripe bytes
  uint64_t label = 0;    // label area before the stripes of devices 1..devices-1
  bool striped() const { return devices > 1; }
};

// Device holding pool byte `off`, and that byte's offset on its device.
inline uint32_t stripe_device(const StripeGeometry& g, uint64_t off) {
  return g.striped() ? uint32_t((off / g.stripe) % g.devices) : 0;
}
inline uint64_t device_offset(const StripeGeometry& g, uint64_t off) {
  if (!g.striped()) return off;
  uint64_t i = off / g.stripe;
  uint32_t d = uint32_t(i % g.devices);
  return (d ? g.label : 0) + (i / g.devices) * g.stripe + off % g.stripe;
}
// The device that holds all of [off, off + len), or -1 when the range crosses a stripe boundary
// (its bytes are then on two devices). len 0 counts as one byte.
inline int range_device(const StripeGeometry& g, uint64_t off, uint64_t len) {
  if (!g.striped()) return 0;
  uint64_t last = off + (len ? len - 1 : 0);
  if (off / g.stripe != last / g.stripe) return -1;
  return int(stripe_device(g, off));
}
// Stripes of a pool of pool_bytes (a stripe multiple) that live on device d.
inline uint64_t device_stripes(const StripeGeometry& g, uint64_t pool_bytes, uint32_t d) {
  uint64_t total = pool_bytes / g.stripe;
  return total > d ? (total - d + g.devices - 1) / g.devices : 0;
}
// Bytes device d must have: its label (devices > 0) and its stripes.
inline uint64_t device_need_bytes(const StripeGeometry& g, uint64_t pool_bytes, uint32_t d) {
  if (!g.striped()) return pool_bytes;
  return (d ? g.label : 0) + device_stripes(g, pool_bytes, d) * g.stripe;
}

// A striped range takes one memory map per stripe (neighbours are on different devices, so none
// merge). "" if `need` more maps fit a process that holds `used` of `limit` (vm.max_map_count,
// 256 kept for the libraries), else the one-line reason with both ways out.
std::string map_budget_problem(uint64_t need, uint64_t used, uint64_t limit, const std::string& what);

}  // namespace cxlkv
