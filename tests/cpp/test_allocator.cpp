// Block allocator: capacity accounting (occupancy() and check() agree with the puts made),
// eviction once the pool is full, chunks owned by one namespace each, blocks too big for a chunk.
#include <chrono>
#include <set>
#include <thread>

#include "test_util.h"

namespace cxlkv::test {
namespace {

// 4 MiB pool, 64 KiB chunks, 16 KiB blocks: 4 blocks per chunk, a few dozen chunks.
class AllocatorTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(4 * MiB, 64 * KiB, 1024));
    ns_ = pool_->open_namespace(layout("alloc", kBlock));
    total_blocks_ = pool_->header().chunk_count * ns_.geo.blocks;
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  bool put_id(const NsHandle& ns, uint64_t id, uint64_t len) {
    auto v = payload(id, len);
    Piece p{v.data(), v.size()};
    return pool_->put(ns, key_of(id), &p, 1, 0);
  }
  void expect_check_ok(const char* when) {
    auto r = pool_->check();
    EXPECT_TRUE(r.ok) << when << join(r.errors);
    EXPECT_EQ(r.capacity_blocks, r.free_blocks + r.ready_blocks + r.inflight_blocks) << when;
    EXPECT_EQ(r.leaked_blocks, 0u) << when;
    EXPECT_EQ(r.stuck_entries, 0u) << when;
    EXPECT_EQ(r.inflight_blocks, 0u) << when;  // single thread, nothing in flight between calls
  }

  static constexpr uint64_t kBlock = 16 * KiB;
  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
  uint64_t total_blocks_ = 0;
};

TEST_F(AllocatorTest, Geometry) {
  EXPECT_EQ(ns_.geo.blocks, 4u);
  EXPECT_EQ(ns_.geo.block_stride, kBlock);
  EXPECT_GE(pool_->header().chunk_count, 8u);
  auto o = pool_->occupancy();
  EXPECT_EQ(o.capacity, 0u);  // chunks are carved lazily
  EXPECT_EQ(o.free_chunks, pool_->header().chunk_count);
  EXPECT_EQ(o.active_chunks, 0u);
}

TEST_F(AllocatorTest, CapacityEqualsFreePlusUsed) {
  const uint64_t n = total_blocks_ / 2 + 3;
  for (uint64_t id = 0; id < n; ++id) {
    ASSERT_TRUE(put_id(ns_, id, kBlock - (id % 3) * 100));
    if (id % 17 == 0 || id == n - 1) {
      auto o = pool_->occupancy();
      EXPECT_EQ(o.capacity, o.free + o.used);
      EXPECT_EQ(o.used, id + 1);
      EXPECT_EQ(o.capacity, o.active_chunks * ns_.geo.blocks);
      EXPECT_EQ(o.free_chunks + o.active_chunks, pool_->header().chunk_count);
    }
  }
  auto r = pool_->check();
  EXPECT_EQ(r.ready_blocks, n);
  expect_check_ok("after puts");
  // Removing returns blocks to free.
  for (uint64_t id = 0; id < n; id += 2) EXPECT_TRUE(pool_->remove(ns_, key_of(id)));
  auto o = pool_->occupancy();
  EXPECT_EQ(o.used, n / 2);
  EXPECT_EQ(o.capacity, o.free + o.used);
  expect_check_ok("after removes");
  // Fill the whole pool: freed blocks are reused once no fresh chunk is left.
  for (uint64_t id = n; id < n + total_blocks_ - n / 2; ++id) ASSERT_TRUE(put_id(ns_, id, kBlock));
  o = pool_->occupancy();
  EXPECT_EQ(o.capacity, total_blocks_);
  EXPECT_EQ(o.used, total_blocks_);
  EXPECT_EQ(o.free, 0u);
  EXPECT_EQ(pool_->counters()[format::kEvictions], 0u);  // it all fit without evicting
  expect_check_ok("after reuse");
}

