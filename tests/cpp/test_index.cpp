// Prefix index: exact-byte round trips, key and namespace isolation, write-once puts, pins
// (acquire/release) against eviction and removal, and detection of corrupted payloads/entries.
#include <optional>

#include "test_util.h"

namespace cxlkv::test {
namespace {

class IndexTest : public PoolTest {
 protected:
  static constexpr uint64_t kBlock = 16 * KiB;
  void SetUp() override {
    PoolTest::SetUp();
    pool_ = create(opts(4 * MiB, 64 * KiB, 1024));
    ns_ = pool_->open_namespace(layout("idx", kBlock));
  }
  void TearDown() override {
    pool_.reset();
    PoolTest::TearDown();
  }
  bool put(const NsHandle& ns, const Key& k, const std::vector<char>& v, uint16_t depth = 0) {
    Piece p{const_cast<char*>(v.data()), v.size()};
    return pool_->put(ns, k, &p, 1, depth);
  }
  // Returns the stored bytes, or nullopt on a miss.
  std::optional<std::vector<char>> get(const NsHandle& ns, const Key& k) {
    std::vector<char> out(ns.block_bytes, '\xEE');
    Piece p{out.data(), out.size()};
    uint64_t len = ~0ull;
    if (!pool_->get(ns, k, &p, 1, &len)) return std::nullopt;
    EXPECT_LE(len, ns.block_bytes);
    for (uint64_t i = len; i < out.size(); ++i) EXPECT_EQ(out[i], '\xEE') << "byte past length written";
    out.resize(len);
    return out;
  }
  uint64_t capacity() const { return pool_->header().chunk_count * ns_.geo.blocks; }

