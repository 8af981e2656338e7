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

}  // namespace
}  // namespace cxlkv::test