TEST_F(AllocatorTest, PutsBeyondCapacityEvict) {
  const uint64_t n = total_blocks_ * 3;
  for (uint64_t id = 0; id < n; ++id) ASSERT_TRUE(put_id(ns_, id, kBlock)) << "put " << id;
  auto c = pool_->counters();
  EXPECT_GE(c[format::kEvictions], n - total_blocks_);
  EXPECT_EQ(c[format::kPuts], n);
  EXPECT_EQ(c[format::kPutsFailed], 0u);
  auto o = pool_->occupancy();
  EXPECT_EQ(o.capacity, total_blocks_);
  EXPECT_EQ(o.free_chunks, 0u);
  EXPECT_EQ(o.used, total_blocks_);
  EXPECT_EQ(o.free, 0u);
  auto r = pool_->check();
  EXPECT_EQ(r.ready_blocks, total_blocks_);
  expect_check_ok("after eviction");
  // Whatever survived reads back its own bytes; recent keys mostly survive.
  uint64_t present = 0;
  std::vector<char> out(kBlock);
  for (uint64_t id = 0; id < n; ++id) {
    Piece p{out.data(), out.size()};
    uint64_t len = 0;
    if (!pool_->get(ns_, key_of(id), &p, 1, &len)) continue;
    ++present;
    ASSERT_EQ(len, kBlock);
    ASSERT_EQ(out, payload(id, kBlock)) << "id " << id;
  }
  EXPECT_EQ(present, total_blocks_);
  EXPECT_EQ(pool_->counters()[format::kChecksumFailures], 0u);
}

TEST_F(AllocatorTest, NamespacesGetDistinctChunks) {
  auto small = pool_->open_namespace(layout("small", 4 * KiB));
  EXPECT_NE(small.id, ns_.id);
  EXPECT_EQ(small.geo.blocks, 16u);
  for (uint64_t id = 0; id < 10; ++id) ASSERT_TRUE(put_id(ns_, id, kBlock));
  for (uint64_t id = 0; id < 40; ++id) ASSERT_TRUE(put_id(small, id, 4 * KiB));

  RawMap raw(path_);
  std::set<uint32_t> big_chunks, small_chunks;
  for (uint64_t s : raw.ready_slots()) {
    auto* e = raw.entry(s);
    (e->ns_id == ns_.id ? big_chunks : small_chunks).insert(e->chunk);
    EXPECT_EQ(format::chunk_state(raw.chunk_word(e->chunk)), format::kChunkActive);
    EXPECT_EQ(format::chunk_ns(raw.chunk_word(e->chunk)), e->ns_id);
  }
  EXPECT_EQ(big_chunks.size(), 3u);    // 10 blocks of 4 per chunk
  EXPECT_EQ(small_chunks.size(), 3u);  // 40 blocks of 16 per chunk
  for (uint32_t c : big_chunks) EXPECT_EQ(small_chunks.count(c), 0u) << "chunk " << c << " shared";
  auto o = pool_->occupancy();
  EXPECT_EQ(o.active_chunks, 6u);
  EXPECT_EQ(o.capacity, 3u * 4 + 3u * 16);
  EXPECT_EQ(o.used, 50u);
  expect_check_ok("two namespaces");
}

// A namespace that arrives after another one filled the pool takes chunks from it (draining them)
// until both hold a fair share; the donor's surviving blocks are intact.
TEST_F(AllocatorTest, FullPoolIsSharedBetweenNamespaces) {
  for (uint64_t id = 0; id < total_blocks_ * 2; ++id) ASSERT_TRUE(put_id(ns_, id, kBlock));
  ASSERT_EQ(pool_->occupancy().free_chunks, 0u);
  auto late = pool_->open_namespace(layout("late", 4 * KiB));
  const uint64_t chunks = pool_->header().chunk_count;
  for (uint64_t id = 0; id < chunks * late.geo.blocks; ++id)
    ASSERT_TRUE(put_id(late, id, 4 * KiB)) << "put " << id << " into the late namespace";
  RawMap raw(path_);
  uint64_t held_big = 0, held_late = 0;
  for (uint64_t c = 0; c < chunks; ++c) {
    uint64_t w = raw.chunk_word(c);
    ASSERT_EQ(format::chunk_state(w), format::kChunkActive) << "chunk " << c;
    (format::chunk_ns(w) == ns_.id ? held_big : held_late)++;
  }
  EXPECT_EQ(held_big + held_late, chunks);
  EXPECT_LE(held_big, held_late + 2) << "the late namespace did not get a fair share";
  EXPECT_LE(held_late, held_big + 2);
  // Every READY block of both namespaces reads back its own bytes.
  uint64_t big = 0, small = 0;
  for (uint64_t s : raw.ready_slots()) {
    const auto* e = raw.entry(s);
    const bool is_big = e->ns_id == ns_.id;
    const NsHandle& ns = is_big ? ns_ : late;
    std::vector<char> out(ns.block_bytes);
    Piece p{out.data(), out.size()};
    uint64_t id = id_of(e->key);
    ASSERT_TRUE(pool_->get(ns, key_of(id), &p, 1, nullptr));
    ASSERT_EQ(out, payload(id, ns.block_bytes)) << (is_big ? "big " : "late ") << id;
    (is_big ? big : small)++;
  }
  EXPECT_EQ(big, held_big * ns_.geo.blocks);
  EXPECT_EQ(small, held_late * late.geo.blocks);
  expect_check_ok("after sharing");
}

