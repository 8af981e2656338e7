// SIGKILL chaos: children loop put/get/acquire/remove on a shared pool and are killed at random
// moments (attaching, writing, evicting, draining a chunk for a new namespace, holding pins...)
// and replaced. New namespaces appear as the run goes on, so chunks keep changing hands. Then the
// survivor reaps the dead: check() must be clean (nothing leaked, stuck or orphaned) and every
// READY key must read back its own bytes.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <set>

#include "mp_workload.h"

namespace cxlkv::test {
namespace {

using namespace mp;

// Child: puts and verified gets until killed, over namespaces [first, first + 2).
int chaos_worker(const std::string& path, uint64_t seed, int first) {
  try {
    auto pool = Pool::open(path);
    Ns nss[2] = {open_ns(*pool, spec(first)), open_ns(*pool, spec(first + 1))};
    std::mt19937_64 rng(seed);
    std::vector<char> buf, want;
    for (;;) {
      const Ns& ns = nss[rng() % 2];
      uint64_t id = rng() % kWorkingSet;
      bool hit = false;
      uint32_t op = uint32_t(rng() % 64);
      if (op < 16) {
        if (!get_and_verify(*pool, ns, id, buf, want, &hit)) return 1;
      } else if (op < 20) {
        Key keys[2] = {key_of(id), key_of((id + 1) % kWorkingSet)};
        auto pins = pool->acquire(ns.h, keys, 2);  // killed while holding pins, sometimes
        pool->release(pins);
      } else if (op < 22) {
        pool->remove(ns.h, key_of(id));
      } else {
        put_id(*pool, ns, id, want);
      }
    }
  } catch (...) {
    return 2;
  }
}

using ChaosTest = PoolTest;

TEST_F(ChaosTest, SigkillWorkersThenCheckClean) {
  constexpr int kTargetKills = 100, kWorkers = 2, kKillsPerPhase = 20;
  auto pool = create(opts(8 * MiB, 256 * KiB));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(8);
  std::mt19937_64 rng(::getpid());
  std::vector<pid_t> live;
  int kills = 0, bad_exits = 0;
  uint64_t seed = 1;
  std::vector<char> buf, want;
  while (kills < kTargetKills && std::chrono::steady_clock::now() < deadline) {
    const int phase = kills / kKillsPerPhase;  // namespaces [phase, phase + 2) are in use
    while (live.size() < kWorkers) {
      uint64_t s = seed++;
      live.push_back(spawn([&] { return chaos_worker(path_, s, phase); }));
    }
    // Let them run 1..40 ms; the parent reads and verifies meanwhile (it is a node too).
    Ns ns = open_ns(*pool, spec(phase));
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000 + rng() % 39000);
    while (std::chrono::steady_clock::now() < until) {
      bool hit = false;
      uint64_t id = rng() % kWorkingSet;
      if (!get_and_verify(*pool, ns, id, buf, want, &hit))
        ADD_FAILURE() << "parent read wrong bytes for " << id;
    }
    size_t victim = rng() % live.size();
    pid_t pid = live[victim];
    live.erase(live.begin() + long(victim));
    ::kill(pid, SIGKILL);
    int code = wait_exit(pid);  // reaped at once: a zombie would look alive
    if (code == 128 + SIGKILL)
      ++kills;
    else
      ++bad_exits;  // workers never exit on their own
  }
  for (pid_t pid : live) {
    ::kill(pid, SIGKILL);
    if (wait_exit(pid) != 128 + SIGKILL) ++bad_exits;
  }
  EXPECT_EQ(bad_exits, 0) << "a worker exited by itself: wrong bytes (1) or exception (2)";
  EXPECT_GE(kills, 20) << "too few kills in the time budget";
  const int nspecs = kills / kKillsPerPhase + 2;

  pool->reap_dead_nodes();
  auto r = pool->check();
  expect_clean(r);
  EXPECT_GT(r.ready_blocks, 0u);
  EXPECT_EQ(verify_ready_entries(*pool, path_, nspecs), r.ready_blocks);
  auto o = pool->occupancy();
  EXPECT_EQ(o.capacity, o.free + o.used);
  {
    RawMap raw(path_);
    std::set<uint32_t> owners;
    for (uint64_t c = 0; c < raw.hdr().chunk_count; ++c) owners.insert(format::chunk_ns(raw.chunk_word(c)));
    std::printf("chaos: %d kills, %d namespaces used, %zu own chunks now, %llu READY blocks\n", kills, nspecs,
                owners.size(), (unsigned long long)r.ready_blocks);
  }
  // The pool is still fully usable: a fresh process works on it, and it checks clean again.
  pid_t pid = spawn([&] { return random_worker(path_, 77, 5000, 0, 2); });
  EXPECT_EQ(wait_exit(pid), 0);
  expect_clean(pool->check());
  verify_ready_entries(*pool, path_, nspecs);
}

}  // namespace
}  // namespace cxlkv::test
