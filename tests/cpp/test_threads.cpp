// One Pool shared by several threads of one process (the Python binding releases the GIL, so
// this is how it is used): random put/get/acquire/remove, every byte read verified.
#include <chrono>
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

// check() is meant to run while other nodes work: an eviction that completes between check()
// reading an entry and reading its block descriptor is not an inconsistency.
TEST_F(ThreadsTest, CheckDuringEvictionsReportsNoErrors) {
  auto pool = Pool::create(path_, opts(4 * MiB, 64 * KiB, 1024), false);
  auto ns = pool->open_namespace(layout("chk", 4 * KiB));
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::vector<char> v(4 * KiB);
    for (uint64_t id = 0; !stop.load(); ++id) {  // a full pool: every put evicts (block hand-off)
      fill_payload(id, v.data(), v.size());
      Piece p{v.data(), v.size()};
      pool->put(ns, key_of(id), &p, 1, 0);
    }
  });
  int checks = 0, failed = 0;
  std::string first;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < until) {
    auto r = pool->check();
    ++checks;
    if (!r.ok && failed++ == 0) first = join(r.errors);
  }
  stop = true;
  writer.join();
  EXPECT_EQ(failed, 0) << failed << " of " << checks << " checks reported errors, first:" << first;
  auto r = pool->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
}

// A pinned block stays readable: an evictor or remover that finds the pin puts the entry back, and
// a reader of the pinned key must not see a miss in between.
TEST_F(ThreadsTest, PinnedKeyNeverMisses) {
  auto pool = Pool::create(path_, opts(4 * MiB, 64 * KiB, 1024), false);
  auto ns = pool->open_namespace(layout("pin", 4096));
  const Key k = key_of(1);
  auto v = payload(1, 4096);
  Piece in{v.data(), v.size()};
  ASSERT_TRUE(pool->put(ns, k, &in, 1, 0));
  auto pins = pool->acquire(ns, &k, 1);
  ASSERT_EQ(pins.size(), 1u);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> removed{0}, attempts{0};
  std::thread remover([&] {
    while (!stop.load()) {
      removed += pool->remove(ns, k);
      ++attempts;
    }
  });
  uint64_t misses = 0, wrong = 0, absent = 0;
  std::vector<char> out(4096);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < until) {
    Piece p{out.data(), out.size()};
    if (!pool->get(ns, k, &p, 1, nullptr))
      ++misses;
    else if (out != v)
      ++wrong;
    if (!pool->contains(ns, k)) ++absent;
  }
  stop = true;
  remover.join();
  pool->release(pins);
  EXPECT_EQ(removed.load(), 0u) << "a pinned key was removed";
  EXPECT_EQ(wrong, 0u);
  EXPECT_EQ(misses, 0u) << "get() of a pinned key missed while remove() attempts (" << attempts.load()
                        << ") briefly held it EVICTING";
  EXPECT_EQ(absent, 0u) << "contains() of a pinned key said no";
  EXPECT_TRUE(pool->remove(ns, k));
}

}  // namespace
}  // namespace cxlkv::test
