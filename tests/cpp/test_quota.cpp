// Quotas (format/quota.h, store/quotas.cpp): a subject over its limit evicts only its own blocks,
// tails first, never pinned ones; with nothing of its own it fails and is counted; usage is the
// counters' sum and `check` recounts it from the blocks; forged rows and counters are harmless.
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "test_util.h"

namespace cxlkv::test {
namespace {

// 4 MiB pool, 64 KiB chunks, 4 KiB blocks.
class QuotaTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(4 * MiB, 64 * KiB, 4096));
    ns_ = pool_->open_namespace(layout("quota", kBlock));
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  NsHandle as(const std::string& tenant) {
    NsHandle h = ns_;
    h.tenant_row = pool_->tenant_row(tenant);
    return h;
  }
  bool put_id(const NsHandle& ns, uint64_t id, uint16_t depth = 0) {
    auto v = payload(id, kBlock);
    Piece p{v.data(), v.size()};
    return pool_->put(ns, key_of(id), &p, 1, depth);
  }
  QuotaInfo row(uint32_t r) {
    for (const QuotaInfo& q : pool_->quotas())
      if (q.row == r) return q;
    return {};
  }
  uint64_t counter(format::Counter c) { return pool_->counters()[c]; }
  void expect_recount_ok() {
    CheckReport r = pool_->check();
    EXPECT_TRUE(r.ok) << join(r.errors);
    for (const auto& w : r.warnings) EXPECT_EQ(w.find("quota"), std::string::npos) << w;
  }

  static constexpr uint64_t kBlock = 4 * KiB;
  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
};

TEST_F(QuotaTest, TenantRowsAreStableAndNamed) {
  const uint8_t a = pool_->tenant_row("a"), b = pool_->tenant_row("b");
  EXPECT_NE(a, 0);
  EXPECT_NE(a, b);
  EXPECT_EQ(pool_->tenant_row("a"), a);
  EXPECT_EQ(row(a).tenant, "a");
  EXPECT_EQ(row(a).limit_bytes, 0u);
  EXPECT_THROW(pool_->tenant_row(""), ArgumentError);
  EXPECT_THROW(pool_->tenant_row(std::string(32, 'x')), ArgumentError);
}

TEST_F(QuotaTest, OverQuotaEvictsOwnTailsFirstNeverOthers) {
  NsHandle a = as("a"), b = as("b");
  for (uint64_t id = 0; id < 20; ++id) ASSERT_TRUE(put_id(b, 1000 + id));
  const uint32_t ra = pool_->set_quota(0, "a", 8 * kBlock, 0);
  // Chains of 4: depth 0..3. Within a millisecond, deeper blocks go first.
  for (uint64_t id = 0; id < 8; ++id) ASSERT_TRUE(put_id(a, id, uint16_t(id % 4)));
  EXPECT_EQ(row(ra).usage_bytes, 8 * kBlock);
  for (uint64_t id = 8; id < 40; ++id) ASSERT_TRUE(put_id(a, id, uint16_t(id % 4)));
  EXPECT_EQ(row(ra).usage_bytes, 8 * kBlock);
  EXPECT_EQ(counter(format::kQuotaEvictions), 32u);
  EXPECT_EQ(counter(format::kPutsOverQuota), 0u);
  for (uint64_t id = 0; id < 20; ++id) EXPECT_TRUE(pool_->contains(b, key_of(1000 + id))) << id;
  for (uint64_t id = 32; id < 40; ++id) EXPECT_TRUE(pool_->contains(a, key_of(id))) << id;  // newest kept
  expect_recount_ok();
}

TEST_F(QuotaTest, NothingOfItsOwnToEvictFailsAndIsCounted) {
  NsHandle a = as("a");
  pool_->set_quota(0, "a", kBlock - 1, 0);
  EXPECT_FALSE(put_id(a, 1));
  EXPECT_FALSE(pool_->contains(a, key_of(1)));
  EXPECT_EQ(counter(format::kPutsOverQuota), 1u);
  EXPECT_EQ(row(a.tenant_row).usage_bytes, 0u);
  EXPECT_TRUE(put_id(ns_, 1));  // no tenant: no limit
  expect_recount_ok();
}

TEST_F(QuotaTest, PinnedBlocksAreNeverEvicted) {
  NsHandle a = as("a");
  pool_->set_quota(0, "a", 2 * kBlock, 0);
  ASSERT_TRUE(put_id(a, 1));
  ASSERT_TRUE(put_id(a, 2));
  Key ks[2] = {key_of(1), key_of(2)};
  auto pins = pool_->acquire(a, ks, 2);
  ASSERT_EQ(pins.size(), 2u);
  EXPECT_FALSE(put_id(a, 3));
  EXPECT_EQ(counter(format::kPutsOverQuota), 1u);
  pool_->release(pins);
  EXPECT_TRUE(put_id(a, 3));
  expect_recount_ok();
}

