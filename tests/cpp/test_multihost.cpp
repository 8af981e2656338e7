// Multi-host CXL 2.0 mode (issue 9): the multihost backend on real memory, and the
// non-coherence emulator (src/sim) running the real pool code with several simulated hosts,
// random evictions, crashes and pauses past the lease. The negative controls prove the checker
// has teeth: each broken discipline must be caught.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "emu_cache.h"
#include "pool.h"
#include "sim.h"
#include "test_util.h"

using namespace cxlkv;
using namespace cxlkv::test;

namespace {

// Under AddressSanitizer the emulator runs several times slower: shorter runs keep the suite fast
// (fewer operations, the same checks).
#if defined(__SANITIZE_ADDRESS__)
constexpr double kTimeScale = 0.5;
#else
constexpr double kTimeScale = 1.0;
#endif

sim::SimResult run(int hosts, double seconds, uint64_t seed, const std::string& brk,
                   const std::string& backend = "multihost", const std::string& fault = "",
                   uint32_t lease_ms = 0) {
  sim::SimOptions o;
  if (lease_ms) o.lease_ms = lease_ms;
  o.fault = fault;
  o.hosts = hosts;
  o.seed = seed;
  // `seconds` of workload: SimOptions::seconds bounds the whole run, lease waits included.
  o.seconds = sim::reserved_seconds(o) + seconds * kTimeScale;
  o.brk = brk;
  o.backend = backend;
  auto r = sim::run_sim(o);
  std::printf("%s\n", r.to_json(o).c_str());
  return r;
}

// How many seeds of a broken discipline report violations, trying seeds 11, 12, ... until two did
// or eight were run. The simulated hosts are threads, so a seed fixes the workload, not the
// interleaving: on a loaded 2-core CI machine under ASan a short run can miss a race that a
// quiet run always shows (measured: the flush backend was caught in 1 of 3 seeds once in CI).
// Two catches are required; a discipline that is caught by no seed still fails, as it must.
int caught_in(const std::string& brk, const std::string& backend = "multihost", int hosts = 3,
              double seconds = 0.8) {
  int caught = 0;
  for (uint64_t seed = 11; seed < 19 && caught < 2; ++seed)
    caught += run(hosts, seconds, seed, brk, backend).violations() > 0;
  return caught;
}

}  // namespace

TEST(Emulator, CorrectProtocolHasNoViolations) {
  uint64_t crashes = 0, pauses = 0, verified = 0, heal_passes = 0;
  for (uint64_t seed : {1, 2, 3}) {
    auto r = run(3, 1.5, seed, "");
    EXPECT_EQ(r.violations(), 0u) << "seed " << seed << ": " << r.to_json(sim::SimOptions{});
    EXPECT_EQ(r.other_errors, 0u);
    crashes += r.crashes, pauses += r.pauses, verified += r.verified_reads, heal_passes += r.heal_passes;
  }
  // The faults really happened, reads were really checked, and the hosts healed their rows beside
  // their claims (each host's chores thread, stepped at its coherence points).
  EXPECT_GT(crashes, 0u);
  EXPECT_GT(pauses, 0u);
  EXPECT_GT(verified, 1000u);
  EXPECT_GT(heal_passes, 10u);
}

// --seconds bounds the whole run: a lease whose waits cannot fit is refused up front (it used to
// run for minutes: --seconds 4 --lease-ms 60000), and a run that fits ends by its bound.
TEST(Emulator, SecondsBoundTheWholeRun) {
  sim::SimOptions o;
  o.seconds = 4;
  o.lease_ms = 60000;
  try {
    sim::run_sim(o);
    FAIL() << "a 60 s lease in a 4 s run was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("give --seconds >= 181"), std::string::npos) << e.what();
  }
  o.lease_ms = 200;
  o.seconds = sim::min_seconds(o);
  EXPECT_GT(o.seconds, 0.5);
  EXPECT_NO_THROW(sim::run_sim(o));  // accepted at its minimum
}

TEST(Emulator, MoreHostsHaveNoViolations) {
  auto r = run(6, 1.5, 7, "");
  EXPECT_EQ(r.violations(), 0u);
}

// Negative controls: the same workload with one part of the discipline removed must fail.
TEST(Emulator, FlushesAsNoOpsAreCaught) { EXPECT_GE(caught_in("flush"), 2); }
TEST(Emulator, SkippedInvalidationsAreCaught) { EXPECT_GE(caught_in("invalidate"), 2); }
TEST(Emulator, DroppedLockFlushIsCaught) { EXPECT_GE(caught_in("lock"), 2); }
// Row healing that treats the ticket of a stripe its own attachment holds as nobody's (it ignores
// the process-local mutex another thread of the host holds) clears a live holder's row: only the
// healing rule stands between that and two hosts inside one stripe.
TEST(Emulator, HealingThatClearsAHoldersRowIsCaught) { EXPECT_GE(caught_in("heal"), 2); }
// The single-host `flush` backend (claim = CAS, correct only inside one coherence domain) is not
// multi-host safe: its CAS acts on the host's own cache.
// Its races need contention inside a few microseconds: more hosts, longer runs.
TEST(Emulator, FlushBackendIsNotMultiHostSafe) { EXPECT_GE(caught_in("", "flush", 4, 2.0), 2); }

