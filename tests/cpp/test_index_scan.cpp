// Index scan (index_scan.cpp, behind `cxlkv events`): every READY entry exactly once, a new
// generation when a slot is reused, nothing for removed keys, and entries whose namespace id is
// out of range (a corrupt pool) left out.
#include <cstring>
#include <map>

#include "test_util.h"

namespace cxlkv::test {
namespace {

class IndexScanTest : public PoolTest {
 protected:
  static constexpr uint64_t kBlock = 4 * KiB;
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(4 * MiB, 64 * KiB, 1024));
    ns_ = pool_->open_namespace(layout("scan", kBlock));
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  void put(uint64_t id) {
    auto v = payload(id, 100);
    Piece p{v.data(), v.size()};
    ASSERT_TRUE(pool_->put(ns_, key_of(id), &p, 1, uint16_t(id)));
  }
  std::map<Key, IndexRecord> scan() {
    std::vector<uint64_t> unstable;
    std::map<Key, IndexRecord> out;
    for (const auto& r : pool_->scan_index(0, UINT64_MAX, &unstable)) {
      Key k;
      std::memcpy(k.data(), r.key, 32);
      EXPECT_TRUE(out.emplace(k, r).second) << "a key reported twice";
    }
    EXPECT_TRUE(unstable.empty());  // nobody writes meanwhile
    return out;
  }
  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
};

TEST_F(IndexScanTest, EveryReadyEntryOnceWithItsNamespaceAndDepth) {
  for (uint64_t id = 0; id < 40; ++id) put(id);
  auto s = scan();
  ASSERT_EQ(s.size(), 40u);
  for (uint64_t id = 0; id < 40; ++id) {
    const auto& r = s.at(key_of(id));
    EXPECT_EQ(r.ns_id, ns_.id);
    EXPECT_EQ(r.depth, id);
    EXPECT_LT(r.slot, pool_->index_slots());
  }
  // A range of slots returns only the entries in it.
  std::vector<uint64_t> unstable;
  const auto& one = s.at(key_of(7));
  auto part = pool_->scan_index(one.slot, 1, &unstable);
  ASSERT_EQ(part.size(), 1u);
  EXPECT_EQ(std::memcmp(part[0].key, key_of(7).data(), 32), 0);
  EXPECT_TRUE(pool_->scan_index(pool_->index_slots(), 5, &unstable).empty());  // past the end
}

TEST_F(IndexScanTest, RemovedKeysVanishAndReusedSlotsGetANewGeneration) {
  put(1);
  const auto before = scan().at(key_of(1));
  ASSERT_TRUE(pool_->remove(ns_, key_of(1)));
  EXPECT_TRUE(scan().empty());
  put(1);
  const auto after = scan().at(key_of(1));
  EXPECT_FALSE(after.slot == before.slot && after.gen == before.gen);  // another incarnation
}

TEST_F(IndexScanTest, EntryWithANamespaceIdOutOfRangeIsLeftOut) {
  put(1);
  put(2);
  const auto s = scan();
  RawMap raw(path_);
  raw.entry(s.at(key_of(1)).slot)->ns_id = 4000;  // max_namespaces is far smaller
  raw.entry(s.at(key_of(2)).slot)->ns_id = 0;
  EXPECT_TRUE(scan().empty());
}

}  // namespace
}  // namespace cxlkv::test
