// Recovery from dead nodes, deterministically: a real child process attaches (and pins, or is made
// to look half-way through a put, an eviction, a chunk carve or drain, a namespace creation), is killed
// with SIGKILL, and the survivors must reclaim everything it held.
//
// The half-way states are written into the pool with a raw mapping, exactly as format.h says a
// node leaves them between two steps; the child's node slot is real, so liveness is judged on a
// real (then dead) pid.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "test_util.h"

namespace cxlkv::test {
namespace {

using namespace format;

constexpr uint64_t kBlock = 16 * KiB;

struct Held {
  pid_t pid;
  uint32_t node;
  uint32_t pinned;
};

// Child: attaches, pins `keys` (if any), reports (node id, pins held) on the pipe, waits to die.
Held hold_node(const std::string& path, const std::vector<Key>& keys) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe");
  pid_t pid = spawn([&] {
    try {
      ::close(fds[0]);
      auto pool = Pool::open(path);
      uint32_t msg[2] = {pool->node_id(), 0};
      if (!keys.empty()) {
        auto ns = pool->open_namespace(layout("rec", kBlock));
        msg[1] = uint32_t(pool->acquire(ns, keys.data(), keys.size()).size());
      }
      if (::write(fds[1], msg, sizeof msg) != sizeof msg) return 3;
      for (;;) ::pause();
    } catch (...) {
      return 2;
    }
  });
  ::close(fds[1]);
  uint32_t msg[2] = {0, 0};
  ssize_t got = ::read(fds[0], msg, sizeof msg);
  ::close(fds[0]);
  if (got != sizeof msg) throw std::runtime_error("child did not report");
  return {pid, msg[0], msg[1]};
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

class RecoveryTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(4 * MiB, 64 * KiB, 1024));
    ns_ = pool_->open_namespace(layout("rec", kBlock));
    cap_ = pool_->header().chunk_count * ns_.geo.blocks;
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  bool put_id(uint64_t id) {
    auto v = payload(id, kBlock);
    Piece p{v.data(), v.size()};
    return pool_->put(ns_, key_of(id), &p, 1, 0);
  }
  bool get_ok(uint64_t id) {
    std::vector<char> out(kBlock);
    Piece p{out.data(), out.size()};
    return pool_->get(ns_, key_of(id), &p, 1, nullptr) && out == payload(id, kBlock);
  }
  void expect_clean(const CheckReport& r) {
    EXPECT_TRUE(r.ok) << join(r.errors);
    EXPECT_EQ(r.leaked_blocks, 0u);
    EXPECT_EQ(r.stuck_entries, 0u);
    EXPECT_EQ(r.orphan_pins, 0u);
    EXPECT_EQ(r.inflight_blocks, 0u);
    EXPECT_EQ(r.capacity_blocks, r.free_blocks + r.ready_blocks);
  }
  uint64_t slot_of(RawMap& raw, uint64_t id) {
    for (uint64_t s : raw.ready_slots())
      if (std::memcmp(raw.entry(s)->key, key_of(id).data(), 32) == 0) return s;
    return ~0ull;
  }

  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
  uint64_t cap_ = 0;
};

TEST_F(RecoveryTest, PinsOfADeadNodeAreReleased) {
  std::vector<Key> keys;
  for (uint64_t id = 0; id < cap_; ++id) {
    ASSERT_TRUE(put_id(id));
    keys.push_back(key_of(id));
  }
  Held h = hold_node(path_, keys);
  ASSERT_EQ(h.pinned, cap_);
  EXPECT_FALSE(put_id(cap_)) << "every block is pinned by a live node";
  EXPECT_FALSE(pool_->remove(ns_, keys[0]));
  kill_and_reap(h.pid);
  // Recovery happens from the allocation path (throttled to one reap per 100 ms).
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_TRUE(put_id(cap_)) << "the put that finds a dead pin holder should reclaim it and evict";
  EXPECT_TRUE(put_id(cap_ + 1));
  EXPECT_TRUE(get_ok(cap_ + 1));
  auto r = pool_->check();
  expect_clean(r);
  EXPECT_EQ(r.ready_blocks, cap_);
}