class Multihost : public PoolTest {};

// A host crashes at each named fault point of insert, evict, alloc and the lock (its dirty lines
// written back or lost, line by line); the survivors reclaim it by lease, nothing is served torn or
// stale, no block is lost (the final `pool check`).
class FaultPoint : public ::testing::TestWithParam<const char*> {};
TEST_P(FaultPoint, CrashThereAndRecover) {
  auto r = run(2, 1.5, 21, "", "multihost", GetParam());
  // An incomplete final check is no verdict: the checker was starved past half a lease, fenced
  // itself, and its retry no longer fit the run's bound (seen once at load 30, a local CI run
  // beside five builds). Run once more with a 4x lease, which a starved checker outlasts.
  if (r.check_incomplete && r.violations() == 0)
    r = run(2, 1.5, 21, "", "multihost", GetParam(), 4 * sim::SimOptions{}.lease_ms);
  EXPECT_EQ(r.violations(), 0u);
  EXPECT_GE(r.fault_crashes, 1u) << "the fault point was never reached";
  EXPECT_FALSE(r.check_incomplete);
}
INSTANTIATE_TEST_SUITE_P(Emulator, FaultPoint,
                         ::testing::Values("insert.claimed", "insert.copied", "evict.claimed",
                                           "alloc.claimed", "alloc.carving", "lock.held"));

// A pool creator fenced at close (its heartbeat thread starved past half a lease on a loaded
// machine) leaves its node ALIVE in the image. The final checker must attach beside it and reclaim
// it by lease, never be refused its row: once, under ASan on a loaded machine, the checker got
// HostSlotBusyError for "node 1 of another host", the creator's node on the row it had shared with
// the checker. The workload is shorter than a lease, so no simulated host reaps that node first.
TEST(Emulator, FencedCreatorsNodeIsReclaimedByTheChecker) {
  sim::SimOptions o;
  o.hosts = 2;
  o.crashes = false;
  o.pauses = false;
  o.creator_fenced = true;
  for (uint32_t lease_ms : {o.lease_ms, 4 * o.lease_ms}) {  // a starved checker: as FaultPoint
    o.lease_ms = lease_ms;
    o.seconds = sim::min_seconds(o);
    auto r = sim::run_sim(o);
    std::printf("%s\n", r.to_json(o).c_str());
    if (r.check_incomplete && r.violations() == 0) continue;
    EXPECT_EQ(r.violations(), 0u);
    EXPECT_FALSE(r.check_incomplete);
    return;
  }
  ADD_FAILURE() << "the final check was incomplete with both leases";
}

// abandon() on a real attachment (a process that knows it was fenced; the sim's fenced creator):
// its admin responder thread stops before the Pool goes (under ASan a use-after-free of the Pool
// otherwise), and the node is left for a peer, which on this kernel reclaims it at once (its lock
// was dropped with the lock file).
TEST_F(Multihost, AbandonedRealAttachmentIsReclaimed) {
  CreateOptions c;
  c.size = 16ull << 20;
  c.backend = Backend::multihost;
  c.lock_hosts = 4;
  auto a = create(c);
  const uint32_t node = a->node_id();
  a->abandon();
  a.reset();
  auto b = Pool::open(path_, OpenOptions{});
  for (auto [id, pid] : b->attached_nodes()) EXPECT_NE(id, node) << "the abandoned node is still attached";
}

