// One Pool shared by several threads of one process (the Python binding releases the GIL, so
// this is how it is used): random put/get/acquire/remove, every byte read verified.
#include <random>
#include <thread>

#include "test_util.h"

namespace cxlkv::test {
namespace {

using ThreadsTest = PoolTest;

TEST_F(ThreadsTest, ShareOnePool) {
  constexpr uint64_t kBlock = 4 * KiB, kIds = 3000;
  auto pool = Pool::create(path_, opts(8 * MiB, 256 * KiB), false);
  auto ns = pool->open_namespace(layout("thr", kBlock));
  ASSERT_LT(pool->header().chunk_count * ns.geo.blocks, kIds);  // the working set does not fit
  auto len_of = [](uint64_t id) { return kBlock - (id % 7) * 8; };
  std::atomic<uint64_t> bad{0}, hits{0};
  auto work = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<char> out(kBlock), want(kBlock);
    for (int i = 0; i < 15000; ++i) {
      uint64_t id = rng() % kIds;
      fill_payload(id, want.data(), len_of(id));
      uint32_t op = uint32_t(rng() % 10);
      if (op < 5) {
        Piece p{out.data(), out.size()};
        uint64_t len = 0;
        if (pool->get(ns, key_of(id), &p, 1, &len)) {
          ++hits;
          if (len != len_of(id) || std::memcmp(out.data(), want.data(), len) != 0) ++bad;
        }
      } else if (op < 9) {
        Piece p{want.data(), len_of(id)};
        pool->put(ns, key_of(id), &p, 1, 0);
      } else if (rng() % 2) {
        Key k = key_of(id);
        auto pins = pool->acquire(ns, &k, 1);
        if (!pins.empty() && !pool->contains(ns, k)) ++bad;
        pool->release(pins);
      } else {
        pool->remove(ns, key_of(id));
      }
    }
  };
  std::vector<std::thread> ts;
  for (uint64_t t = 0; t < 4; ++t) ts.emplace_back(work, 10 + t);
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(hits.load(), 0u);
  auto r = pool->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
  EXPECT_EQ(r.inflight_blocks + r.leaked_blocks + r.stuck_entries + r.orphan_pins, 0u);
  EXPECT_EQ(pool->counters()[format::kChecksumFailures], 0u);
}

}  // namespace
}  // namespace cxlkv::test