// A chunk with a pinned block cannot be drained: the drain rolls back and leaves nothing fenced.
TEST_F(AllocatorTest, PinnedChunksAreNotDrained) {
  std::vector<Key> keys;
  for (uint64_t id = 0; id < total_blocks_; ++id) {
    ASSERT_TRUE(put_id(ns_, id, kBlock));
    keys.push_back(key_of(id));
  }
  auto pins = pool_->acquire(ns_, keys.data(), keys.size());
  ASSERT_EQ(pins.size(), total_blocks_);
  auto late = pool_->open_namespace(layout("late", 4 * KiB));
  EXPECT_FALSE(put_id(late, 1, 4 * KiB)) << "every chunk holds pinned blocks";
  {
    RawMap raw(path_);
    for (uint64_t c = 0; c < raw.hdr().chunk_count; ++c) {
      EXPECT_EQ(raw.chunk_word(c), format::make_chunk_word(format::kChunkActive, 0, ns_.id)) << "chunk " << c;
      for (uint32_t b = 0; b < ns_.geo.blocks; ++b)
        EXPECT_EQ(format::block_state(raw.block_desc(c, b)), format::kBlockUsed) << c << ":" << b;
    }
  }
  for (uint64_t id = 0; id < total_blocks_; ++id) ASSERT_TRUE(pool_->contains(ns_, keys[id])) << id;
  expect_check_ok("after failed drains");
  pool_->release(pins);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // past the allocator's steal back-off
  EXPECT_TRUE(put_id(late, 1, 4 * KiB));
  expect_check_ok("after release");
}

// A namespace that holds no chunk cannot evict its own blocks, so its put must try to drain a
// chunk every time, not only once the allocator's scan back-off (20 ms) has passed.
TEST_F(AllocatorTest, EmptyNamespaceRetriesStealRightAway) {
  std::vector<Key> keys;
  for (uint64_t id = 0; id < total_blocks_; ++id) {
    ASSERT_TRUE(put_id(ns_, id, kBlock));
    keys.push_back(key_of(id));
  }
  auto pins = pool_->acquire(ns_, keys.data(), keys.size());
  auto late = pool_->open_namespace(layout("late", 4 * KiB));
  EXPECT_FALSE(put_id(late, 1, 4 * KiB));  // every chunk pinned
  pool_->release(pins);
  EXPECT_TRUE(put_id(late, 1, 4 * KiB)) << "put failed although a chunk can now be drained";
  expect_check_ok("after release");
}

TEST_F(AllocatorTest, BlockThatDoesNotFitIsArgumentError) {
  const uint64_t chunk = pool_->header().chunk_bytes;
  EXPECT_THROW(pool_->open_namespace(layout("toobig", chunk + 1)), ArgumentError);
  EXPECT_THROW(pool_->open_namespace(layout("huge", 1ull << 31)), ArgumentError);
  EXPECT_THROW(pool_->open_namespace(layout("zero", 0)), ArgumentError);
  auto exact = pool_->open_namespace(layout("exact", chunk));
  EXPECT_EQ(exact.geo.blocks, 1u);
  ASSERT_TRUE(put_id(exact, 1, chunk));
  // A payload larger than the namespace block is refused too.
  auto v = payload(2, kBlock + 1);
  Piece p{v.data(), v.size()};
  EXPECT_THROW(pool_->put(ns_, key_of(2), &p, 1, 0), ArgumentError);
  expect_check_ok("after refusals");
}

// An index smaller than the probe window: puts evict within the window and accounting holds.
using SmallIndexTest = PoolTest;

TEST_F(SmallIndexTest, TinyIndexEvictsWithinProbeWindow) {
  auto pool = Pool::create(path_, opts(4 * MiB, 64 * KiB, 64), false);
  auto ns = pool->open_namespace(layout("tiny", 1024));
  std::vector<char> out(1024);
  for (uint64_t id = 0; id < 500; ++id) {
    auto v = payload(id, 1024);
    Piece p{v.data(), v.size()};
    ASSERT_TRUE(pool->put(ns, key_of(id), &p, 1, 0)) << id;
    Piece o{out.data(), out.size()};
    ASSERT_TRUE(pool->get(ns, key_of(id), &o, 1, nullptr)) << id;
    ASSERT_EQ(out, v);
  }
  auto r = pool->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
  EXPECT_LE(r.ready_blocks, 64u);
  EXPECT_EQ(r.capacity_blocks, r.free_blocks + r.ready_blocks);
  EXPECT_EQ(pool->occupancy().used, r.ready_blocks);
}

}  // namespace
}  // namespace cxlkv::test
