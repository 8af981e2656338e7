// Real processes on one pool: forked children that each Pool::open() it and hammer a working set
// larger than the pool, verifying every byte they read (one namespace, then two namespaces that
// must share the chunks); check() run while they work; racing creators of one pool.
// The SIGKILL chaos run is in test_chaos.cpp.
#include <filesystem>
#include <set>

#include "mp_workload.h"

namespace cxlkv::test {
namespace {

using namespace mp;

class MultiProcessTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(8 * MiB, 256 * KiB));
    ns0_ = open_ns(*pool_, spec(0));
    capacity_ = pool_->header().chunk_count * ns0_.h.geo.blocks;
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  std::map<uint32_t, uint64_t> chunks_by_ns() {
    RawMap raw(path_);
    std::map<uint32_t, uint64_t> m;
    for (uint64_t c = 0; c < raw.hdr().chunk_count; ++c)
      if (format::chunk_state(raw.chunk_word(c)) == format::kChunkActive)
        ++m[format::chunk_ns(raw.chunk_word(c))];
    return m;
  }

  std::unique_ptr<Pool> pool_;
  Ns ns0_;
  uint64_t capacity_ = 0;
};

TEST_F(MultiProcessTest, RandomOpsFromFourProcesses) {
  ASSERT_LT(capacity_, kWorkingSet) << "the working set must not fit";
  std::vector<pid_t> kids;
  for (uint64_t i = 0; i < 4; ++i)
    kids.push_back(spawn([&] { return random_worker(path_, 1000 + i, 20000); }));
  for (pid_t pid : kids) EXPECT_EQ(wait_exit(pid), 0) << "1 = wrong bytes read, 2 = exception, >128 = signal";
  EXPECT_EQ(pool_->reap_dead_nodes(), 0u);  // all children closed cleanly
  auto r = pool_->check();
  expect_clean(r);
  EXPECT_GT(r.ready_blocks, capacity_ / 2);
  EXPECT_EQ(verify_ready_entries(*pool_, path_, 1), r.ready_blocks);
}

// Namespace 0 fills the pool first; then processes work on namespaces 0 and 1 (another block
// size): namespace 1 must get chunks (drained from namespace 0) and nobody may read wrong bytes.
TEST_F(MultiProcessTest, TwoNamespacesShareAFullPool) {
  std::vector<char> want;
  for (uint64_t id = 0; id < kWorkingSet; ++id) ASSERT_TRUE(put_id(*pool_, ns0_, id, want));
  EXPECT_EQ(pool_->occupancy().free_chunks, 0u);
  std::vector<pid_t> kids;
  kids.push_back(spawn([&] { return random_worker(path_, 7, 20000, 1, 1); }));
  kids.push_back(spawn([&] { return random_worker(path_, 8, 20000, 1, 1); }));
  kids.push_back(spawn([&] { return random_worker(path_, 9, 20000, 0, 2); }));
  kids.push_back(spawn([&] { return random_worker(path_, 10, 20000, 0, 1); }));
  for (pid_t pid : kids) EXPECT_EQ(wait_exit(pid), 0) << "1 = wrong bytes read, 2 = exception, >128 = signal";
  auto held = chunks_by_ns();
  Ns ns1 = open_ns(*pool_, spec(1));
  EXPECT_GT(held[ns1.h.id], 0u) << "namespace 1 never got a chunk";
  EXPECT_GT(held[ns0_.h.id], 0u);
  uint64_t total = held[ns0_.h.id] + held[ns1.h.id];
  EXPECT_EQ(total, pool_->header().chunk_count);
  auto r = pool_->check();
  expect_clean(r);
  EXPECT_EQ(verify_ready_entries(*pool_, path_, 2), r.ready_blocks);
}

// check() run while other processes work must not report their in-flight states as errors.
TEST_F(MultiProcessTest, CheckWhileOthersWork) {
  std::vector<pid_t> kids;
  for (uint64_t i = 0; i < 3; ++i)
    kids.push_back(spawn([&] { return random_worker(path_, 2000 + i, 15000); }));
  int checks = 0, running = int(kids.size());
  std::vector<int> status(kids.size(), -1);
  while (running > 0) {
    auto r = pool_->check();
    ++checks;
    EXPECT_TRUE(r.ok) << "check " << checks << join(r.errors);
    EXPECT_EQ(r.capacity_blocks, r.free_blocks + r.ready_blocks + r.inflight_blocks);
    EXPECT_EQ(r.stuck_entries + r.leaked_blocks + r.orphan_pins, 0u);
    for (size_t k = 0; k < kids.size(); ++k)
      if (status[k] < 0 && ::waitpid(kids[k], &status[k], WNOHANG) == kids[k]) --running;
  }
  for (int st : status)
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
        << "exit " << WEXITSTATUS(st) << " (1 = wrong bytes, 2 = exception)";
  EXPECT_GE(checks, 2);
  expect_clean(pool_->check());
}