TEST_F(RecoveryTest, ReapReleasesPinsExplicitly) {
  std::vector<Key> keys;
  for (uint64_t id = 0; id < 8; ++id) {
    ASSERT_TRUE(put_id(id));
    keys.push_back(key_of(id));
  }
  Held h = hold_node(path_, keys);
  ASSERT_EQ(h.pinned, 8u);
  EXPECT_FALSE(pool_->remove(ns_, keys[3]));
  EXPECT_EQ(pool_->reap_dead_nodes(), 0u);  // alive: nothing to reap
  kill_and_reap(h.pid);
  EXPECT_EQ(pool_->reap_dead_nodes(), 1u);
  EXPECT_TRUE(pool_->remove(ns_, keys[3]));
  expect_clean(pool_->check());
}

TEST_F(RecoveryTest, HalfDoneOperationsOfADeadNodeAreUndone) {
  for (uint64_t id = 0; id < 10; ++id) ASSERT_TRUE(put_id(id));  // 3 chunks: 4 + 4 + 2 used
  Held h = hold_node(path_, {});
  const uint8_t n = uint8_t(h.node);
  {
    RawMap raw(path_);
    const auto& hd = raw.hdr();
    // (1) Killed inside put after claiming a block, before writing the entry's block reference:
    //     an index slot WRITING(n) whose chunk/block are stale, a block desc USED(n, slot).
    uint64_t s1 = raw.slots_in_state(kEmpty).at(7);
    uint64_t c = ~0ull;
    uint32_t b = 0;
    for (uint64_t ch = 0; ch < hd.chunk_count && c == ~0ull; ++ch) {
      if (chunk_state(raw.chunk_word(ch)) != kChunkActive) continue;
      for (uint32_t k = 0; k < ns_.geo.blocks; ++k)
        if (raw.block_desc(ch, k) == 0) {
          c = ch, b = k;
          break;
        }
    }
    ASSERT_NE(c, ~0ull);
    const auto* slots = reinterpret_cast<const NodeSlot*>(raw.base() + hd.node_table_off);
    const uint8_t epoch8 = uint8_t(node_epoch(slots[n - 1].state));
    reinterpret_cast<uint64_t*>(raw.base() + hd.arena_off + c * raw.chunk_stride())[b] =
        make_block_word(kBlockUsed, n, epoch8, s1);
    auto* e1 = raw.entry(s1);
    e1->chunk = 0, e1->block = 0;  // stale: another entry's block
    e1->state = make_entry_word(kWriting, n, 1, 0x123456);
    // (2) Killed inside an eviction: a READY entry now EVICTING(n).
    uint64_t s2 = slot_of(raw, 3);
    ASSERT_NE(s2, ~0ull);
    uint64_t w = raw.entry(s2)->state;
    raw.entry(s2)->state = make_entry_word(kEvicting, n, entry_gen(w), entry_tag(w));
    // (3) Killed while carving a chunk.
    uint64_t c2 = ~0ull;
    for (uint64_t ch = 0; ch < hd.chunk_count && c2 == ~0ull; ++ch)
      if (raw.chunk_word(ch) == 0) c2 = ch;
    ASSERT_NE(c2, ~0ull);
    reinterpret_cast<uint64_t*>(raw.base() + hd.chunk_map_off)[c2] =
        make_chunk_word(kChunkCarving, n, ns_.id);
    // (4) Killed while holding a pin on key 5.
    uint64_t s5 = slot_of(raw, 5);
    char* area = raw.base() + hd.node_area_off + uint64_t(n - 1) * hd.node_area_bytes;
    auto* fx = reinterpret_cast<NodeAreaFixed*>(area);
    reinterpret_cast<uint64_t*>(area + sizeof(NodeAreaFixed))[0] =
        pin_value(s5, entry_gen(raw.entry(s5)->state));
    fx->pin_hw = 1;
    // (5) Killed while draining the chunk of key 6 for another namespace: it had evicted key 6
    //     (entry tombstoned, desc FENCED(n)) and not yet reached the chunk's other blocks.
    uint64_t s6 = slot_of(raw, 6);
    ASSERT_NE(s6, ~0ull);
    const uint64_t c6 = raw.entry(s6)->chunk;
    const uint32_t b6 = raw.entry(s6)->block;
    w = raw.entry(s6)->state;
    raw.entry(s6)->state = make_entry_word(kTombstone, 0, entry_gen(w), entry_tag(w));
    reinterpret_cast<uint64_t*>(raw.base() + hd.arena_off + c6 * raw.chunk_stride())[b6] =
        make_block_word(kBlockFenced, n, epoch8, 0);
    reinterpret_cast<uint64_t*>(raw.base() + hd.chunk_map_off)[c6] =
        make_chunk_word(kChunkDraining, n, ns_.id);
  }
  // While the node lives, all this is legitimately in flight.
  auto live = pool_->check();
  EXPECT_TRUE(live.ok) << join(live.errors);
  EXPECT_FALSE(pool_->remove(ns_, key_of(5))) << "pinned by the (live) node";

  kill_and_reap(h.pid);
  EXPECT_EQ(pool_->reap_dead_nodes(), 1u);
  auto r = pool_->check();
  expect_clean(r);
  EXPECT_EQ(r.ready_blocks, 8u);
  EXPECT_FALSE(pool_->contains(ns_, key_of(3)));  // its eviction was completed
  EXPECT_FALSE(pool_->contains(ns_, key_of(6)));  // evicted by the drainer
  for (uint64_t id = 0; id < 10; ++id)
    if (id != 3 && id != 6) EXPECT_TRUE(get_ok(id)) << id;
  EXPECT_TRUE(pool_->remove(ns_, key_of(5)));  // the dead node's pin is gone
  auto o = pool_->occupancy();
  EXPECT_EQ(o.active_chunks, 3u);  // the half-carved chunk went back to FREE, the drained one ACTIVE
  EXPECT_EQ(o.used, 7u);
  EXPECT_EQ(o.capacity, o.free + o.used);
  {  // Nothing stays fenced or carving.
    RawMap raw(path_);
    for (uint64_t ch = 0; ch < raw.hdr().chunk_count; ++ch) {
      uint8_t st = chunk_state(raw.chunk_word(ch));
      EXPECT_TRUE(st == kChunkFree || st == kChunkActive) << "chunk " << ch;
      if (st != kChunkActive) continue;
      for (uint32_t k = 0; k < ns_.geo.blocks; ++k)
        EXPECT_NE(block_state(raw.block_desc(ch, k)), kBlockFenced) << "block " << ch << ":" << k;
    }
  }
  for (uint64_t id = 100; id < 100 + cap_; ++id) ASSERT_TRUE(put_id(id));
  expect_clean(pool_->check());
}