TEST_F(QuotaTest, NamespaceQuotaAndClear) {
  NsHandle other = pool_->open_namespace(layout("other", kBlock));
  const uint32_t r = pool_->set_quota(ns_.id, "", 0, 1000);  // 0.1 % of the arena: < 2 blocks
  const QuotaInfo q = row(r);
  EXPECT_EQ(q.ns_id, ns_.id);
  EXPECT_GT(q.limit_bytes, 0u);
  const uint64_t fits = q.limit_bytes / kBlock;
  for (uint64_t id = 0; id < 10; ++id) EXPECT_EQ(put_id(ns_, id), fits > 0) << id;
  for (uint64_t id = 0; id < 10; ++id) EXPECT_TRUE(put_id(other, 100 + id));
  EXPECT_LE(row(r).usage_bytes, q.limit_bytes);
  pool_->set_quota(ns_.id, "", 0, 0);  // cleared: counted, not limited
  for (uint64_t id = 10; id < 20; ++id) EXPECT_TRUE(put_id(ns_, id));
  EXPECT_EQ(row(r).limit_bytes, 0u);
  EXPECT_EQ(row(r).usage_bytes, (fits + 10) * kBlock);
  expect_recount_ok();
}

TEST_F(QuotaTest, DeleteReleasesAndCheckRecountsAcrossReopen) {
  NsHandle a = as("a");
  for (uint64_t id = 0; id < 6; ++id) ASSERT_TRUE(put_id(a, id));
  ASSERT_TRUE(pool_->remove(a, key_of(0)));
  const uint8_t r = a.tenant_row;
  EXPECT_EQ(row(r).usage_bytes, 5 * kBlock);
  pool_.reset();
  pool_ = Pool::open(path_);
  EXPECT_EQ(row(r).usage_bytes, 5 * kBlock);
  EXPECT_EQ(row(r).tenant, "a");
  expect_recount_ok();
}

TEST_F(QuotaTest, ForgedRowIsUnreadableAndReported) {
  const uint32_t r = pool_->set_quota(0, "a", kBlock, 0);
  {
    RawMap raw(path_);
    auto* row_bytes = raw.base() + format::kQuotaTableOff + (r - 1) * sizeof(format::QuotaRow);
    row_bytes[20] ^= 0x40;  // inside the name: the checksum no longer matches
  }
  EXPECT_FALSE(row(r).readable);
  CheckReport c = pool_->check();
  EXPECT_FALSE(c.ok);
  // A forged row with a valid checksum but fields out of range is refused too.
  {
    RawMap raw(path_);
    format::QuotaRow bad = Quotas::make_row(format::kQuotaNamespace, 60000, "", 1, 0);
    std::memcpy(raw.base() + format::kQuotaTableOff + (r - 1) * sizeof bad, &bad, sizeof bad);
  }
  EXPECT_FALSE(row(r).readable);
  // Puts are never limited by an unreadable row.
  EXPECT_TRUE(put_id(ns_, 1));
}

// A row whose checksum a stray write broke is still its subject's: the blocks charged to it are
// released to it while it reads unreadable, so its usage is right again once the row is.
// (Releases used to skip unreadable rows, and the usage drifted up until `pool check --repair`.)
TEST_F(QuotaTest, ReleasesAreBookedWhileTheRowIsUnreadable) {
  NsHandle a = as("a");
  for (uint64_t id = 0; id < 4; ++id) ASSERT_TRUE(put_id(a, id));
  const uint8_t r = a.tenant_row;
  auto flip = [&] {
    RawMap raw(path_);
    raw.base()[format::kQuotaTableOff + (r - 1) * sizeof(format::QuotaRow) + 20] ^= 0x40;
  };
  flip();
  {
    auto b = Pool::open(path_);  // a fresh view: it reads the row unreadable
    NsHandle nb = b->open_namespace(layout("quota", kBlock));
    nb.tenant_row = r;
    ASSERT_TRUE(b->remove(nb, key_of(0)));
    ASSERT_TRUE(b->remove(nb, key_of(1)));
  }
  EXPECT_FALSE(row(r).readable);
  flip();
  EXPECT_TRUE(row(r).readable);
  EXPECT_EQ(row(r).usage_bytes, 2 * kBlock);
  expect_recount_ok();
}

