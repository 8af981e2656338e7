// Copy path: the streaming-store kernel against memcpy for every small size and many
// misalignments, and the batched gather/scatter (store/load) over vLLM's paged KV layouts.
#include <numeric>
#include <thread>

#include "copy_kernels.h"
#include "cpu_features.h"
#include "test_util.h"

namespace cxlkv::test {
namespace {

TEST(StreamCopy, MatchesMemcpyForAllSizesAndAlignments) {
  constexpr size_t kMax = 4096, kGuard = 128;
  const size_t src_mis[] = {0, 1, 7, 16, 33, 63};
  const size_t dst_mis[] = {0, 1, 8, 31, 32, 63};
  std::vector<char> src(kMax + 2 * kGuard), dst(kMax + 2 * kGuard), pattern(kMax + 2 * kGuard, char(0xA5));
  uint64_t s = 42;
  for (auto& c : src) c = char(splitmix(s));
  // 64-byte aligned bases so the misalignments are what they say.
  auto align = [](char* p) {
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
  };
  std::vector<char> src_buf(src.size() + 64), dst_buf(dst.size() + 64);
  char* sb = align(src_buf.data());
  char* db = align(dst_buf.data());
  std::memcpy(sb, src.data(), src.size());
  SCOPED_TRACE(std::string("kernel ") + nt_copy_kernel_name());
  size_t failures = 0;
  for (size_t sm : src_mis) {
    for (size_t dm : dst_mis) {
      for (size_t n = 0; n <= kMax && failures < 10; ++n) {
        std::memset(db, 0xA5, kMax + 2 * kGuard);
        char* d = db + kGuard + dm;
        kernels::stream_copy(d, sb + sm, n);
        kernels::store_fence();
        bool ok = std::memcmp(d, sb + sm, n) == 0 && std::memcmp(db, pattern.data(), kGuard + dm) == 0 &&
                  std::memcmp(d + n, pattern.data(), kMax + 2 * kGuard - (kGuard + dm + n)) == 0;
        if (!ok) {
          ++failures;
          ADD_FAILURE() << "stream_copy n=" << n << " src+" << sm << " dst+" << dm;
        }
      }
    }
  }
  // Large, unaligned, with an odd tail.
  const size_t big = 3 * MiB + 77;
  std::vector<char> a(big + 64), b(big + 64, 0);
  for (auto& c : a) c = char(splitmix(s));
  kernels::stream_copy(b.data() + 5, a.data() + 3, big);
  kernels::store_fence();
  EXPECT_EQ(std::memcmp(b.data() + 5, a.data() + 3, big), 0);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(b[i], 0);
  for (size_t i = big + 5; i < b.size(); ++i) EXPECT_EQ(b[i], 0);
}

TEST(CacheLineKernels, WritebackAndEvictKeepContents) {
  std::vector<char> v(10000);
  uint64_t s = 9;
  for (auto& c : v) c = char(splitmix(s));
  std::vector<char> copy = v;
  kernels::writeback_lines(v.data() + 3, 9000);
  kernels::evict_lines(v.data() + 1, 9990);
  kernels::full_fence();
  EXPECT_EQ(v, copy);
}

// A paged KV cache in host memory, in vLLM's CUDA layout (per layer [2, num_blocks, F]: K and V
// fragment families) or its CPU layout (per layer [num_blocks, 2, F]: one family).
struct PagedKv {
  enum Kind { kCuda, kCpu };
  PagedKv(Kind k, uint32_t layers, uint64_t frag, uint64_t num_blocks)
      : kind(k),
        frag(frag),
        num_blocks(num_blocks),
        layer(layers, std::vector<char>(2 * num_blocks * frag, 0)) {}
  std::vector<Fragment> fragments() {
    std::vector<Fragment> f;
    for (auto& l : layer) {
      auto base = reinterpret_cast<uintptr_t>(l.data());
      if (kind == kCuda) {
        f.push_back({base, int64_t(frag), frag});                      // K[b]
        f.push_back({base + num_blocks * frag, int64_t(frag), frag});  // V[b]
      } else {
        f.push_back({base, int64_t(2 * frag), 2 * frag});  // [K|V][b]
      }
    }
    return f;
  }
  uint64_t block_bytes() const { return layer.size() * 2 * frag; }
  // The bytes of block b, in fragment order (the order they are stored in the pool block).
  std::vector<char> block(int64_t b) const {
    std::vector<char> out;
    for (const auto& l : layer) {
      if (kind == kCuda) {
        out.insert(out.end(), l.begin() + b * frag, l.begin() + (b + 1) * frag);
        out.insert(out.end(), l.begin() + (num_blocks + b) * frag, l.begin() + (num_blocks + b + 1) * frag);
      } else {
        out.insert(out.end(), l.begin() + b * 2 * frag, l.begin() + (b + 1) * 2 * frag);
      }
    }
    return out;
  }
  void randomize(uint64_t seed) {
    for (auto& l : layer) fill_payload(seed++, l.data(), l.size());
  }
  Kind kind;
  uint64_t frag, num_blocks;
  std::vector<std::vector<char>> layer;
};

class CopyEngineTest : public PoolTest, public ::testing::WithParamInterface<PagedKv::Kind> {
 protected:
  // 4 layers, 16 tokens x 2 heads x 64 dims x bf16 = 4 KiB per K or V fragment; 32 KiB blocks.
  static constexpr uint32_t kLayers = 4;
  static constexpr uint64_t kFrag = 16 * 2 * 64 * 2;
  static constexpr uint64_t kNumBlocks = 200;
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(16 * MiB, 1 * MiB));
    Layout l = layout("kv", kLayers * 2 * kFrag);
    l.kind = format::kLayoutDense;
    l.dtype = uint32_t(DType::bf16);
    l.num_layers = kLayers;
    l.num_kv_heads = 2;
    l.head_size = 64;
    l.tokens_per_block = 16;
    ns_ = pool_->open_namespace(l);
    Pool::set_copy_threads(2);
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  // Stores n blocks from src, loads them into a fresh cache at other block ids, compares.
  void round_trip(size_t n, uint64_t key_base) {
    PagedKv src(GetParam(), kLayers, kFrag, kNumBlocks), dst(GetParam(), kLayers, kFrag, kNumBlocks);
    ASSERT_EQ(src.block_bytes(), ns_.block_bytes);
    src.randomize(key_base);
    std::vector<Key> keys;
    std::vector<int64_t> src_ids, dst_ids;
    for (size_t i = 0; i < n; ++i) {
      keys.push_back(key_of(key_base + i));
      src_ids.push_back(int64_t((i * 7 + 3) % kNumBlocks));
      dst_ids.push_back(int64_t(kNumBlocks - 1 - (i * 13 + 1) % kNumBlocks));
    }
    ASSERT_EQ(pool_->store(ns_, keys.data(), n, src.fragments(), src_ids.data()), n);
    ASSERT_EQ(pool_->load(ns_, keys.data(), n, dst.fragments(), dst_ids.data()), n);
    std::vector<bool> loaded(kNumBlocks, false);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(dst.block(dst_ids[i]), src.block(src_ids[i])) << "key " << i;
      loaded[dst_ids[i]] = true;
    }
    std::vector<char> zero(ns_.block_bytes, 0);
    for (int64_t b = 0; b < int64_t(kNumBlocks); ++b)
      if (!loaded[b]) ASSERT_EQ(dst.block(b), zero) << "block " << b << " written but not loaded";
    // Each stored block is also a plain get of the concatenated fragments.
    std::vector<char> out(ns_.block_bytes);
    Piece p{out.data(), out.size()};
    ASSERT_TRUE(pool_->get(ns_, keys[n - 1], &p, 1, nullptr));
    EXPECT_EQ(out, src.block(src_ids[n - 1]));
  }

  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
};