// The same workload on a pool with the flush backend (clwb/clflushopt discipline).
TEST(MultiProcessFlush, RandomOpsWithFlushBackend) {
  const std::string path = unique_pool_path();
  CreateOptions o;
  o.size = 8 * MiB;
  o.chunk_bytes = 256 * KiB;
  o.backend = Backend::flush;
  auto pool = Pool::create(path, o, false);
  ASSERT_EQ(pool->backend(), Backend::flush);
  std::vector<pid_t> kids;
  for (uint64_t i = 0; i < 3; ++i)
    kids.push_back(spawn([&] { return random_worker(path, 3000 + i, 8000, 0, 2); }));
  for (pid_t pid : kids) EXPECT_EQ(wait_exit(pid), 0) << "1 = wrong bytes read, 2 = exception, >128 = signal";
  auto r = pool->check();
  expect_clean(r);
  EXPECT_EQ(verify_ready_entries(*pool, path, 2), r.ready_blocks);
  pool.reset();
  ::unlink(path.c_str());
}

// A Pool inherited through fork() belongs to the parent: closing it in the child must not detach
// the parent's node (its pins must survive), and the child's own open() is a separate node.
TEST_F(MultiProcessTest, ForkedChildDoesNotDetachParent) {
  std::vector<char> want;
  ASSERT_TRUE(put_id(*pool_, ns0_, 1, want));
  Key k = key_of(1);
  auto pins = pool_->acquire(ns0_.h, &k, 1);
  ASSERT_EQ(pins.size(), 1u);
  const uint32_t parent_node = pool_->node_id();
  pid_t pid = spawn([&] {
    int code = 0;
    try {
      pool_->ensure_usable();
      code = 10;  // the inherited attachment should refuse use
    } catch (const Error&) {
    }
    pool_->close();  // unmap only
    try {
      auto mine = Pool::open(path_);
      if (mine->node_id() == parent_node) code = 11;
      auto ns = mine->open_namespace(layout(spec(0).name, spec(0).block));
      if (mine->remove(ns, k)) code = 12;  // the parent's pin must still hold
    } catch (...) {
      code = 13;
    }
    return code;
  });
  EXPECT_EQ(wait_exit(pid), 0)
      << "10 = inherited pool usable, 11 = same node id, 12 = pin lost, 13 = exception";
  EXPECT_FALSE(pool_->closed());
  pool_->ensure_usable();
  auto r = pool_->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
  EXPECT_EQ(r.orphan_pins, 0u);
  pool_->release(pins);
  EXPECT_TRUE(pool_->remove(ns0_.h, k));
}

// Racing creators: every process calls create(exist_ok) on the same path and opens the same new
// namespace; exactly one pool and one namespace result, and all of them use it.
TEST(MultiProcessCreate, RacingCreatorsAgree) {
  const std::string path = unique_pool_path();
  std::vector<pid_t> kids;
  for (int i = 0; i < 4; ++i) {
    kids.push_back(spawn([&] {
      try {
        CreateOptions o;
        o.size = 8 * MiB;
        o.chunk_bytes = 256 * KiB;
        auto pool = Pool::create(path, o, true);
        auto ns = pool->open_namespace(layout("racy", 4096));
        auto v = payload(uint64_t(i), 4096);
        Piece p{v.data(), v.size()};
        if (!pool->put(ns, key_of(uint64_t(i)), &p, 1, 0)) return 100;
        return int(ns.id);  // all must agree
      } catch (...) {
        return 101;
      }
    }));
  }
  std::set<int> ids;
  for (pid_t pid : kids) {
    int code = wait_exit(pid);
    ASSERT_LT(code, 100) << "child failed with " << code;
    ids.insert(code);
  }
  EXPECT_EQ(ids.size(), 1u);
  auto pool = Pool::open(path);
  auto list = pool->list_namespaces();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].first.name, "racy");
  std::vector<char> out(4096);
  for (uint64_t i = 0; i < 4; ++i) {
    Piece p{out.data(), out.size()};
    EXPECT_TRUE(pool->get(list[0].first, key_of(i), &p, 1, nullptr));
    EXPECT_EQ(out, payload(i, 4096));
  }
  EXPECT_TRUE(pool->check().ok);
  pool.reset();
  ::unlink(path.c_str());
  // No temporary files left behind by the losers.
  std::string prefix = path.substr(std::string("/dev/shm/").size()) + ".init-";
  for (const auto& ent : std::filesystem::directory_iterator("/dev/shm"))
    EXPECT_NE(ent.path().filename().string().rfind(prefix, 0), 0u) << ent.path();
}

}  // namespace
}  // namespace cxlkv::test
