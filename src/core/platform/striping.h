// Stripe arithmetic of a pool interleaved over several devices (format.h "Striped pools"): which
// device holds a pool byte and where. Pure functions of a validated StripeGeometry; the mapping
// layer (striped_mapping.cpp) maps by them, the allocator places blocks by them (placement.cpp),
// and tests/cpp/test_striping.cpp checks them against the bytes of real device files.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format.h"

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

// A pool named by several devices is written as one string, the device paths joined by commas
// ("/dev/shm/a,/dev/shm/b"): every place that takes a pool path (API, CLI, CXLKV_POOL, the vLLM
// connector's pool_path) takes a device list unchanged. Throws ArgumentError on an empty element,
// a path listed twice or more than kMaxDevices devices. One element: a single-device pool.
std::vector<std::string> split_device_list(const std::string& spec);
inline bool is_device_list(const std::string& spec) { return spec.find(',') != std::string::npos; }

// Fills `t` for a new pool of pool_bytes over `devices` devices. Throws ArgumentError when the
// stripe is not a power of two in range (a multiple of 2 MiB with devdax), or when pool_bytes is
// not a stripe multiple of at least one stripe per device. Pure (tests/cpp/test_geometry.cpp).
void plan_stripes(format::StripeTable& t, uint64_t pool_bytes, uint32_t devices, uint64_t stripe_bytes,
                  bool devdax);
// Validates a table read from a pool (untrusted): magic, checksum, device count, stripe, label,
// device sizes equal to what the geometry needs. Returns "" or a one-line reason.
std::string stripe_table_problem(const format::StripeTable& t, uint64_t pool_bytes);
StripeGeometry stripe_geometry(const format::StripeTable& t);
// A striped range takes one memory map per stripe (neighbours are on different devices, so none
// merge). "" if `need` more maps fit a process that holds `used` of `limit` (vm.max_map_count,
// 256 kept for the libraries), else the one-line reason with both ways out.
std::string map_budget_problem(uint64_t need, uint64_t used, uint64_t limit, const std::string& what);
uint64_t stripe_table_checksum(const format::StripeTable& t);
uint64_t device_label_checksum(const format::DeviceLabel& l);

}  // namespace cxlkv