// A node killed inside an eviction, after its claim (EVICTING under its id), leaves the entry to
// its reclaimer. `n`: the dead node's id; `id`: the key it was evicting.
void evicting_by(const std::string& path, uint64_t slot, uint8_t n) {
  RawMap raw(path);
  uint64_t w = raw.entry(slot)->state;
  raw.entry(slot)->state =
      format::make_entry_word(format::kEvicting, n, format::entry_gen(w), format::entry_tag(w));
}

int g_release_fd = -1;  // the reclaimer child's end of the pipe of its fault hook

// At release.claimed (the reclaimer holds the abandoned entry), report to the parent, then wait
// for the SIGKILL: the reclaimer dies between its claim and the block's release.
void die_inside_release(const char* point) {
  if (std::string(point) != "release.claimed") return;
  fault_trap::hook.store(nullptr);
  char c = 'r';
  if (::write(g_release_fd, &c, 1) != 1) ::_exit(9);
  for (;;) ::pause();
}

// The reclaimer of an evictor killed mid-eviction is itself killed mid-release, while the block's
// writer lives; then the writer closes cleanly. The block must still come back: before, the
// release tombstoned the entry first and freed the block second, so dying in between left a USED
// block that no entry pointed to and whose writer (alive, then closed cleanly) no reclaim ever
// visited. It was seen once as "block ... is leaked" in the emulator (Emulator.MoreHostsHaveNoViolations).
TEST_F(RecoveryTest, ReclaimerKilledInsideAReleaseLeaksNoBlock) {
  for (uint64_t id = 0; id < 4; ++id) ASSERT_TRUE(put_id(id));
  Held d = hold_node(path_, {});
  uint64_t s1 = ~0ull;
  {
    RawMap raw(path_);
    s1 = slot_of(raw, 1);
  }
  ASSERT_NE(s1, ~0ull);
  evicting_by(path_, s1, uint8_t(d.node));
  kill_and_reap(d.pid);

  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const uint32_t dead = d.node;
  pid_t r = spawn([&] {
    try {
      ::close(fds[0]);
      g_release_fd = fds[1];
      fault_trap::hook.store(die_inside_release);  // before open: its reap at attach may be the one
      auto pool = Pool::open(path_);
      bool reclaimed = false;
      pool->reap_node(dead, false, &reclaimed);
      return 7;  // never reached release.claimed
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reclaimer: %s\n", e.what());
      return 2;
    }
  });
  ::close(fds[1]);
  char c = 0;
  if (::read(fds[0], &c, 1) != 1) {
    int st = 0;
    ::waitpid(r, &st, 0);
    FAIL() << "the reclaimer never reached release.claimed (wait status " << st << ")";
  }
  ::close(fds[0]);
  kill_and_reap(r);
  {
    RawMap raw(path_);
    const uint64_t w = raw.entry(s1)->state;
    EXPECT_EQ(format::entry_state(w), format::kEvicting) << "held, under the reclaimed node's id";
    EXPECT_EQ(format::entry_node(w), d.node);
    const auto* slots = reinterpret_cast<const NodeSlot*>(raw.base() + raw.hdr().node_table_off);
    EXPECT_EQ(format::node_state(slots[d.node - 1].state), format::kNodeReclaiming);
  }
  // The block's writer closes cleanly (no reclaim of it will ever run); the next open reclaims
  // the evictor again (its slot still RECLAIMING, its reclaimer's lock gone).
  pool_.reset();
  pool_ = Pool::open(path_);
  ns_ = pool_->open_namespace(layout("rec", kBlock));
  auto rep = pool_->check();
  expect_clean(rep);
  EXPECT_EQ(rep.ready_blocks, 3u);
  EXPECT_FALSE(pool_->contains(ns_, key_of(1)));
  for (uint64_t id : {0, 2, 3}) EXPECT_TRUE(get_ok(id)) << id;
}