  std::unique_ptr<Pool> pool_;
  NsHandle ns_;
};

TEST_F(IndexTest, RoundTripExactBytes) {
  for (uint64_t id = 0; id < 20; ++id) {
    uint64_t len = (id * 997) % kBlock + (id == 0 ? 0 : 1);  // includes 0 and odd lengths
    ASSERT_TRUE(put(ns_, key_of(id), payload(id, len)));
  }
  for (uint64_t id = 0; id < 20; ++id) {
    uint64_t len = (id * 997) % kBlock + (id == 0 ? 0 : 1);
    EXPECT_TRUE(pool_->contains(ns_, key_of(id)));
    auto got = get(ns_, key_of(id));
    ASSERT_TRUE(got.has_value()) << id;
    EXPECT_EQ(*got, payload(id, len)) << id;
  }
  EXPECT_FALSE(pool_->contains(ns_, key_of(999)));
  EXPECT_FALSE(get(ns_, key_of(999)).has_value());
  // Full-size block.
  ASSERT_TRUE(put(ns_, key_of(100), payload(100, kBlock)));
  EXPECT_EQ(*get(ns_, key_of(100)), payload(100, kBlock));
  auto c = pool_->counters();
  EXPECT_EQ(c[format::kPuts], 21u);
  EXPECT_EQ(c[format::kMisses], 1u);
}

TEST_F(IndexTest, GatherScatterPieces) {
  auto v = payload(7, kBlock);
  Piece in[3] = {{v.data(), 100}, {v.data() + 100, 5000}, {v.data() + 5100, kBlock - 5100}};
  ASSERT_TRUE(pool_->put(ns_, key_of(7), in, 3, 0));
  std::vector<char> a(3000), b(kBlock);
  Piece out[2] = {{a.data(), a.size()}, {b.data(), b.size()}};
  uint64_t len = 0;
  ASSERT_TRUE(pool_->get(ns_, key_of(7), out, 2, &len));
  EXPECT_EQ(len, kBlock);
  EXPECT_EQ(std::memcmp(a.data(), v.data(), 3000), 0);
  EXPECT_EQ(std::memcmp(b.data(), v.data() + 3000, kBlock - 3000), 0);
  // An output smaller than the block is refused, not truncated.
  std::vector<char> small(kBlock - 1);
  Piece s{small.data(), small.size()};
  EXPECT_THROW(pool_->get(ns_, key_of(7), &s, 1, &len), ArgumentError);
}

// An intent (reserve without a block, coalescing's marker): a WRITING entry whose chunk is the
// "no block" value, so it holds no pool block; others see the key in flight; it never publishes.
TEST_F(IndexTest, IntentReservationHoldsAnEntryAndNoBlock) {
  const Key k = key_of(77);
  Reservation r;
  pool_->reserve(ns_, k, 3, &r, /*with_block=*/false);
  ASSERT_EQ(r.state, Reservation::reserved);
  {
    RawMap m(path_);
    const format::IndexEntry* e = m.entry(r.slot);
    EXPECT_EQ(format::entry_state(e->state), format::kWriting);
    EXPECT_EQ(e->chunk, format::kNoChunk);
  }
  Reservation other;
  pool_->reserve(ns_, k, 3, &other);
  EXPECT_EQ(other.state, Reservation::in_flight);
  EXPECT_FALSE(pool_->contains(ns_, k));
  EXPECT_THROW(pool_->commit(ns_, &r), ArgumentError);
  pool_->abort(ns_, &r);
  EXPECT_EQ(r.state, Reservation::aborted);
  {
    RawMap m(path_);
    EXPECT_EQ(format::entry_state(m.entry(r.slot)->state), format::kTombstone);
  }
  pool_->reserve(ns_, k, 3, &other);  // with a block now: the key is free again
  EXPECT_EQ(other.state, Reservation::reserved);
  pool_->abort(ns_, &other);
}

TEST_F(IndexTest, KeysDifferingInLastByteDoNotAlias) {
  Key a = key_of(1), b = a;
  b[31] ^= 1;
  ASSERT_TRUE(put(ns_, a, payload(1, kBlock)));
  EXPECT_FALSE(pool_->contains(ns_, b));
  ASSERT_TRUE(put(ns_, b, payload(2, kBlock)));
  EXPECT_EQ(*get(ns_, a), payload(1, kBlock));
  EXPECT_EQ(*get(ns_, b), payload(2, kBlock));
  EXPECT_TRUE(pool_->remove(ns_, a));
  EXPECT_FALSE(pool_->contains(ns_, a));
  EXPECT_EQ(*get(ns_, b), payload(2, kBlock));
  // Also the first byte.
  Key c = b;
  c[0] ^= 0x80;
  EXPECT_FALSE(pool_->contains(ns_, c));
}

TEST_F(IndexTest, SameKeyInTwoNamespacesDoesNotAlias) {
  auto other = pool_->open_namespace(layout("idx2", kBlock));
  Key k = key_of(5);
  ASSERT_TRUE(put(ns_, k, payload(5, kBlock, 1)));
  EXPECT_FALSE(pool_->contains(other, k));
  ASSERT_TRUE(put(other, k, payload(5, kBlock, 2)));
  EXPECT_EQ(*get(ns_, k), payload(5, kBlock, 1));
  EXPECT_EQ(*get(other, k), payload(5, kBlock, 2));
  EXPECT_TRUE(pool_->remove(other, k));
  EXPECT_TRUE(pool_->contains(ns_, k));
  EXPECT_FALSE(pool_->contains(other, k));
  // Reopening a namespace by name returns the same id; another layout under that name is refused.
  EXPECT_EQ(pool_->open_namespace(layout("idx2", kBlock)).id, other.id);
  EXPECT_THROW(pool_->open_namespace(layout("idx2", kBlock * 2)), LayoutMismatchError);
}

TEST_F(IndexTest, WriteOnce) {
  Key k = key_of(3);
  ASSERT_TRUE(put(ns_, k, payload(3, kBlock, 1)));
  EXPECT_TRUE(put(ns_, k, payload(3, kBlock, 2)));  // present: true, not rewritten
  EXPECT_TRUE(put(ns_, k, payload(3, 100, 3)));
  EXPECT_EQ(*get(ns_, k), payload(3, kBlock, 1));
  auto c = pool_->counters();
  EXPECT_EQ(c[format::kPuts], 1u);
  EXPECT_EQ(c[format::kPutsPresent], 2u);
  EXPECT_EQ(pool_->occupancy().used, 1u);
  // After remove, a new put stores the new bytes.
  ASSERT_TRUE(pool_->remove(ns_, k));
  EXPECT_FALSE(pool_->remove(ns_, k));
  ASSERT_TRUE(put(ns_, k, payload(3, 100, 3)));
  EXPECT_EQ(*get(ns_, k), payload(3, 100, 3));
}

TEST_F(IndexTest, MatchPrefix) {
  std::vector<Key> chain;
  for (uint64_t i = 0; i < 10; ++i) chain.push_back(key_of(1000 + i));
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(put(ns_, chain[i], payload(1000 + i, 64), uint16_t(i)));
  EXPECT_EQ(pool_->match_prefix(ns_, chain.data(), chain.size()), 10u);
  EXPECT_EQ(pool_->match_prefix(ns_, chain.data(), 4), 4u);
  EXPECT_EQ(pool_->match_prefix(ns_, chain.data(), 0), 0u);
  ASSERT_TRUE(pool_->remove(ns_, chain[6]));
  EXPECT_EQ(pool_->match_prefix(ns_, chain.data(), chain.size()), 6u);
  ASSERT_TRUE(pool_->remove(ns_, chain[0]));
  EXPECT_EQ(pool_->match_prefix(ns_, chain.data(), chain.size()), 0u);
  auto other = pool_->open_namespace(layout("other", kBlock));
  EXPECT_EQ(pool_->match_prefix(other, chain.data() + 1, 5), 0u);
}

// match_prefix's fast path (key READY at its home, compared in place) and its fallback (find's
// probe) on a crowded index: keys displaced from home, tombstones, two namespaces. Its answer is
// always the number of leading keys that contains() finds.
TEST_F(IndexTest, MatchPrefixAgreesWithContainsOnACrowdedIndex) {
  pool_.reset();
  ::unlink(path_.c_str());
  pool_ = create(opts(8 * MiB, 64 * KiB, 256));
  const auto a = pool_->open_namespace(layout("a", 64)), b = pool_->open_namespace(layout("b", 64));
  std::vector<Key> keys;
  for (uint64_t i = 0; i < 200; ++i) keys.push_back(key_of(7000 + i));
  size_t stored = 0;
  for (uint64_t i = 0; i < keys.size(); ++i) {
    stored += put(i % 5 == 4 ? b : a, keys[i], payload(i, 64));
    if (i % 3 == 0 && i > 0) pool_->remove(a, keys[i - 1]);  // tombstones on the probe paths
  }
  ASSERT_GT(stored, 150u);
  uint64_t s = 3;
  for (int round = 0; round < 300; ++round) {
    const auto& ns = round % 4 == 0 ? b : a;
    std::vector<Key> q(1 + splitmix(s) % 64);
    for (auto& k : q) k = keys[splitmix(s) % keys.size()];
    size_t lead = 0;
    while (lead < q.size() && pool_->contains(ns, q[lead])) ++lead;
    ASSERT_EQ(pool_->match_prefix(ns, q.data(), q.size()), lead) << "round " << round;
  }
}

TEST_F(IndexTest, AcquirePinsAgainstEviction) {
  const uint64_t cap = capacity();
  ASSERT_LT(cap, pool_->header().pin_slots);
  std::vector<Key> keys;
  for (uint64_t id = 0; id < cap; ++id) {
    keys.push_back(key_of(id));
    ASSERT_TRUE(put(ns_, keys.back(), payload(id, kBlock)));
  }
  EXPECT_EQ(pool_->occupancy().free, 0u);
  auto pins = pool_->acquire(ns_, keys.data(), keys.size());
  ASSERT_EQ(pins.size(), cap);
  // Everything pinned: no victim, the put fails and nothing was lost.
  EXPECT_FALSE(put(ns_, key_of(cap + 1), payload(cap + 1, kBlock)));
  EXPECT_FALSE(pool_->contains(ns_, key_of(cap + 1)));
  EXPECT_GE(pool_->counters()[format::kEvictSkippedPinned], 1u);
  for (uint64_t id = 0; id < cap; ++id) ASSERT_EQ(*get(ns_, keys[id]), payload(id, kBlock)) << id;
  // A pinned key cannot be removed either.
  EXPECT_FALSE(pool_->remove(ns_, keys[0]));
  EXPECT_TRUE(pool_->contains(ns_, keys[0]));
  auto r = pool_->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
  EXPECT_EQ(r.orphan_pins, 0u);
  // Release: the put now evicts and succeeds; removal works.
  pool_->release(pins);
  EXPECT_TRUE(put(ns_, key_of(cap + 1), payload(cap + 1, kBlock)));
  EXPECT_EQ(*get(ns_, key_of(cap + 1)), payload(cap + 1, kBlock));
  EXPECT_GE(pool_->counters()[format::kEvictions], 1u);
  uint64_t removed = 0;
  for (auto& k : keys) removed += pool_->remove(ns_, k);
  EXPECT_EQ(removed, cap - 1);  // one was evicted for the new key
  r = pool_->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
}

TEST_F(IndexTest, AcquireStopsAtFirstMissAndRemoveOfPinnedFails) {
  std::vector<Key> keys = {key_of(1), key_of(2), key_of(3)};
  ASSERT_TRUE(put(ns_, keys[0], payload(1, 64)));
  ASSERT_TRUE(put(ns_, keys[2], payload(3, 64)));
  auto pins = pool_->acquire(ns_, keys.data(), keys.size());
  ASSERT_EQ(pins.size(), 1u);
  EXPECT_FALSE(pool_->remove(ns_, keys[0]));
  EXPECT_TRUE(pool_->remove(ns_, keys[2]));
  pool_->release(pins);
  EXPECT_TRUE(pool_->remove(ns_, keys[0]));
}

// Pinning most of the pool must not stop a put while an unpinned victim exists.
TEST_F(IndexTest, PartialPinsLeaveVictims) {
  const uint64_t cap = capacity();
  std::vector<Key> keys;
  for (uint64_t id = 0; id < cap; ++id) {
    keys.push_back(key_of(id));
    ASSERT_TRUE(put(ns_, keys.back(), payload(id, kBlock)));
  }
  auto pins = pool_->acquire(ns_, keys.data(), cap - 4);  // 4 unpinned blocks remain evictable
  ASSERT_EQ(pins.size(), cap - 4);
  for (uint64_t id = cap; id < cap + 4; ++id)
    EXPECT_TRUE(put(ns_, key_of(id), payload(id, kBlock)))
        << "put " << id - cap << " with unpinned victims left";
  for (uint64_t id = 0; id < cap - 4; ++id) ASSERT_TRUE(pool_->contains(ns_, keys[id]));
  pool_->release(pins);
}

TEST_F(IndexTest, CorruptPayloadFailsChecksum) {
  for (uint64_t id = 0; id < 3; ++id) ASSERT_TRUE(put(ns_, key_of(id), payload(id, kBlock)));
  RawMap raw(path_);
  uint64_t victim_slot = ~0ull;
  for (uint64_t s : raw.ready_slots())
    if (std::memcmp(raw.entry(s)->key, key_of(1).data(), 32) == 0) victim_slot = s;
  ASSERT_NE(victim_slot, ~0ull);
  const auto* e = raw.entry(victim_slot);
  EXPECT_EQ(e->length, kBlock);
  char* pay = raw.payload(e->chunk, e->block, ns_.geo.block_stride);
  ASSERT_EQ(std::memcmp(pay, payload(1, kBlock).data(), kBlock), 0) << "payload not where the format says";
  pay[kBlock / 2] ^= 0x5A;

  EXPECT_FALSE(get(ns_, key_of(1)).has_value());
  EXPECT_EQ(pool_->counters()[format::kChecksumFailures], 1u);
  EXPECT_FALSE(pool_->contains(ns_, key_of(1)));  // dropped so a later put stores good bytes
  EXPECT_EQ(*get(ns_, key_of(0)), payload(0, kBlock));
  EXPECT_EQ(*get(ns_, key_of(2)), payload(2, kBlock));
  ASSERT_TRUE(put(ns_, key_of(1), payload(1, kBlock)));
  EXPECT_EQ(*get(ns_, key_of(1)), payload(1, kBlock));
  auto r = pool_->check();
  EXPECT_TRUE(r.ok) << join(r.errors);
}

TEST_F(IndexTest, CorruptChunkFieldIsDetected) {
  for (uint64_t id = 0; id < 3; ++id) ASSERT_TRUE(put(ns_, key_of(id), payload(id, kBlock)));
  RawMap raw(path_);
  uint64_t victim_slot = ~0ull;
  for (uint64_t s : raw.ready_slots())
    if (std::memcmp(raw.entry(s)->key, key_of(2).data(), 32) == 0) victim_slot = s;
  ASSERT_NE(victim_slot, ~0ull);
  raw.entry(victim_slot)->chunk = 0xFFFFFFFFu;

  EXPECT_FALSE(get(ns_, key_of(2)).has_value());
  EXPECT_GE(pool_->counters()[format::kCorruptEntries], 1u);
  EXPECT_EQ(*get(ns_, key_of(0)), payload(0, kBlock));
  auto r = pool_->check();
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.errors.empty());
  // Also an out-of-range block and an oversized length are refused without a crash.
  uint64_t s0 = ~0ull;
  for (uint64_t s : raw.ready_slots())
    if (std::memcmp(raw.entry(s)->key, key_of(0).data(), 32) == 0) s0 = s;
  ASSERT_NE(s0, ~0ull);
  raw.entry(s0)->block = 0xFFFF;
  EXPECT_FALSE(get(ns_, key_of(0)).has_value());
  uint64_t s1 = ~0ull;
  for (uint64_t s : raw.ready_slots())
    if (std::memcmp(raw.entry(s)->key, key_of(1).data(), 32) == 0) s1 = s;
  ASSERT_NE(s1, ~0ull);
  raw.entry(s1)->length = uint32_t(kBlock + 64);
  EXPECT_FALSE(get(ns_, key_of(1)).has_value());
  EXPECT_FALSE(pool_->check().ok);
}

}  // namespace
}  // namespace cxlkv::test
