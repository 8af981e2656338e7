// multihost host slots shared by the processes of one host (arbiter.h tier 1, host_slot.cpp): real
// processes (fork) with one CXLKV_HOST_ID share a row of the lock area and hammer claims beside a
// process of another host; a tier-1 holder killed with SIGKILL, or stopped past its lease, while
// it holds the row (named fault point lock.held, through fault_trap::hook) does not stop the others,
// leaves no ticket behind, and the pool checks clean.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "mp_workload.h"

namespace cxlkv::test {
namespace {

using namespace mp;

// Sets an environment variable for the scope (children forked meanwhile inherit it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) had_ = true, old_ = v;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

int g_signal_fd = -1;  // the child's end of the pipe of the fault hook
int g_signal = 0;      // what the hook does after reporting: SIGKILL wait, or SIGSTOP itself

// At lock.held (the row and the stripe are ours), report once to the parent, then wait for the
// SIGKILL (pause) or stop ourselves (SIGSTOP: a holder that is only slow).
void hold_here(const char* point) {
  if (std::string(point) != "lock.held") return;
  fault_trap::hook.store(nullptr);
  char c = 'h';
  if (::write(g_signal_fd, &c, 1) != 1) ::_exit(9);
  if (g_signal == SIGSTOP) {
    ::raise(SIGSTOP);
    return;  // resumed: go on, and find ourselves fenced
  }
  for (;;) ::pause();
}

// Slot of a host id (the default a process of that host gets).
uint32_t slot_of(const char* host, uint32_t lock_hosts) {
  ScopedEnv e("CXLKV_HOST_ID", host);
  return uint32_t(liveness::host_id() % lock_hosts);
}

class HostSlotTest : public PoolTest {
 protected:
  std::unique_ptr<Pool> create_mh(uint32_t lease_ms) {
    CreateOptions c = opts(8 * MiB, 256 * KiB);
    c.backend = Backend::multihost;
    c.lock_hosts = 4;
    c.lease_ms = lease_ms;
    return create(c);
  }
  // Every ticket and tier-1 word of the lock area is free (nothing holds a stripe now).
  void expect_lock_area_free() {
    RawMap raw(path_);
    auto* lines = reinterpret_cast<const format::LockLine*>(raw.base() + format::kLockAreaOff);
    for (uint32_t i = 0; i < format::kLockStripes * raw.hdr().lock_hosts; ++i) {
      EXPECT_EQ(lines[i].number, 0u) << "stripe " << i / raw.hdr().lock_hosts << " row "
                                     << i % raw.hdr().lock_hosts;
      EXPECT_EQ(lines[i].tier1, 0u) << "stripe " << i / raw.hdr().lock_hosts << " row "
                                    << i % raw.hdr().lock_hosts;
    }
  }
};

// Host names whose default rows differ (a collision would be refused, as it must be).
constexpr const char* kHostA = "slot-test-a";
const char* host_b() {
  static std::string b = [] {
    for (int i = 0;; ++i) {
      std::string n = "slot-test-b" + std::to_string(i);
      if (slot_of(n.c_str(), 4) != slot_of(kHostA, 4)) return n;
    }
  }();
  return b.c_str();
}

TEST_F(HostSlotTest, HandlesOfOneHostShareItsSlotAndOtherHostsAreRefused) {
  ScopedEnv host("CXLKV_HOST_ID", kHostA);
  auto a = create_mh(format::kLeaseMsDefault);
  auto b = Pool::open(path_);  // a second handle of this process: same host, same row
  EXPECT_EQ(a->host_slot(), b->host_slot());
  EXPECT_EQ(a->host_slot(), slot_of(kHostA, 4));
  auto ns_a = a->open_namespace(layout("shared", 4096));
  auto ns_b = b->open_namespace(layout("shared", 4096));
  std::vector<char> data(4096), out(4096);
  for (uint64_t id = 0; id < 64; ++id) {
    fill_payload(id, data.data(), data.size(), 1);
    Piece src{data.data(), data.size()}, dst{out.data(), out.size()};
    ASSERT_TRUE((id % 2 ? a : b)->put(id % 2 ? ns_a : ns_b, key_of(id), &src, 1, 0));
    uint64_t len = 0;
    ASSERT_TRUE((id % 2 ? b : a)->get(id % 2 ? ns_b : ns_a, key_of(id), &dst, 1, &len));
    EXPECT_EQ(std::memcmp(data.data(), out.data(), 4096), 0);
  }
  {
    // Another host id on this row: two coherence domains would CAS one word. Refused.
    ScopedEnv other("CXLKV_HOST_ID", host_b());
    OpenOptions o;
    o.host_slot = int(a->host_slot());
    EXPECT_THROW(Pool::open(path_, o), HostSlotBusyError);
    // An observer of that host (an admin command) is never refused: while it only reads it takes
    // no row (and no node slot); once it must write it probes a free row instead of the
    // configured one.
    o.attach = false;
    auto obs = Pool::open(path_, o);
    EXPECT_FALSE(obs->holds_row());
    EXPECT_EQ(obs->node_id(), 0u);
    bool reclaimed = true;
    obs->reap_node(3, false, &reclaimed, 0);  // a FREE slot: still a write
    EXPECT_TRUE(obs->holds_row());
    EXPECT_NE(obs->host_slot(), a->host_slot());
    obs.reset();
    auto c = Pool::open(path_);  // its own default row is fine
    EXPECT_NE(c->host_slot(), a->host_slot());
  }
  auto r = a->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
  b.reset();
  a.reset();
  expect_lock_area_free();
}

// Three processes of host A (one row) and one of host B hammer claims: puts, evictions of a working
// set larger than the pool, removes, pins. Nobody reads wrong bytes; the pool checks clean.
TEST_F(HostSlotTest, ProcessesOfOneHostHammerClaimsOnOneRow) {
  ScopedEnv host("CXLKV_HOST_ID", kHostA);
  auto pool = create_mh(format::kLeaseMsDefault);
  std::vector<pid_t> kids;
  for (uint64_t i = 0; i < 3; ++i)
    kids.push_back(spawn([&] { return random_worker(path_, 7000 + i, 4000, 0, 2); }));
  kids.push_back(spawn([&] {
    ::setenv("CXLKV_HOST_ID", host_b(), 1);
    return random_worker(path_, 7100, 4000, 0, 2);
  }));
  for (pid_t pid : kids) EXPECT_EQ(wait_exit(pid), 0) << "1 = wrong bytes read, 2 = exception, >128 = signal";
  auto r = pool->check();
  expect_clean(r);
  EXPECT_EQ(verify_ready_entries(*pool, path_, 2), r.ready_blocks);
  pool.reset();
  expect_lock_area_free();
}

// Child of host A that opens the pool, then takes stripes until the hook stops it at lock.held.
int holder(const std::string& path, int fd, int sig) {
  try {
    auto pool = Pool::open(path);
    Ns ns = open_ns(*pool, spec(0));
    g_signal_fd = fd, g_signal = sig;
    fault_trap::hook.store(hold_here);
    std::vector<char> want;
    for (uint64_t id = 0; id < kWorkingSet; ++id) put_id(*pool, ns, id, want);
    return 7;  // never stopped at lock.held
  } catch (const FencedError&) {
    return 3;  // resumed after a lease: fenced, as it must be
  } catch (...) {
    return 2;
  }
}

// Child: the random workload, exit 0 only if this process took a tier-1 word over (want_takeover).
int worker(const std::string& path, uint64_t seed, int ops, bool want_takeover) {
  try {
    auto pool = Pool::open(path);
    std::vector<Ns> nss{open_ns(*pool, spec(0)), open_ns(*pool, spec(1))};
    std::mt19937_64 rng(seed);
    std::vector<char> buf, want;
    for (int i = 0; i < ops; ++i) {
      const Ns& ns = nss[rng() % 2];
      uint64_t id = rng() % kWorkingSet;
      bool hit = false;
      if (rng() % 4 == 0) {
        pool->remove(ns.h, key_of(id));
      } else {
        if (!get_and_verify(*pool, ns, id, buf, want, &hit)) return 1;
        if (!hit) put_id(*pool, ns, id, want);
      }
    }
    bool took = pool->bakery()->takeovers() > 0;
    pool->close();
    return want_takeover && !took ? 5 : 0;
  } catch (...) {
    return 2;
  }
}

// kill -9 of the tier-1 holder while it holds the row inside a claim: its host-mate and the other
// host go on; the dead holder's ticket is released (the reclaim by a host-mate, or a takeover).
TEST_F(HostSlotTest, KilledTier1HolderDoesNotBlockTheOthers) {
  ScopedEnv host("CXLKV_HOST_ID", kHostA);
  auto pool = create_mh(2000);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t h = spawn([&] { return holder(path_, fds[1], SIGKILL); });
  char c = 0;
  ASSERT_EQ(::read(fds[0], &c, 1), 1) << "the holder never reached lock.held";
  std::vector<pid_t> kids;
  kids.push_back(spawn([&] { return worker(path_, 8100, 3000, false); }));
  kids.push_back(spawn([&] {
    ::setenv("CXLKV_HOST_ID", host_b(), 1);
    return worker(path_, 8200, 3000, false);
  }));
  ::usleep(100'000);  // let them queue behind the held row
  ::kill(h, SIGKILL);
  EXPECT_EQ(wait_exit(h), 128 + SIGKILL);
  for (pid_t pid : kids) EXPECT_EQ(wait_exit(pid), 0) << "1 = wrong bytes, 2 = exception, >128 = signal";
  ::close(fds[0]), ::close(fds[1]);
  auto r = pool->check();  // reclaims the holder (same kernel: its lock is free)
  expect_clean(r);
  EXPECT_GE(r.reclaimed_nodes + pool->counters()[format::kReclaimedNodes], 1u);
  pool.reset();
  expect_lock_area_free();
}

// A holder stopped (SIGSTOP) at lock.held, alive by its kernel lock but silent: its host-mate takes
// the row over after a lease of silence. Resumed, the holder finds itself fenced, stores nothing
// and leaves the row alone; the pool checks clean.
TEST_F(HostSlotTest, StoppedTier1HolderIsTakenOverAndFenced) {
  ScopedEnv host("CXLKV_HOST_ID", kHostA);
  auto pool = create_mh(1000);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t h = spawn([&] { return holder(path_, fds[1], SIGSTOP); });
  char c = 0;
  ASSERT_EQ(::read(fds[0], &c, 1), 1) << "the holder never reached lock.held";
  int st = 0;
  ASSERT_EQ(::waitpid(h, &st, WUNTRACED), h);
  ASSERT_TRUE(WIFSTOPPED(st));
  pid_t w = spawn([&] { return worker(path_, 8300, 3000, true); });
  EXPECT_EQ(wait_exit(w), 0) << "1 = wrong bytes, 2 = exception, 5 = never took the row over";
  ::kill(h, SIGCONT);
  EXPECT_EQ(wait_exit(h), 3) << "the resumed holder must be fenced (3)";
  ::close(fds[0]), ::close(fds[1]);
  auto r = pool->check();
  expect_clean(r);
  pool.reset();
  expect_lock_area_free();
}

}  // namespace
}  // namespace cxlkv::test

namespace cxlkv::test {
namespace {

// A ticket that stood still for a lease with a silent holder is skipped; the same ticket, its
// holder still silent, is skipped again at once (no second lease: a dead host's ticket must not
// cost every later acquire a lease); once the holder beats again it is waited for again.
TEST(BakeryTickets, SkippedTicketIsSkippedAgainAtOnce) {
  constexpr uint32_t kHosts = 2;
  // aligned_alloc wants a multiple of the alignment (ASan refuses anything else)
  const size_t bytes =
      (format::kLockAreaOff + size_t(format::kLockStripes) * kHosts * 64 + 2 * 4096 - 1) / 4096 * 4096;
  std::unique_ptr<char, decltype(&std::free)> mem(static_cast<char*>(std::aligned_alloc(4096, bytes)),
                                                  &std::free);
  std::memset(mem.get(), 0, bytes);
  std::vector<format::NodeSlot> nodes(4);
  std::atomic<bool> fenced{false};
  std::atomic<uint64_t> beat{liveness::mono_ns()};
  int ticks = 0;
  Bakery::Config c;
  c.base = mem.get();
  c.hosts = kHosts;
  c.slot = 0;
  c.max_nodes = 4;
  c.nodes = nodes.data();
  c.lease_ns = 200'000'000;
  c.coh = Coherence(Backend::multihost);
  c.fenced = &fenced;
  c.last_beat = &beat;
  c.tick = [&] { ++ticks; };
  Bakery bk(std::move(c));
  // Row 1 holds a ticket in every stripe, for node 2 (attached on row 1), whose beat never
  // moves (a dead host not reclaimed yet).
  const uint64_t alive = format::make_node_word(format::kNodeAlive, 1, 1);
  nodes[1].state = alive, nodes[1].host_slot = 2;
  auto* lines = reinterpret_cast<format::LockLine*>(mem.get() + format::kLockAreaOff);
  for (uint32_t k = 0; k < format::kLockStripes; ++k)
    lines[k * kHosts + 1].number = 1, lines[k * kHosts + 1].node = 2, lines[k * kHosts + 1].node_word = alive;
  const char* word = mem.get() + bytes - 64;
  auto lock_once = [&] {
    beat.store(liveness::mono_ns());
    bk.lock(word);
    bk.unlock(word);
  };
  lock_once();  // waits a lease of silence, then skips
  EXPECT_EQ(bk.skipped(), 1u);
  EXPECT_GT(ticks, 0);
  ticks = 0;
  lock_once();  // the same ticket, the holder still silent: skipped without waiting
  EXPECT_EQ(bk.skipped(), 2u);
  EXPECT_EQ(ticks, 0);
  nodes[1].beat = 7;  // the holder shows life: its ticket is respected again for a lease
  lock_once();
  EXPECT_EQ(bk.skipped(), 3u);
  EXPECT_GT(ticks, 0);
}

// The lock area is untrusted input (issue 14): a ticket is honoured only when it names a node
// attached on that row with that word; any other is void at once, and a ticket that must be
// honoured but never moves fails the claim after Bakery::kWaitLeases leases.
struct BakeryRig {
  static constexpr uint32_t kHosts = 2;
  size_t bytes =
      (format::kLockAreaOff + size_t(format::kLockStripes) * kHosts * 64 + 2 * 4096 - 1) / 4096 * 4096;
  std::unique_ptr<char, decltype(&std::free)> mem{static_cast<char*>(std::aligned_alloc(4096, bytes)),
                                                  &std::free};
  std::vector<format::NodeSlot> nodes = std::vector<format::NodeSlot>(4);
  std::atomic<bool> fenced{false};
  std::atomic<uint64_t> beat{liveness::mono_ns()};
  std::unique_ptr<Bakery> bk;
  BakeryRig() {
    std::memset(mem.get(), 0, bytes);
    Bakery::Config c;
    c.base = mem.get();
    c.hosts = kHosts;
    c.slot = 0;
    c.max_nodes = 4;
    c.nodes = nodes.data();
    c.lease_ns = 50'000'000;
    c.coh = Coherence(Backend::multihost);
    c.fenced = &fenced;
    c.last_beat = &beat;
    c.pool = "pool rig";
    // Our own heartbeat, and node 2's (a live host on row 1), advance while we wait.
    c.tick = [this] {
      beat.store(liveness::mono_ns());
      ++nodes[1].beat;
    };
    bk = std::make_unique<Bakery>(std::move(c));
  }
  format::LockLine* line(uint32_t k, uint32_t row) {
    return reinterpret_cast<format::LockLine*>(mem.get() + format::kLockAreaOff) + (k * kHosts + row);
  }
  // Node 2: ALIVE on `row`; every stripe of row 1 holds a ticket naming it with its word.
  void ticket_of_live_node_on_row(uint32_t row) {
    const uint64_t alive = format::make_node_word(format::kNodeAlive, 1, 1);
    nodes[1].state = alive, nodes[1].host_slot = row + 1;
    for (uint32_t k = 0; k < format::kLockStripes; ++k)
      line(k, 1)->number = 1, line(k, 1)->node = 2, line(k, 1)->node_word = alive;
  }
  const char* word() const { return mem.get() + bytes - 64; }
};

TEST(BakeryTickets, TicketNamingALiveNodeOfAnotherRowIsVoidAtOnce) {
  BakeryRig rig;
  rig.ticket_of_live_node_on_row(0);  // node 2 lives on row 0, yet its "ticket" sits in row 1
  const uint64_t t0 = liveness::mono_ns();
  rig.bk->lock(rig.word());
  rig.bk->unlock(rig.word());
  EXPECT_EQ(rig.bk->voided(), 1u);
  EXPECT_EQ(rig.bk->skipped(), 0u);  // not by the lease rule: at once
  EXPECT_LT(liveness::mono_ns() - t0, 50'000'000u) << "a void ticket must not cost a lease";
}

TEST(BakeryTickets, HonouredTicketThatNeverMovesFailsTheClaimAfterTheBound) {
  BakeryRig rig;
  rig.ticket_of_live_node_on_row(1);  // could be its host's: honoured; its holder beats, never moves
  try {
    rig.bk->lock(rig.word());
    rig.bk->unlock(rig.word());
    FAIL() << "the claim waited past its bound without failing";
  } catch (const LockTimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("row 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("node 2"), std::string::npos) << e.what();
  }
  // The stripe was given back: a thread may lock it again once the ticket moves.
  for (uint32_t k = 0; k < format::kLockStripes; ++k) rig.line(k, 1)->number = 0;
  rig.bk->lock(rig.word());
  rig.bk->unlock(rig.word());
}

TEST(BakeryTickets, AWaitingHolderIsProgressNotABoundToGiveUpOn) {
  BakeryRig rig;
  rig.ticket_of_live_node_on_row(1);
  // The holder on row 1 waits itself (behind dead hosts): its line's `waits` advances. For 4
  // leases (past the bound of 3) we keep waiting; then it enters and leaves, and we go on.
  const uint64_t until = liveness::mono_ns() + 4 * 50'000'000ull;
  std::atomic<bool> stop{false};
  std::thread holder([&] {
    while (liveness::mono_ns() < until) {
      for (uint32_t k = 0; k < format::kLockStripes; ++k)
        std::atomic_ref<uint64_t>(rig.line(k, 1)->waits).fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    for (uint32_t k = 0; k < format::kLockStripes; ++k)
      std::atomic_ref<uint64_t>(rig.line(k, 1)->number).store(0);
  });
  EXPECT_NO_THROW({
    rig.bk->lock(rig.word());
    rig.bk->unlock(rig.word());
  });
  EXPECT_GE(liveness::mono_ns(), until);
  holder.join();
}

// Issue 23: a ticket that waiters must honour (a live node of its own row) whose `waits` is
// bumped forever (a forged pulse) reads as progress to the no-progress bound; the claim's
// absolute bound ends it: LockTimeoutError naming the stripe, the row and the ticket.
TEST(BakeryTickets, ForgedPulseCannotHoldAClaimPastItsAbsoluteBound) {
  BakeryRig rig;
  rig.ticket_of_live_node_on_row(1);
  std::atomic<bool> stop{false};
  std::thread forger([&] {
    while (!stop) {
      for (uint32_t k = 0; k < format::kLockStripes; ++k)
        std::atomic_ref<uint64_t>(rig.line(k, 1)->waits).fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  const uint64_t t0 = liveness::mono_ns();
  std::string what;
  try {
    rig.bk->lock(rig.word());
    rig.bk->unlock(rig.word());
  } catch (const LockTimeoutError& e) {
    what = e.what();
  }
  const uint64_t waited = liveness::mono_ns() - t0;
  stop = true;
  forger.join();
  ASSERT_FALSE(what.empty()) << "a forged pulse kept the claim from its bound";
  EXPECT_NE(what.find("row 1"), std::string::npos) << what;
  EXPECT_NE(what.find("leases in all"), std::string::npos) << what;
  EXPECT_GE(waited, Bakery::kClaimLeases * 50'000'000ull);
  EXPECT_LT(waited, (Bakery::kClaimLeases + 4) * 50'000'000ull) << "the bound must hold, not drift";
}

// Issue 23: a holder that waits in tier 2 rewrites its whole ticket with each progress write, so
// a ticket someone else wrote into its line (here: "not competing", which would let a host behind
// it in; or any number another host would honour) lives one progress write at most.
TEST(BakeryTickets, AWaitingHolderRewritesItsWholeTicket) {
  BakeryRig rig;
  rig.ticket_of_live_node_on_row(1);  // node 2 on row 1 holds number 1 and waits (its waits move)
  const uint32_t k = rig.bk->stripe_of(rig.word());
  std::atomic<bool> release{false};
  std::thread holder([&] {
    while (!release) {
      std::atomic_ref<uint64_t>(rig.line(k, 1)->waits).fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::atomic_ref<uint64_t>(rig.line(k, 1)->number).store(0);
  });
  std::thread waiter([&] {
    rig.bk->lock(rig.word());
    rig.bk->unlock(rig.word());
  });
  auto number = [&] { return std::atomic_ref<uint64_t>(rig.line(k, 0)->number).load(); };
  while (number() == 0) std::this_thread::yield();  // our ticket is out: 2, behind row 1's 1
  const uint64_t ours = number();
  EXPECT_EQ(ours, 2u);
  std::atomic_ref<uint64_t>(rig.line(k, 0)->number).store(0);  // the forger's write
  std::atomic_ref<uint64_t>(rig.line(k, 0)->node).store(3);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // several progress writes (lease/16)
  EXPECT_EQ(number(), ours) << "the waiting holder's ticket was not rewritten";
  EXPECT_EQ(std::atomic_ref<uint64_t>(rig.line(k, 0)->node).load(), 0u);  // ours: node-less
  release = true;
  holder.join();
  waiter.join();
}

// Issue 23: a tier-1 word in our row naming a live node of our row with the wrong epoch (a forged
// word, written once) is stale: taken over after one lease of standstill, although the named
// node beats all along; the claim then goes on. One naming a live node of another row is foreign:
// taken over at once. Either way the word's ticket is reset with it.
TEST(BakeryTickets, ForgedTier1WordsAreVoid) {
  BakeryRig rig;
  const uint64_t alive = format::make_node_word(format::kNodeAlive, 1, 1);
  rig.nodes[1].state = alive, rig.nodes[1].host_slot = 1;  // node 2 lives on our row 0
  const uint32_t k = rig.bk->stripe_of(rig.word());
  rig.line(k, 0)->tier1 = format::make_tier1_word(0, 2, 7);  // epoch 7: not node 2's
  EXPECT_EQ(rig.bk->classify_tier1(rig.line(k, 0)->tier1, 0), Bakery::Tier1Kind::stale);
  uint64_t t0 = liveness::mono_ns();
  rig.bk->lock(rig.word());
  rig.bk->unlock(rig.word());
  uint64_t waited = liveness::mono_ns() - t0;
  EXPECT_GE(waited, 50'000'000u);
  EXPECT_LT(waited, Bakery::kWaitLeases * 50'000'000ull) << "a stale word costs one lease, not the bound";
  EXPECT_EQ(rig.bk->takeovers(), 1u);
  EXPECT_EQ(rig.line(k, 0)->tier1, 0u);

  rig.nodes[1].host_slot = 2;  // node 2 now lives on row 1: a word of it in row 0 is nobody's
  rig.line(k, 0)->tier1 = format::make_tier1_word(0, 2, 1);
  EXPECT_EQ(rig.bk->classify_tier1(rig.line(k, 0)->tier1, 0), Bakery::Tier1Kind::foreign);
  t0 = liveness::mono_ns();
  rig.bk->lock(rig.word());
  rig.bk->unlock(rig.word());
  EXPECT_LT(liveness::mono_ns() - t0, 50'000'000u) << "a foreign word must not cost a lease";
  EXPECT_EQ(rig.bk->takeovers(), 2u);
}

// The heartbeat's row healing clears a stale word written once, without any claim.
TEST(BakeryTickets, RowHealingClearsAStaleTier1WordAfterALease) {
  BakeryRig rig;
  const uint64_t alive = format::make_node_word(format::kNodeAlive, 1, 1);
  rig.nodes[1].state = alive, rig.nodes[1].host_slot = 1;
  for (uint32_t k = 0; k < format::kLockStripes; ++k) {
    rig.line(k, 0)->tier1 = format::make_tier1_word(3, 2, 9);
    rig.line(k, 0)->number = 5;
  }
  EXPECT_EQ(rig.bk->heal_own_row(), 0u);  // first look: not yet a lease
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  rig.beat.store(liveness::mono_ns());
  EXPECT_EQ(rig.bk->heal_own_row(), format::kLockStripes);
  for (uint32_t k = 0; k < format::kLockStripes; ++k) {
    EXPECT_EQ(rig.line(k, 0)->tier1, 0u) << k;
    EXPECT_EQ(rig.line(k, 0)->number, 0u) << k;
  }
}

// Found by the issue-14 review: a node-less tier-1 holder (an attach in progress) that waits in
// tier 2 for more than a lease behind a live waiter of another host was taken over by its
// host-mate, whose silence rule ignored the row's `waits` (the node-less holder's pulse): both
// entered the stripe. Two attachments of one host (one node-less), one stripe, one other host
// whose live node-less waiter holds a ticket for 1.6 leases.
TEST(BakeryTickets, WaitingNodelessTier1HolderIsNotTakenOver) {
  constexpr uint64_t kLease = 200'000'000;
  constexpr uint32_t kHosts = 4, kRowA = 1, kRowJ = 3;
  const size_t bytes = 1 << 16;
  std::unique_ptr<char, decltype(&std::free)> mem(static_cast<char*>(std::aligned_alloc(4096, bytes)),
                                                  &std::free);
  char* base = mem.get();
  std::memset(base, 0, bytes);
  auto* nodes = reinterpret_cast<format::NodeSlot*>(base + 16384);
  const uint64_t mword = format::make_node_word(format::kNodeAlive, 7, 5);
  nodes[1].state = mword, nodes[1].host_slot = kRowA + 1, nodes[1].host_id = 42, nodes[1].flags = 1;
  std::atomic<bool> fenced_h{false}, fenced_m{false};
  std::atomic<uint64_t> beat_h{liveness::mono_ns()}, beat_m{liveness::mono_ns()};
  auto config = [&](std::atomic<bool>* f, std::atomic<uint64_t>* lb) {
    Bakery::Config c;
    c.base = base, c.hosts = kHosts, c.slot = kRowA, c.max_nodes = 4, c.nodes = nodes;
    c.lease_ns = kLease, c.coh = Coherence(Backend::multihost), c.fenced = f, c.last_beat = lb;
    c.pool = "pool test", c.host_id = 42, c.pool_bytes = bytes;
    return c;
  };
  Bakery h(config(&fenced_h, &beat_h));  // attach in progress: no node
  Bakery m(config(&fenced_m, &beat_m));
  m.set_node(2, mword);
  const char* addr = base + 32768;
  std::atomic<bool> stop{false};
  std::thread heartbeat([&] {  // m's heartbeat
    while (!stop) {
      std::atomic_ref<uint64_t>(nodes[1].beat).fetch_add(1);
      beat_m.store(liveness::mono_ns());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  const uint32_t k = h.stripe_of(addr);
  auto* lj =
      reinterpret_cast<format::LockLine*>(base + format::kLockAreaOff) + (uint64_t(k) * kHosts + kRowJ);
  lj->number = 1, lj->waits = 1;
  const uint64_t t0 = liveness::mono_ns();
  std::thread host_j([&] {  // a live node-less waiter of host J: its waits advance
    while (liveness::mono_ns() - t0 < kLease * 16 / 10) {
      std::atomic_ref<uint64_t>(lj->waits).fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::atomic_ref<uint64_t>(lj->number).store(0);
    std::atomic_ref<uint64_t>(lj->waits).fetch_add(1);
  });
  std::atomic<int> inside{0}, most{0};
  auto critical = [&](Bakery& b, uint64_t delay_ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    b.lock(addr);
    const int n = ++inside;
    for (int seen = most.load(); n > seen && !most.compare_exchange_weak(seen, n);) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    --inside;
    b.unlock(addr);
  };
  std::thread th([&] { critical(h, 10); });
  std::thread tm([&] { critical(m, 20); });
  th.join(), tm.join(), host_j.join();
  stop = true;
  heartbeat.join();
  EXPECT_EQ(most.load(), 1) << "two processes of one host inside one stripe";
  EXPECT_EQ(h.takeovers() + m.takeovers(), 0u);
}

}  // namespace
}  // namespace cxlkv::test