// An aborted reservation refunds the rows its block was charged to, not what its entry in the
// pool names by then: a stray write to the entry's rows moves no usage from one subject to another.
TEST_F(QuotaTest, AbortRefundsWhatWasChargedWhateverTheEntrySays) {
  NsHandle a = as("a");
  NsHandle b = as("b");
  ASSERT_TRUE(put_id(b, 50));
  Reservation r;
  pool_->reserve(a, key_of(7), 0, &r);
  ASSERT_EQ(r.state, Reservation::reserved);
  EXPECT_EQ(row(a.tenant_row).usage_bytes, kBlock);
  {
    RawMap raw(path_);
    raw.entry(r.slot)->tenant_row = b.tenant_row;  // forged while the reservation is in flight
  }
  pool_->abort(a, &r);
  EXPECT_EQ(row(a.tenant_row).usage_bytes, 0u);
  EXPECT_EQ(row(b.tenant_row).usage_bytes, kBlock);
  expect_recount_ok();
}

TEST_F(QuotaTest, ForgedCountersAreClampedBoundedAndRepaired) {
  NsHandle a = as("a");
  pool_->set_quota(0, "a", 4 * kBlock, 0);
  for (uint64_t id = 0; id < 3; ++id) ASSERT_TRUE(put_id(a, id));
  {
    RawMap raw(path_);
    auto* f = reinterpret_cast<format::NodeAreaFixed*>(raw.base() + raw.hdr().node_area_off +
                                                       (pool_->node_id() - 1) * raw.hdr().node_area_bytes);
    f->quota_charged[a.tenant_row - 1] = 1ull << 62;  // usage "huge" (~0 would read as -1: clamped to 0)
  }
  EXPECT_EQ(row(a.tenant_row).usage_bytes, pool_->header().pool_bytes);
  put_id(a, 99);  // evicts its own (at most a bounded number) then fails: never loops
  CheckReport c = pool_->check();
  bool warned = false;
  for (const auto& w : c.warnings) warned |= w.find("quota usage") != std::string::npos;
  EXPECT_TRUE(warned);
  c = pool_->check(true);
  EXPECT_FALSE(c.repaired.empty());
  expect_recount_ok();
  EXPECT_LE(row(a.tenant_row).usage_bytes, 4 * kBlock);
}

TEST_F(QuotaTest, TableFullIsItsOwnError) {
  for (uint32_t i = 0; i < format::kQuotaRows; ++i) pool_->tenant_row("t" + std::to_string(i));
  EXPECT_THROW(pool_->tenant_row("one-more"), QuotaTableFullError);
}

// Another process's quota change reaches this process's puts within the refresh interval (100 ms)
// and its clear likewise: the cached view is re-read, not kept.
TEST_F(QuotaTest, AnotherHandlesChangeIsSeenWithinTheRefresh) {
  std::unique_ptr<Pool> other = Pool::open(path_);
  ASSERT_TRUE(put_id(ns_, 1));  // this handle's view is read now: no quota
  const uint32_t r = other->set_quota(ns_.id, "", 1, 0);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t id = 100;
  while (put_id(ns_, id++)) ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(row(r).limit_bytes, 1u);
  other->set_quota(ns_.id, "", 0, 0);
  const auto t1 = std::chrono::steady_clock::now();
  while (!put_id(ns_, id++)) ASSERT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(5));
  expect_recount_ok();
}

// Puts on several threads read the cached rows without a lock while another handle sets and
// clears quotas and this one re-reads the table (its own changes invalidate its view): the
// counters match the blocks afterwards (an entry naming a row not in use would be an error there).
TEST_F(QuotaTest, ConcurrentPutsReadTheRowsWhileTheyChange) {
  std::unique_ptr<Pool> other = Pool::open(path_);
  const uint32_t r = other->set_quota(ns_.id, "", 1ull << 40, 0);  // the row exists
  std::atomic<bool> stop{false};
  std::thread changer([&] {
    for (int i = 0; !stop.load(); ++i) {
      other->set_quota(ns_.id, "", i % 2 ? 8 * kBlock : 0, 0);
      other->tenant_row("t" + std::to_string(i % 8));  // new rows appear beside it
      std::this_thread::sleep_for(std::chrono::milliseconds(7));
    }
  });
  std::vector<std::thread> putters;
  for (int t = 0; t < 4; ++t)
    putters.emplace_back([&, t] {
      for (uint64_t id = 0; id < 1500; ++id) {
        put_id(ns_, uint64_t(t) << 32 | id);
        if (id % 50 == 0)
          pool_->set_quota(0, "p" + std::to_string(t), 1ull << 40, 0);  // invalidates the view
      }
    });
  for (auto& p : putters) p.join();
  stop = true;
  changer.join();
  EXPECT_LE(pool_->quotas().size(), size_t(format::kQuotaRows));
  EXPECT_EQ(row(r).ns_id, ns_.id);
  expect_recount_ok();
}

}  // namespace
}  // namespace cxlkv::test
