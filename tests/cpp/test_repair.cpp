// `pool check --repair` (check.cpp; index.cpp release_abandoned): several repairers racing on the
// same finding release it exactly once, and the accounting balances afterwards. The abandoned
// states are written with a raw mapping, as format.h says they are left: the entry of a writer
// whose node slot went FREE under it, a CONDEMNED entry whose last pin is gone, a block whose
// releaser died between its two claims. The repairers are observers (no node slot), as the CLI's
// `pool check` is. The same findings with real processes: tests/python/test_repair.py.
#include <thread>

#include "test_util.h"

namespace cxlkv::test {
namespace {

using namespace format;

constexpr uint64_t kBlock = 16 * KiB;
constexpr int kRepairers = 4;

class RepairTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(4 * MiB, 64 * KiB, 1024));
    ns_ = pool_->open_namespace(layout("rep", kBlock));
    for (uint64_t id = 0; id < 6; ++id) {
      auto v = payload(id, kBlock);
      Piece p{v.data(), v.size()};
      ASSERT_TRUE(pool_->put(ns_, key_of(id), &p, 1, 0));
    }
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  // The slot of key `id`, READY now.
  uint64_t slot_of(RawMap& raw, uint64_t id) {
    for (uint64_t s : raw.ready_slots())
      if (std::memcmp(raw.entry(s)->key, key_of(id).data(), 32) == 0) return s;
    return ~0ull;
  }
  uint64_t* desc(RawMap& raw, uint64_t chunk, uint32_t block) {
    return reinterpret_cast<uint64_t*>(raw.base() + raw.hdr().arena_off + chunk * raw.chunk_stride()) + block;
  }
  // kRepairers observers run check(repair) at once; every repair line any of them made. None of
  // them may report an error: a loser sees the finding gone (or half-released, then gone).
  std::vector<std::string> race_repairs() {
    std::vector<CheckReport> got(kRepairers);
    std::vector<std::thread> ts;
    for (auto& g : got) ts.emplace_back([&] { g = Pool::open(path_, false, /*attach=*/false)->check(true); });
    for (auto& t : ts) t.join();
    std::vector<std::string> all;
    for (auto& g : got) {
      EXPECT_TRUE(g.ok) << join(g.errors);
      all.insert(all.end(), g.repaired.begin(), g.repaired.end());
    }
    return all;
  }
  void expect_clean_with_ready(uint64_t ready) {
    CheckReport r = pool_->check();
    EXPECT_TRUE(r.ok) << join(r.errors);
    EXPECT_EQ(r.leaked_blocks + r.stuck_entries + r.inflight_blocks + r.condemned_blocks, 0u);
    EXPECT_EQ(r.ready_blocks, ready);
    EXPECT_EQ(r.capacity_blocks, r.free_blocks + r.ready_blocks);
    EXPECT_TRUE(r.warnings.empty()) << join(r.warnings);
  }

  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
};

TEST_F(RepairTest, EntryOfAFreeNodeIsReleasedOnceByRacingRepairers) {
  const uint8_t gone = uint8_t(pool_->header().max_nodes);  // a FREE slot: never attached
  {
    RawMap raw(path_);
    uint64_t s = slot_of(raw, 2);
    ASSERT_NE(s, ~0ull);
    auto* e = raw.entry(s);
    *desc(raw, e->chunk, e->block) = make_block_word(kBlockUsed, gone, 0, s);
    e->state = make_entry_word(kWriting, gone, entry_gen(e->state) + 1, entry_tag(e->state));
  }
  // Without repair: reported, with the way out, and left alone.
  CheckReport plain = Pool::open(path_, false, false)->check(false);
  EXPECT_FALSE(plain.ok);
  EXPECT_EQ(plain.stuck_entries, 1u) << join(plain.errors);
  EXPECT_TRUE(plain.repaired.empty());
  EXPECT_NE(join(plain.errors).find("`pool check --repair` releases it"), std::string::npos);

  auto repairs = race_repairs();
  ASSERT_EQ(repairs.size(), 1u) << join(repairs);
  EXPECT_NE(repairs[0].find("stuck in WRITING (node " + std::to_string(gone) + " is not attached)"),
            std::string::npos)
      << repairs[0];
  EXPECT_FALSE(pool_->contains(ns_, key_of(2)));
  expect_clean_with_ready(5);
}

TEST_F(RepairTest, UnpinnedCondemnedEntryIsFreedOnceByRacingRepairers) {
  {
    RawMap raw(path_);
    uint64_t s = slot_of(raw, 3);
    ASSERT_NE(s, ~0ull);
    uint64_t w = raw.entry(s)->state;
    raw.entry(s)->state = make_entry_word(kCondemned, 0, entry_gen(w), entry_tag(w));
  }
  // An observer without repair leaves it, and says why truthfully: no pin holds it.
  CheckReport plain = Pool::open(path_, false, false)->check(false);
  EXPECT_TRUE(plain.ok) << join(plain.errors);
  EXPECT_EQ(plain.condemned_blocks, 1u);
  EXPECT_NE(join(plain.warnings).find("no pin holds them any more"), std::string::npos)
      << join(plain.warnings);

  auto repairs = race_repairs();
  ASSERT_EQ(repairs.size(), 1u) << join(repairs);
  EXPECT_NE(repairs[0].find("condemned"), std::string::npos) << repairs[0];
  expect_clean_with_ready(5);
}

TEST_F(RepairTest, BlockLeftByADeadReleaserIsFreedOnceByRacingRepairers) {
  const uint8_t gone = uint8_t(pool_->header().max_nodes);
  {
    // A releaser tombstoned key 4's entry and died before freeing its block, whose writer (the
    // descriptor's node and epoch) is gone too.
    RawMap raw(path_);
    uint64_t s = slot_of(raw, 4);
    ASSERT_NE(s, ~0ull);
    auto* e = raw.entry(s);
    *desc(raw, e->chunk, e->block) = make_block_word(kBlockUsed, gone, 0, s);
    e->state = make_entry_word(kTombstone, 0, entry_gen(e->state), entry_tag(e->state));
  }
  CheckReport plain = Pool::open(path_, false, false)->check(false);
  EXPECT_EQ(plain.leaked_blocks, 1u) << join(plain.errors);

  auto repairs = race_repairs();
  ASSERT_EQ(repairs.size(), 1u) << join(repairs);
  EXPECT_NE(repairs[0].find("freed (used by a gone incarnation of node " + std::to_string(gone)),
            std::string::npos)
      << repairs[0];
  expect_clean_with_ready(5);
}

}  // namespace
}  // namespace cxlkv::test
