// plan_geometry (geometry.cpp) by table: the derived defaults for pools from 4 MiB to 64 GiB, the
// invariants every plan must hold (areas in order, aligned, inside the pool, no overlap), and the
// option errors. A change of the derivation rules shows up here as a changed row, on purpose.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "pool.h"

namespace cxlkv::test {
namespace {

using format::PoolHeader;
constexpr uint64_t MiB = 1ull << 20;

struct Row {
  uint64_t size;
  uint32_t max_nodes;
  Backend backend;
  // derived
  uint64_t chunk_bytes, index_slots;
  uint32_t pin_slots;
  uint64_t chunk_count;
  uint32_t lock_hosts;
};

// Measured from the rules as written (2026-11-23): chunk = pow2_floor(size / 64) clamped to
// 4..64 MiB (shrunk to what is left for pools below one chunk), index slots = 2 per 8 KiB capped
// at 1/16 of the pool (at least 4096), pins = size / 32 / nodes / 8 clamped to 256..4096.
const Row kRows[] = {
    {4 * MiB, 64, Backend::coherent, 1466368, 4096, 256, 2, 0},
    {16 * MiB, 64, Backend::coherent, 4 * MiB, 4096, 1024, 3, 0},
    {64 * MiB, 64, Backend::coherent, 4 * MiB, 16384, 4096, 14, 0},
    {1024 * MiB, 64, Backend::coherent, 16 * MiB, 262144, 4096, 62, 0},
    {64 * 1024 * MiB, 64, Backend::coherent, 64 * MiB, 16777216, 4096, 998, 0},
    {256 * MiB, 8, Backend::multihost, 4 * MiB, 65536, 4096, 62, format::kLockHostsDefault},
};

PoolHeader plan(const Row& r) {
  CreateOptions o;
  o.size = r.size;
  o.max_nodes = r.max_nodes;
  o.backend = r.backend;
  PoolHeader h{};
  plan_geometry(h, o);
  return h;
}

// The invariants Pool::validate_and_attach re-checks at open, asserted on the plan itself.
void expect_well_formed(const PoolHeader& h, uint64_t size) {
  EXPECT_EQ(h.pool_bytes, size);
  EXPECT_GE(h.node_table_off, format::kSharedWordsOff + format::kMetaAlign);
  struct Area {
    uint64_t off, len;
  } areas[] = {
      {h.node_table_off, uint64_t(h.max_nodes) * sizeof(format::NodeSlot)},
      {h.node_area_off, uint64_t(h.max_nodes) * h.node_area_bytes},
      {h.ns_table_off, uint64_t(h.max_namespaces) * sizeof(format::NamespaceEntry)},
      {h.index_off, h.index_slots * sizeof(format::IndexEntry)},
      {h.access_off, h.index_slots * 8},
      {h.chunk_map_off, h.chunk_count * 8},
      {h.arena_off, h.chunk_count * (format::chunk_desc_bytes(h.chunk_bytes) + h.chunk_bytes)},
  };
  uint64_t end = h.node_table_off;
  for (const Area& a : areas) {
    EXPECT_GE(a.off, end) << "areas overlap or are out of order";
    EXPECT_EQ(a.off % 64, 0u);
    end = a.off + a.len;
  }
  EXPECT_LE(end, size) << "the last chunk ends past the pool";
  EXPECT_EQ(h.arena_off % 65536, 0u);
  EXPECT_EQ(h.node_area_bytes % format::kMetaAlign, 0u);
  EXPECT_GE(h.node_area_bytes, sizeof(format::NodeAreaFixed) + uint64_t(h.pin_slots) * 8);
  EXPECT_LE(h.node_area_bytes, size / h.max_nodes);
  EXPECT_EQ(h.index_slots & (h.index_slots - 1), 0u) << "index slots must be a power of two";
  EXPECT_EQ(h.chunk_bytes % format::kMetaAlign, 0u);
  EXPECT_GE(h.chunk_count, 1u);
}

TEST(Geometry, DerivedDefaultsByTable) {
  for (const Row& r : kRows) {
    SCOPED_TRACE("size " + std::to_string(r.size) + " nodes " + std::to_string(r.max_nodes));
    PoolHeader h = plan(r);
    EXPECT_EQ(h.chunk_bytes, r.chunk_bytes);
    EXPECT_EQ(h.index_slots, r.index_slots);
    EXPECT_EQ(h.pin_slots, r.pin_slots);
    EXPECT_EQ(h.chunk_count, r.chunk_count);
    EXPECT_EQ(h.lock_hosts, r.lock_hosts);
    expect_well_formed(h, r.size);
  }
}

TEST(Geometry, EverySizeFrom1To512MiBIsWellFormedOrRefused) {
  // Sizes that are not round: the plan either fits or refuses with ArgumentError, never overflows.
  for (uint64_t size = 1 * MiB + 12345; size < 512 * MiB; size = size * 3 / 2 + 4097) {
    SCOPED_TRACE("size " + std::to_string(size));
    CreateOptions o;
    o.size = size;
    PoolHeader h{};
    try {
      plan_geometry(h, o);
    } catch (const ArgumentError&) {
      EXPECT_LT(size, 8 * MiB) << "only tiny pools may be refused";
      continue;
    }
    expect_well_formed(h, size);
  }
}

TEST(Geometry, ExplicitOptionsAreKeptOrRefused) {
  CreateOptions o;
  o.size = 64 * MiB;
  o.chunk_bytes = 1 * MiB;
  o.index_slots = 8192;
  o.pin_slots = 300;
  o.max_nodes = 4;
  o.max_namespaces = 7;
  PoolHeader h{};
  plan_geometry(h, o);
  EXPECT_EQ(h.chunk_bytes, 1 * MiB);
  EXPECT_EQ(h.index_slots, 8192u);
  EXPECT_EQ(h.pin_slots, 300u);
  EXPECT_EQ(h.max_nodes, 4u);
  EXPECT_EQ(h.max_namespaces, 7u);
  expect_well_formed(h, o.size);

  auto refused = [](auto&& edit) {
    CreateOptions bad;
    bad.size = 64 * MiB;
    edit(bad);
    PoolHeader h2{};
    EXPECT_THROW(plan_geometry(h2, bad), ArgumentError);
  };
  refused([](CreateOptions& c) { c.max_nodes = 0; });
  refused([](CreateOptions& c) { c.max_nodes = format::kMaxNodes + 1; });
  refused([](CreateOptions& c) { c.max_namespaces = 0; });
  refused([](CreateOptions& c) { c.index_slots = 5000; });           // not a power of two
  refused([](CreateOptions& c) { c.chunk_bytes = 64 * 1024 + 1; });  // not a 4 KiB multiple
  refused([](CreateOptions& c) { c.chunk_bytes = 32 * 1024; });      // below 64 KiB
  refused([](CreateOptions& c) { c.pin_slots = (1u << 20) + 1; });
  refused([](CreateOptions& c) { c.size = 256 * 1024; });  // no room for one chunk
}

// Striped pools (plan_striped_geometry): the size is cut to whole stripes, each device's share is
// its stripes (plus a label on devices 1..), the areas are those of a single-device pool of that
// size, and the stripe rules refuse what cannot be mapped.
struct StripeRow {
  uint64_t size, stripe;
  uint32_t devices;
  bool devdax;
  uint64_t pool_bytes;
  uint64_t device_bytes[3];
};
const StripeRow kStripeRows[] = {
    // 64 MiB over 2 files at 2 MiB: 16 stripes each; device 1 starts with a 2 MiB label area
    // (min(stripe, 2 MiB): its stripes' file offsets are 2 MiB aligned like their addresses).
    {64 * MiB, 0, 2, false, 64 * MiB, {32 * MiB, 34 * MiB, 0}},
    // 30 MiB + 100 KiB over 3 at 2 MiB: cut to 30 MiB = 15 stripes, 5 per device.
    {30 * MiB + 102400, 2 * MiB, 3, false, 30 * MiB, {10 * MiB, 12 * MiB, 12 * MiB}},
    // 7 stripes of 1 MiB over 3: devices hold 3, 2, 2 stripes; a 1 MiB label.
    {7 * MiB, MiB, 3, false, 7 * MiB, {3 * MiB, 3 * MiB, 3 * MiB}},
    // 256 KiB stripes: a 256 KiB label.
    {4 * MiB, 256 * 1024, 2, false, 4 * MiB, {2 * MiB, 2 * MiB + 256 * 1024, 0}},
    // devdax: the same rule (stripes are 2 MiB multiples there).
    {64 * MiB, 4 * MiB, 2, true, 64 * MiB, {32 * MiB, 34 * MiB, 0}},
};

TEST(Geometry, StripedPoolsByTable) {
  for (const StripeRow& r : kStripeRows) {
    SCOPED_TRACE("size " + std::to_string(r.size) + " devices " + std::to_string(r.devices));
    CreateOptions o;
    o.size = r.size;
    o.stripe_bytes = r.stripe;
    PoolHeader h{};
    format::StripeTable t{};
    plan_striped_geometry(h, t, o, r.devices, r.devdax);
    expect_well_formed(h, r.pool_bytes);
    EXPECT_EQ(t.device_count, r.devices);
    EXPECT_EQ(t.stripe_bytes, r.stripe ? r.stripe : format::kStripeBytesDefault);
    for (uint32_t d = 0; d < 3; ++d) EXPECT_EQ(t.device_bytes[d], d < r.devices ? r.device_bytes[d] : 0) << d;
    EXPECT_EQ(stripe_table_problem(t, h.pool_bytes), "");
    // Every stripe is on exactly one device, and the devices' shares add up to the pool.
    uint64_t sum = 0;
    for (uint32_t d = 0; d < r.devices; ++d) sum += device_stripes(stripe_geometry(t), h.pool_bytes, d);
    EXPECT_EQ(sum * t.stripe_bytes, h.pool_bytes);
  }
}

TEST(Geometry, StripeOptionsAreRefused) {
  auto plan_with = [](uint64_t size, uint64_t stripe, uint32_t devices, bool devdax) {
    CreateOptions o;
    o.size = size;
    o.stripe_bytes = stripe;
    PoolHeader h{};
    format::StripeTable t{};
    plan_striped_geometry(h, t, o, devices, devdax);
  };
  EXPECT_THROW(plan_with(64 * MiB, 3 * MiB, 2, false), ArgumentError);     // not a power of two
  EXPECT_THROW(plan_with(64 * MiB, 32 * 1024, 2, false), ArgumentError);   // below 64 KiB
  EXPECT_THROW(plan_with(64 * MiB, 2ull << 30, 2, false), ArgumentError);  // above 1 GiB
  EXPECT_THROW(plan_with(64 * MiB, MiB, 2, true), ArgumentError);          // devdax: 2 MiB multiple
  EXPECT_THROW(plan_with(3 * MiB, 2 * MiB, 2, false), ArgumentError);      // one stripe, two devices
  EXPECT_THROW(plan_with(64 * MiB, 0, 1, false), ArgumentError);           // one device is not striped
  EXPECT_THROW(plan_with(64 * MiB, 0, format::kMaxDevices + 1, false), ArgumentError);
  EXPECT_NO_THROW(plan_with(64 * MiB, 64 * 1024, format::kMaxDevices, false));
}

TEST(Geometry, StripeTableProblemsAreNamed) {
  CreateOptions o;
  o.size = 64 * MiB;
  PoolHeader h{};
  format::StripeTable t{};
  plan_striped_geometry(h, t, o, 2, false);
  auto forged = [&](auto edit) {
    format::StripeTable f = t;
    edit(f);
    f.checksum = stripe_table_checksum(f);  // re-sealed: the fields themselves must be refused
    return stripe_table_problem(f, h.pool_bytes);
  };
  EXPECT_EQ(forged([](auto& f) { f.device_count = 1; }), "device count");
  EXPECT_EQ(forged([](auto& f) { f.device_count = 17; }), "device count");
  EXPECT_EQ(forged([](auto& f) { f.stripe_bytes = 3 * MiB; }), "stripe size");
  EXPECT_EQ(forged([](auto& f) { f.label_bytes = 100; }), "label size");
  EXPECT_EQ(forged([](auto& f) { f.device_bytes[1] -= 4096; }), "device sizes");
  EXPECT_EQ(forged([](auto& f) { f.device_bytes[5] = 1; }), "device sizes");
  EXPECT_EQ(forged([](auto& f) { f.stripe_bytes = 128 * MiB; }), "pool size vs stripes");
  format::StripeTable c = t;
  c.stripe_bytes = 4 * MiB;  // not re-sealed
  EXPECT_EQ(stripe_table_problem(c, h.pool_bytes), "stripe table checksum");
}

}  // namespace
}  // namespace cxlkv::test
