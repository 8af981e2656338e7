// The stripe table and device labels (stripe_table.h): planning a new pool's table, checking one
// read from a device, naming the devices of a pool path.
#include "stripe_table.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <set>

#include "checksum.h"
#include "errors.h"

namespace cxlkv {

using namespace format;

namespace {
constexpr uint64_t kDevdaxAlign = 2ull << 20;  // a devdax device maps in 2 MiB units
bool pow2(uint64_t v) { return v && !(v & (v - 1)); }
}  // namespace

std::vector<std::string> split_device_list(const std::string& spec) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t comma = spec.find(',', start);
    std::string p = spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (p.empty()) throw ArgumentError("empty device in pool path list '" + spec + "'");
    out.push_back(p);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (out.size() > kMaxDevices)
    throw ArgumentError("a pool spans at most " + std::to_string(kMaxDevices) + " devices, " +
                        std::to_string(out.size()) + " given");
  std::set<std::string> seen;
  for (auto& p : out)
    if (!seen.insert(p).second) throw ArgumentError("device " + p + " is listed twice in '" + spec + "'");
  return out;
}

uint64_t stripe_table_checksum(const StripeTable& t) { return xxh3(&t, offsetof(StripeTable, checksum)); }
uint64_t device_label_checksum(const DeviceLabel& l) { return xxh3(&l, offsetof(DeviceLabel, checksum)); }

StripeGeometry stripe_geometry(const StripeTable& t) {
  StripeGeometry g;
  g.devices = t.device_count;
  g.stripe = t.stripe_bytes;
  g.label = t.label_bytes;
  return g;
}

std::vector<uint64_t> device_bytes(const StripeTable& t) {
  return std::vector<uint64_t>(t.device_bytes, t.device_bytes + std::min(t.device_count, kMaxDevices));
}

DeviceLabel device_label(const StripeTable& t, const uint8_t uuid[16], uint32_t k, uint64_t pool_bytes) {
  DeviceLabel l{};
  std::memcpy(l.magic, kLabelMagic, 8);
  std::memcpy(l.pool_uuid, uuid, 16);
  l.device_index = k;
  l.device_count = t.device_count;
  l.stripe_bytes = t.stripe_bytes;
  l.pool_bytes = pool_bytes;
  l.label_bytes = t.label_bytes;
  l.checksum = device_label_checksum(l);
  return l;
}

void plan_stripes(StripeTable& t, uint64_t pool_bytes, uint32_t devices, uint64_t stripe, bool devdax) {
  if (devices < 2 || devices > kMaxDevices)
    throw ArgumentError("a striped pool has 2.." + std::to_string(kMaxDevices) + " devices");
  if (stripe == 0) stripe = kStripeBytesDefault;
  if (!pow2(stripe) || stripe < kStripeBytesMin || stripe > kStripeBytesMax)
    throw ArgumentError("stripe size must be a power of two in " + std::to_string(kStripeBytesMin) + ".." +
                        std::to_string(kStripeBytesMax) + " bytes");
  if (devdax && stripe % kDevdaxAlign)
    throw ArgumentError("a pool striped over devdax devices needs a stripe size that is a multiple of 2 MiB");
  if (pool_bytes % stripe || pool_bytes < uint64_t(devices) * stripe)
    throw ArgumentError("a striped pool's size must be a multiple of the stripe size (" +
                        std::to_string(stripe) + ") holding at least one stripe per device");
  std::memset(&t, 0, sizeof t);
  std::memcpy(t.magic, kStripeMagic, 8);
  t.device_count = devices;
  t.table_bytes = sizeof(StripeTable);
  t.stripe_bytes = stripe;
  t.label_bytes = label_bytes_for(stripe);
  StripeGeometry g = stripe_geometry(t);
  for (uint32_t d = 0; d < devices; ++d) t.device_bytes[d] = device_need_bytes(g, pool_bytes, d);
  t.checksum = stripe_table_checksum(t);
}

std::string stripe_table_problem(const StripeTable& t, uint64_t pool_bytes) {
  if (std::memcmp(t.magic, kStripeMagic, 8) != 0) return "stripe table magic";
  if (t.checksum != stripe_table_checksum(t)) return "stripe table checksum";
  if (t.table_bytes != sizeof(StripeTable)) return "stripe table size";
  if (t.device_count < 2 || t.device_count > kMaxDevices) return "device count";
  if (!pow2(t.stripe_bytes) || t.stripe_bytes < kStripeBytesMin || t.stripe_bytes > kStripeBytesMax)
    return "stripe size";
  if (t.label_bytes != label_bytes_for(t.stripe_bytes)) return "label size";
  if (pool_bytes % t.stripe_bytes || pool_bytes / t.stripe_bytes < t.device_count)
    return "pool size vs stripes";
  StripeGeometry g = stripe_geometry(t);
  for (uint32_t d = 0; d < kMaxDevices; ++d)
    if (t.device_bytes[d] != (d < t.device_count ? device_need_bytes(g, pool_bytes, d) : 0))
      return "device sizes";
  return "";
}

}  // namespace cxlkv
