// The stripe table and the device labels of a pool interleaved over several devices (format.h
// "Striped pools"): how a new pool's table is planned, how a table or label read from a device is
// checked (untrusted), and how a pool path names its devices. Format facts, beside format.h; the
// stripe arithmetic they produce (StripeGeometry) is the mapper's (platform/striping.h), which
// knows nothing of pools. Pure functions (tests/cpp/test_geometry.cpp, test_striping.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format.h"
#include "striping.h"

namespace cxlkv {

// A pool named by several devices is written as one string, the device paths joined by commas
// ("/dev/shm/a,/dev/shm/b"): every place that takes a pool path (API, CLI, CXLKV_POOL, the vLLM
// connector's pool_path) takes a device list unchanged. Throws ArgumentError on an empty element,
// a path listed twice or more than kMaxDevices devices. One element: a single-device pool.
std::vector<std::string> split_device_list(const std::string& spec);
inline bool is_device_list(const std::string& spec) { return spec.find(',') != std::string::npos; }

// Fills `t` for a new pool of pool_bytes over `devices` devices. Throws ArgumentError when the
// stripe is not a power of two in range (a multiple of 2 MiB with devdax), or when pool_bytes is
// not a stripe multiple of at least one stripe per device.
void plan_stripes(format::StripeTable& t, uint64_t pool_bytes, uint32_t devices, uint64_t stripe_bytes,
                  bool devdax);
// Validates a table read from a pool (untrusted): magic, checksum, device count, stripe, label,
// device sizes equal to what the geometry needs. Returns "" or a one-line reason.
std::string stripe_table_problem(const format::StripeTable& t, uint64_t pool_bytes);
StripeGeometry stripe_geometry(const format::StripeTable& t);
// Bytes each device must have, device 0 first (the mapper's input).
std::vector<uint64_t> device_bytes(const format::StripeTable& t);
uint64_t stripe_table_checksum(const format::StripeTable& t);
uint64_t device_label_checksum(const format::DeviceLabel& l);
// The label of device k (1..) of a new pool, sealed with its checksum.
format::DeviceLabel device_label(const format::StripeTable& t, const uint8_t uuid[16], uint32_t k,
                                 uint64_t pool_bytes);

}  // namespace cxlkv