TEST_F(Multihost, RealMemoryPutGetAndSlots) {
  CreateOptions c;
  c.size = 16ull << 20;
  c.backend = Backend::multihost;
  c.lock_hosts = 4;
  ::setenv("CXLKV_HOST_SLOT", "0", 1);
  auto a = create(c);
  ::unsetenv("CXLKV_HOST_SLOT");
  EXPECT_EQ(a->backend(), Backend::multihost);
  EXPECT_EQ(a->header().lock_hosts, 4u);
  EXPECT_EQ(a->host_slot(), 0u);
  OpenOptions o;
  o.host_slot = 1;
  auto b = Pool::open(path_, o);
  o.host_slot = 0;
  {
    // Row 0 is this host's: another process or handle of it shares the row (tier 1)...
    auto same_host = Pool::open(path_, o);
    EXPECT_EQ(same_host->host_slot(), 0u);
    // ...but a second host on one row would be two coherence domains on one line: refused.
    std::string prev = std::getenv("CXLKV_HOST_ID") ? std::getenv("CXLKV_HOST_ID") : "";
    ::setenv("CXLKV_HOST_ID", "another-host", 1);
    EXPECT_THROW(Pool::open(path_, o), HostSlotBusyError);
    if (prev.empty())
      ::unsetenv("CXLKV_HOST_ID");
    else
      ::setenv("CXLKV_HOST_ID", prev.c_str(), 1);
  }
  o.host_slot = 4;
  EXPECT_THROW(Pool::open(path_, o), ArgumentError);
  Layout l;
  l.name = "mh";
  l.model_id = "m";
  l.block_bytes = 4096;
  auto na = a->open_namespace(l);
  auto nb = b->open_namespace(l);
  EXPECT_EQ(na.id, nb.id);
  std::vector<char> data(4096, 'x'), out(4096);
  Key k{};
  k[0] = 7;
  Piece src{data.data(), data.size()}, dst{out.data(), out.size()};
  EXPECT_TRUE(a->put(na, k, &src, 1, 0));
  uint64_t len = 0;
  EXPECT_TRUE(b->get(nb, k, &dst, 1, &len));
  EXPECT_EQ(len, 4096u);
  EXPECT_EQ(std::memcmp(data.data(), out.data(), 4096), 0);
  EXPECT_TRUE(b->remove(nb, k));
  EXPECT_FALSE(a->contains(na, k));
  EXPECT_TRUE(a->check().ok);
}

// An emulated host heals its own row as a real attachment's heartbeat thread does: a stray ticket
// written into its row in memory (node-less, so peers would honour it for a lease) is reset by the
// host's chores thread, stepped at the host's own coherence points, and a peer then claims that
// stripe at once. Without healing the peer would wait out the lease of standstill.
TEST_F(Multihost, EmulatedHostHealsAStrayTicketInItsRow) {
  CreateOptions c;
  c.size = 4ull << 20;
  c.backend = Backend::multihost;
  c.lock_hosts = 4;
  c.lease_ms = 2000;
  ::setenv("CXLKV_HOST_SLOT", "3", 1);
  format::PoolHeader hdr{};
  {
    auto p = create(c);
    hdr = p->header();
    p->close();
  }
  ::unsetenv("CXLKV_HOST_SLOT");
  std::vector<char> img(c.size);
  {
    FILE* f = std::fopen(path_.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fread(img.data(), 1, img.size(), f), img.size());
    std::fclose(f);
  }
  sim::Memory mem(std::move(img), hdr);
  sim::EmuConfig cfg;
  cfg.p_evict = 0;
  cfg.p_yield = 0;
  sim::EmuCache ca(mem, 0, 1, cfg), cb(mem, 1, 2, cfg);
  auto open = [&](sim::EmuCache& cache, int slot) {
    EmulatedHost eh;
    eh.base = cache.base();
    eh.size = mem.size();
    eh.model = &cache;
    eh.host_id = 0x1000 + uint64_t(slot) * 2 + 1;
    eh.host_slot = slot;
    return Pool::open_emulated(eh);
  };
  auto a = open(ca, 0);
  auto b = open(cb, 1);
  // The stray write: a node-less ticket in row 0 of every stripe, straight into memory.
  for (uint32_t k = 0; k < format::kLockStripes; ++k) {
    auto* l = reinterpret_cast<format::LockLine*>(mem.bytes() + format::kLockAreaOff) + (k * 4 + 0);
    l->choosing = 0, l->number = 7, l->node = 0, l->node_word = 0, l->waits += 1;
  }
  uint64_t healed = 0;
  ca.set_chores([&] { healed += a->heal_lock_row(); }, 1'000'000);
  // Host A's beats are its coherence points (no claim of its own, which would overwrite its row
  // too): they step its chores.
  for (int i = 0; i < 200 && healed < format::kLockStripes; ++i) {
    a->heartbeat_tick();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ca.set_chores(nullptr, 0);
  EXPECT_GT(ca.chore_runs(), 0u);
  EXPECT_GE(healed, uint64_t(format::kLockStripes));
  for (uint32_t k = 0; k < format::kLockStripes; ++k) {
    auto* l = reinterpret_cast<format::LockLine*>(mem.bytes() + format::kLockAreaOff) + (k * 4 + 0);
    EXPECT_EQ(l->number, 0u) << "stripe " << k;
  }
  // Host B's claims (a namespace and a put take several stripes) pass at once: far under the
  // lease of standstill a node-less stray ticket would cost them.
  const auto t0 = std::chrono::steady_clock::now();
  auto nb = b->open_namespace(layout("heal", 4096));
  std::vector<char> data(4096, 'h');
  Piece src{data.data(), data.size()};
  Key key{};
  key[1] = 1;
  EXPECT_TRUE(b->put(nb, key, &src, 1, 0));
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(waited, std::chrono::milliseconds(1000))
      << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() << " ms";
  EXPECT_EQ(mem.counters.lost_update.load() + mem.counters.invalidate_dirty.load() +
                mem.counters.lost_ticket.load(),
            0u);
  b->close();
  a->close();
}