TEST_P(CopyEngineTest, SmallBatch) { round_trip(5, 100); }

TEST_P(CopyEngineTest, LargeBatchTakesThreadedPath) {
  const size_t n = 160;  // 160 x 32 KiB = 5 MiB >= the 4 MiB threshold
  ASSERT_GE(n * ns_.block_bytes, 4 * MiB);
  round_trip(n, 5000);
  auto r = pool_->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
  EXPECT_EQ(r.ready_blocks, n);
}

// The copy threads are a persistent pool: many batches in a row, from two caller threads at once
// (one of them gets the pool, the other starts its own threads), with more parts than before.
TEST_P(CopyEngineTest, ThreadedBatchesRepeatFromTwoCallers) {
  Pool::set_copy_threads(3);
  const size_t n = 130;  // 130 x 32 KiB >= the 4 MiB threshold; two callers fit the 16 MiB pool
  ASSERT_GE(n * ns_.block_bytes, 4 * MiB);
  std::atomic<int> bad{0};
  auto caller = [&](uint64_t base) {
    PagedKv src(GetParam(), kLayers, kFrag, kNumBlocks), dst(GetParam(), kLayers, kFrag, kNumBlocks);
    std::vector<int64_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    for (uint64_t round = 0; round < 12; ++round) {
      src.randomize(base + round);
      std::vector<Key> keys;
      for (size_t i = 0; i < n; ++i) keys.push_back(key_of(base + round * 1000 + i));
      if (pool_->store(ns_, keys.data(), n, src.fragments(), ids.data()) != n) ++bad;
      if (pool_->load(ns_, keys.data(), n, dst.fragments(), ids.data()) != n) ++bad;
      for (size_t i = 0; i < n; ++i)
        if (dst.block(int64_t(i)) != src.block(int64_t(i))) ++bad;
      for (const Key& k : keys) pool_->remove(ns_, k);
    }
  };
  std::thread other(caller, 1'000'000);
  caller(2'000'000);
  other.join();
  EXPECT_EQ(bad.load(), 0);
  Pool::set_copy_threads(2);
}