// An evictor killed after its claim but before its pin check: a reader that pinned the READY
// entry before the claim may still be reading the block. The reclaimer sees the pin and condemns
// the entry (gone from the index) instead of freeing the block under the reader; the block comes
// back once the pin is released.
TEST_F(RecoveryTest, BlockOfAPinnedEntryADeadEvictorHeldIsNotFreedUnderTheReader) {
  for (uint64_t id = 0; id < 4; ++id) ASSERT_TRUE(put_id(id));
  const Key k2 = key_of(2);
  auto lease = pool_->acquire(ns_, &k2, 1);
  ASSERT_EQ(lease.size(), 1u);
  Held d = hold_node(path_, {});
  uint64_t s2 = ~0ull, c2 = 0;
  uint32_t b2 = 0;
  {
    RawMap raw(path_);
    s2 = slot_of(raw, 2);
    ASSERT_NE(s2, ~0ull);
    c2 = raw.entry(s2)->chunk, b2 = raw.entry(s2)->block;
  }
  evicting_by(path_, s2, uint8_t(d.node));
  kill_and_reap(d.pid);
  EXPECT_EQ(pool_->reap_dead_nodes(), 1u);
  {
    RawMap raw(path_);
    EXPECT_EQ(format::entry_state(raw.entry(s2)->state), format::kCondemned);
    EXPECT_EQ(format::block_state(raw.block_desc(c2, b2)), format::kBlockUsed) << "freed under the pin";
  }
  EXPECT_FALSE(pool_->contains(ns_, k2));
  pool_->release(lease);
  auto rep = pool_->check();  // reclaims the CONDEMNED entry, now unpinned
  EXPECT_TRUE(rep.ok) << join(rep.errors);
  rep = pool_->check();
  expect_clean(rep);
  EXPECT_EQ(rep.ready_blocks, 3u);
}

TEST_F(RecoveryTest, NamespaceLockOfADeadNodeIsBroken) {
  Held h = hold_node(path_, {});
  {
    RawMap raw(path_);
    auto* sw = reinterpret_cast<SharedWords*>(raw.base() + kSharedWordsOff);
    sw->ns_lock.word = h.node;  // killed while creating a namespace, holding the lock...
    auto* table = reinterpret_cast<NamespaceEntry*>(raw.base() + raw.hdr().ns_table_off);
    ASSERT_EQ(table[1].state, 0u);
    table[1].state = make_ns_word(kNsCreating, uint8_t(h.node));  // ...with a half-made entry
    std::memcpy(table[1].name, "half", 4);
  }
  kill_and_reap(h.pid);
  auto t0 = std::chrono::steady_clock::now();
  auto fresh = pool_->open_namespace(layout("fresh", 4 * KiB));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(fresh.id, 2u);  // the half-made slot was freed and reused
  auto list = pool_->list_namespaces();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[1].first.name, "fresh");
  expect_clean(pool_->check());
}

TEST_F(RecoveryTest, NodeSlotsOfDeadProcessesAreReused) {
  // More dead attachments than node slots: attach must reclaim them instead of failing. Each child
  // forks from this attached process (heartbeat and admin threads running) and must attach within
  // the limit; one that does not is killed and its threads named (a child once hung here under
  // ASan: a fork copied an allocator lock held by a heartbeat thread that was still starting).
  enum Stage : int { kForked = 1, kOpening, kAttached };
  static const char* const kStageNames[] = {"?", "forked", "opening the pool", "attached, killing itself"};
  auto* stage = static_cast<std::atomic<int>*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(stage), MAP_FAILED);
  const uint32_t max_nodes = pool_->header().max_nodes;
  for (uint32_t i = 0; i < max_nodes + 4; ++i) {
    stage->store(0);
    pid_t pid = spawn([&] {
      stage->store(kForked);
      try {
        stage->store(kOpening);
        auto p = Pool::open(path_);
        stage->store(kAttached);
        ::kill(::getpid(), SIGKILL);  // die attached
        return 0;
      } catch (...) {
        return 2;
      }
    });
    ASSERT_GT(pid, 0) << "fork failed";
    int status = 0;
    std::string hung = wait_child(pid, &status, std::chrono::seconds(60));
    ASSERT_EQ(hung, "") << "child " << i << " stuck at: " << kStageNames[std::clamp(stage->load(), 0, 3)];
    ASSERT_TRUE(WIFSIGNALED(status)) << "child " << i << " failed to attach (exit " << WEXITSTATUS(status)
                                     << ", stage " << kStageNames[std::clamp(stage->load(), 0, 3)] << ")";
  }
  ::munmap(stage, 4096);
  expect_clean(pool_->check());
}

}  // namespace
}  // namespace cxlkv::test