TEST_P(CopyEngineTest, LoadStopsAtFirstMiss) {
  PagedKv src(GetParam(), kLayers, kFrag, kNumBlocks), dst(GetParam(), kLayers, kFrag, kNumBlocks);
  src.randomize(1);
  std::vector<Key> keys;
  std::vector<int64_t> ids;
  for (size_t i = 0; i < 10; ++i) keys.push_back(key_of(i)), ids.push_back(int64_t(i));
  ASSERT_EQ(pool_->store(ns_, keys.data(), 10, src.fragments(), ids.data()), 10u);
  ASSERT_TRUE(pool_->remove(ns_, keys[6]));
  EXPECT_EQ(pool_->load(ns_, keys.data(), 10, dst.fragments(), ids.data()), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(dst.block(int64_t(i)), src.block(int64_t(i)));
  // Storing again reports all present (write-once) and restores the gap.
  EXPECT_EQ(pool_->store(ns_, keys.data(), 10, src.fragments(), ids.data()), 10u);
  EXPECT_EQ(pool_->load(ns_, keys.data(), 10, dst.fragments(), ids.data()), 10u);
}

TEST_P(CopyEngineTest, FragmentsMustAddUpToBlockBytes) {
  PagedKv kv(GetParam(), kLayers, kFrag, kNumBlocks);
  Key k = key_of(1);
  int64_t id = 0;
  auto short_frags = kv.fragments();
  short_frags.back().bytes -= 64;
  EXPECT_THROW(pool_->store(ns_, &k, 1, short_frags, &id), ArgumentError);
  EXPECT_THROW(pool_->load(ns_, &k, 1, short_frags, &id), ArgumentError);
  auto long_frags = kv.fragments();
  long_frags.push_back({long_frags[0].base, 0, 64});
  EXPECT_THROW(pool_->store(ns_, &k, 1, long_frags, &id), ArgumentError);
  EXPECT_THROW(pool_->load(ns_, &k, 1, long_frags, &id), ArgumentError);
  EXPECT_THROW(pool_->store(ns_, &k, 1, {}, &id), ArgumentError);
  EXPECT_FALSE(pool_->contains(ns_, k));
}

INSTANTIATE_TEST_SUITE_P(Layouts, CopyEngineTest, ::testing::Values(PagedKv::kCuda, PagedKv::kCpu),
                         [](const auto& info) { return info.param == PagedKv::kCuda ? "Cuda" : "Cpu"; });

}  // namespace
}  // namespace cxlkv::test
