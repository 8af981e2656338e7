// Token blocks (src/core/transfer/token_rows.*): sealed blocks resolve and gather exactly, indices out of
// range are refused before any copy, and a row whose bytes changed in the pool (or a block of
// another sequence or chunk) never verifies.
#include <atomic>
#include <numeric>
#include <random>
#include <thread>

#include "test_util.h"
#include "token_rows.h"

namespace cxlkv::test {
namespace {

using tokens::GatherResult;
using tokens::TokenGeometry;

class TokenRows : public PoolTest {};

Key key_of(uint64_t id) {
  Key k{};
  std::memcpy(k.data(), &id, 8);
  k[31] = 0x7d;
  return k;
}

// resolve_blocks over a Pool, as the binding calls it (bindings_tokens.cpp).
std::vector<tokens::ResolvedBlock> resolve(Pool& pool, const NsHandle& ns, const TokenGeometry& g,
                                           const Key* keys, size_t n, uint64_t seq, uint32_t stream,
                                           uint64_t first_chunk) {
  return tokens::resolve_blocks(
      pool.arena_view(),
      [&](const Key& k, uint64_t* off, uint64_t* len) { return pool.locate(ns, k, off, len); }, ns, g, keys,
      n, seq, stream, first_chunk);
}

// One block of random rows sealed as chunk 0 (64 tokens) of sequence seq, put under key_of(7),
// pinned and resolved: the fixture of the tests that corrupt or rewrite rows in place.
struct OneBlock {
  std::vector<char> bytes;
  uint64_t offset = 0;
  std::vector<PinRef> pins;
};
void put_one_block(Pool& pool, const NsHandle& ns, const TokenGeometry& g, uint64_t seq, std::mt19937_64& rng,
                   OneBlock& out) {
  out.bytes.resize(g.block_bytes());
  for (auto& b : out.bytes) b = char(rng());
  tokens::seal_block(out.bytes.data(), g, seq, 0, 0, 64);
  const Key key = key_of(7);
  Piece p{out.bytes.data(), g.block_bytes()};
  ASSERT_TRUE(pool.put(ns, key, &p, 1, 0));
  out.pins = pool.acquire(ns, &key, 1);
  auto r = resolve(pool, ns, g, &key, 1, seq, 0, 0);
  ASSERT_EQ(r.size(), 1u);
  out.offset = r[0].offset;
}

TEST_F(TokenRows, SealResolveGatherExactThenCorruptionIsAMiss) {
  const auto g = TokenGeometry::make(3, 16, 656);
  auto pool = create(opts(32 * MiB, 1 * MiB));
  auto ns = pool->open_namespace(layout("tokens", g.block_bytes()));
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seq = rng(), n_tokens = 40;  // two full chunks, one of 8 tokens
  std::vector<std::vector<char>> blocks(3, std::vector<char>(g.block_bytes()));
  std::vector<Key> keys;
  for (uint64_t c = 0; c < 3; ++c) {
    for (auto& b : blocks[c]) b = char(rng());
    const uint32_t valid = c < 2 ? 16 : 8;
    tokens::seal_block(blocks[c].data(), g, seq, 0, c, valid);
    keys.push_back(key_of(c));
    Piece p{blocks[c].data(), g.block_bytes()};
    ASSERT_TRUE(pool->put(ns, keys[c], &p, 1, 0));
  }
  auto pins = pool->acquire(ns, keys.data(), keys.size());
  ASSERT_EQ(pins.size(), 3u);
  auto r = resolve(*pool, ns, g, keys.data(), 3, seq, 0, 0);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[2].valid_tokens, 8u);
  EXPECT_TRUE(resolve(*pool, ns, g, keys.data(), 3, seq ^ 1, 0, 0).empty());  // other sequence
  EXPECT_TRUE(resolve(*pool, ns, g, keys.data() + 1, 2, seq, 0, 0).empty());  // wrong chunk
  std::vector<uint64_t> offs{r[0].offset, r[1].offset, r[2].offset};
  tokens::SeqRows s{&g, seq, 0, n_tokens, offs.data(), offs.size()};
  const std::vector<int64_t> idx{39, 0, 0, 17, 16, 31};
  std::vector<char> out(idx.size() * 656, char(0xA5));
  auto res = tokens::gather_rows(pool->arena_view(), s, 2, 1, idx.data(), idx.size(), false, out.data());
  ASSERT_EQ(res.status, GatherResult::kOk);
  for (size_t i = 0; i < idx.size(); ++i) {
    const auto& b = blocks[idx[i] / 16];
    EXPECT_EQ(std::memcmp(out.data() + i * 656, b.data() + g.row_off(2, idx[i] % 16), 656), 0) << i;
  }
  const int64_t bad[] = {3, 40};
  res = tokens::gather_rows(pool->arena_view(), s, 0, 1, bad, 2, false, out.data());
  EXPECT_EQ(res.status, GatherResult::kIndexOutOfRange);
  EXPECT_EQ(res.bad_pos, 1u);
  // one byte of row (layer 1, token 20) changes in the pool: that row is a miss, others are not
  char* row = const_cast<char*>(pool->arena_bytes(offs[1] + g.row_off(1, 4), 656));
  ASSERT_NE(row, nullptr);
  row[300] ^= 1;
  const int64_t hit[] = {20};
  EXPECT_EQ(tokens::gather_rows(pool->arena_view(), s, 0, 1, hit, 1, false, out.data()).status,
            GatherResult::kOk);
  res = tokens::gather_rows(pool->arena_view(), s, 1, 1, hit, 1, false, out.data());
  EXPECT_EQ(res.status, GatherResult::kMiss);
  EXPECT_EQ(res.bad_index, 20);
  // offsets outside the arena are a miss, never a read
  std::vector<uint64_t> wild{~0ull / 2, offs[1], offs[2]};
  tokens::SeqRows w{&g, seq, 0, n_tokens, wild.data(), wild.size()};
  const int64_t first[] = {0};
  EXPECT_EQ(tokens::gather_rows(pool->arena_view(), w, 0, 1, first, 1, false, out.data()).status,
            GatherResult::kMiss);
  pool->release(pins);
}

// The gather copies rows in batches and checks each batch after its copy (token_rows.cpp): a
// gather over many batches is exact, and a corrupt row anywhere in a batch (not only its first)
// is the miss reported, the first one in index order when there are several.
TEST_F(TokenRows, BatchedGatherExactAndFirstCorruptRowIsTheMiss) {
  const auto g = TokenGeometry::make(2, 64, 1152);
  auto pool = create(opts(64 * MiB, 1 * MiB));
  auto ns = pool->open_namespace(layout("tokens-batched", g.block_bytes()));
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seq = rng(), n_blocks = 8, n_tokens = n_blocks * 64;
  std::vector<std::vector<char>> blocks(n_blocks, std::vector<char>(g.block_bytes()));
  std::vector<Key> keys;
  for (uint64_t c = 0; c < n_blocks; ++c) {
    for (auto& b : blocks[c]) b = char(rng());
    tokens::seal_block(blocks[c].data(), g, seq, 0, c, 64);
    keys.push_back(key_of(100 + c));
    Piece p{blocks[c].data(), g.block_bytes()};
    ASSERT_TRUE(pool->put(ns, keys[c], &p, 1, 0));
  }
  auto pins = pool->acquire(ns, keys.data(), keys.size());
  auto r = resolve(*pool, ns, g, keys.data(), n_blocks, seq, 0, 0);
  ASSERT_EQ(r.size(), n_blocks);
  std::vector<uint64_t> offs;
  for (auto& b : r) offs.push_back(b.offset);
  tokens::SeqRows s{&g, seq, 0, n_tokens, offs.data(), offs.size()};
  const size_t k = 517;  // sixteen batches of 32 and a partial one
  std::vector<int64_t> idx(2 * k);
  for (auto& i : idx) i = int64_t(rng() % n_tokens);
  idx[0] = 0, idx[k - 1] = int64_t(n_tokens - 1), idx[k] = idx[k + 1];  // ends and a duplicate
  std::vector<char> out(idx.size() * 1152, char(0xA5));
  ASSERT_EQ(tokens::gather_rows(pool->arena_view(), s, 0, 2, idx.data(), k, true, out.data()).status,
            GatherResult::kOk);
  for (size_t i = 0; i < idx.size(); ++i) {
    const uint32_t layer = uint32_t(i / k);
    const auto& b = blocks[idx[i] / 64];
    ASSERT_EQ(std::memcmp(out.data() + i * 1152, b.data() + g.row_off(layer, idx[i] % 64), 1152), 0) << i;
  }
  // corrupt the rows gathered at positions 300 (third batch, not its first row) and 450 of layer 1
  auto corrupt = [&](size_t pos) {
    char* row = const_cast<char*>(
        pool->arena_bytes(offs[idx[k + pos] / 64] + g.row_off(1, uint32_t(idx[k + pos] % 64)), 1152));
    ASSERT_NE(row, nullptr);
    row[1151] ^= 0x40;
  };
  idx[k + 450] = (idx[k + 300] + 1) % int64_t(n_tokens);  // distinct rows
  for (size_t i = 0; i < k; ++i)                          // and gathered nowhere else in layer 1
    while (i != 300 && i != 450 && (idx[k + i] == idx[k + 300] || idx[k + i] == idx[k + 450]))
      idx[k + i] = int64_t(rng() % n_tokens);
  corrupt(450);
  corrupt(300);
  auto res = tokens::gather_rows(pool->arena_view(), s, 0, 2, idx.data(), k, true, out.data());
  EXPECT_EQ(res.status, GatherResult::kMiss);
  EXPECT_EQ(res.bad_pos, k + 300);
  EXPECT_EQ(res.bad_layer, 1u);
  EXPECT_EQ(res.bad_index, idx[k + 300]);
  EXPECT_EQ(tokens::gather_rows(pool->arena_view(), s, 0, 1, idx.data(), k, false, out.data()).status,
            GatherResult::kOk);
  pool->release(pins);
}

// Rows change under the gather (another thread toggles one byte in every row of a block, as a
// writer reusing it would): every gather is either a miss or exactly the sealed rows.
TEST_F(TokenRows, RowsChangingMidGatherAreAMissNeverWrongRows) {
  const auto g = TokenGeometry::make(1, 64, 656);
  auto pool = create(opts(32 * MiB, 1 * MiB));
  auto ns = pool->open_namespace(layout("tokens-racy", g.block_bytes()));
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seq = rng();
  OneBlock one;
  ASSERT_NO_FATAL_FAILURE(put_one_block(*pool, ns, g, seq, rng, one));
  const std::vector<char>& block = one.bytes;
  auto& pins = one.pins;
  tokens::SeqRows s{&g, seq, 0, 64, &one.offset, 1};
  char* rows = const_cast<char*>(pool->arena_bytes(one.offset, g.payload_bytes()));
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint64_t n = 0; !stop.load(std::memory_order_relaxed); ++n)
      for (uint32_t t = 0; t < 64; ++t)
        __atomic_fetch_xor(rows + g.row_off(0, t) + (n / 2) % 656, char(1),
                           __ATOMIC_RELAXED);  // odd passes undo
  });
  std::vector<int64_t> idx(200);
  for (auto& i : idx) i = int64_t(rng() % 64);
  std::vector<char> out(idx.size() * 656);
  size_t ok = 0, miss = 0;
  for (int round = 0; round < 2000; ++round) {
    auto res = tokens::gather_rows(pool->arena_view(), s, 0, 1, idx.data(), idx.size(), false, out.data());
    ASSERT_NE(res.status, GatherResult::kIndexOutOfRange);
    if (res.status == GatherResult::kMiss) {
      ++miss;
      continue;
    }
    ++ok;
    for (size_t i = 0; i < idx.size(); ++i)
      ASSERT_EQ(std::memcmp(out.data() + i * 656, block.data() + g.row_off(0, uint32_t(idx[i])), 656), 0)
          << "round " << round << " row " << i;
  }
  stop = true;
  writer.join();
  if (miss == 0) GTEST_LOG_(WARNING) << "the writer never changed a row under a gather";
  RecordProperty("ok", int(ok)), RecordProperty("miss", int(miss));
  pool->release(pins);
}

// The row check (row_check.h): every kernel this CPU has gives the scalar definition's value for
// every length 1..1,200 at any alignment of source and destination, copies exactly the row's
// bytes (nothing before or after dst), and every single-bit change, a swap of two stripes, another
// seed or a zero tail grown by one byte changes the check.
TEST(RowCheck, KernelsAgreeCopyExactlyAndEveryChangeIsSeen) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<char> src(1300), dst(1400);
  for (auto& b : src) b = char(rng());
  const auto kernels = tokens::row_check_kernels();
  ASSERT_GE(kernels.size(), 1u);
  for (size_t n = 1; n <= 1200; ++n) {
    const size_t so = rng() % 64, dofs = 1 + rng() % 64;
    const uint64_t seed = rng();
    const uint64_t want = tokens::row_check_scalar(src.data() + so, n, seed);
    ASSERT_EQ(tokens::row_check(src.data() + so, n, seed), want) << n;
    for (const auto& k : kernels) {
      std::fill(dst.begin(), dst.end(), char(0x5A));
      ASSERT_EQ(k.check(src.data() + so, n, seed), want) << k.name << " " << n;
      ASSERT_EQ(k.copy_check(dst.data() + dofs, src.data() + so, n, seed), want) << k.name << " " << n;
      ASSERT_EQ(std::memcmp(dst.data() + dofs, src.data() + so, n), 0) << k.name << " " << n;
      ASSERT_EQ(dst[dofs - 1], char(0x5A)) << k.name << " " << n;
      ASSERT_EQ(dst[dofs + n], char(0x5A)) << k.name << " " << n;
    }
  }
  for (size_t n : {656u, 1152u, 64u, 1u, 1100u}) {
    std::vector<char> row(src.begin(), src.begin() + long(n));
    const uint64_t seed = rng(), base = tokens::row_check(row.data(), n, seed);
    EXPECT_NE(tokens::row_check(row.data(), n, seed ^ 1), base);
    for (size_t bit = 0; bit < n * 8; ++bit) {
      row[bit / 8] ^= char(1 << (bit % 8));
      ASSERT_NE(tokens::row_check(row.data(), n, seed), base) << n << " bit " << bit;
      row[bit / 8] ^= char(1 << (bit % 8));
    }
    if (n >= 128) {
      std::vector<char> swapped(row);
      std::swap_ranges(swapped.begin(), swapped.begin() + 64, swapped.begin() + 64);
      EXPECT_NE(tokens::row_check(swapped.data(), n, seed), base);
    }
    // what format 5 sees: any change within one 8-byte lane of one piece (here two 16-bit words of
    // it: always within one 32-bit half, across halves all but a key-tied ~2^-64), a word swapped
    // with its pair partner, a stripe or a piece moved by 16
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<char> changed(row);
      const size_t lane = (rng() % (n / 8 ? n / 8 : 1)) * 8;
      for (int w = 0; w < 2; ++w) {
        const size_t at = lane + 2 * (rng() % 4) + rng() % 2;
        if (at < n) changed[at] = char(changed[at] ^ char(1 + rng() % 255));
      }
      if (changed != row)
        ASSERT_NE(tokens::row_check(changed.data(), n, seed), base) << n << " lane " << lane;
    }
    if (n >= 4) {
      std::vector<char> pair(row);
      std::swap_ranges(pair.begin(), pair.begin() + 2, pair.begin() + 2);
      if (pair != row) EXPECT_NE(tokens::row_check(pair.data(), n, seed), base);
    }
    if (n >= 17 * 64) {
      std::vector<char> moved(row);
      std::swap_ranges(moved.begin(), moved.begin() + 64, moved.begin() + 16 * 64);
      EXPECT_NE(tokens::row_check(moved.data(), n, seed), base);
    }
    if (n >= 17 * 32) {  // two 32-byte pieces with the same keys (16 pieces apart) swapped
      std::vector<char> moved(row);
      std::swap_ranges(moved.begin(), moved.begin() + 32, moved.begin() + 16 * 32);
      EXPECT_NE(tokens::row_check(moved.data(), n, seed), base);
    }
    std::vector<char> longer(row);
    longer.push_back(0);  // the zero padding of the tail stripe must not make lengths equal
    EXPECT_NE(tokens::row_check(longer.data(), n + 1, seed), base);
  }
}

// Format 5's vector kernels (AVX2: one 32-byte piece per step; AVX-512: two pieces per step, their
// halves added at the end, the tripling after 16 pieces shared) give the scalar definition's value on
// rows that cross several 16-piece rounds, on every tail length around a round's end, and on the
// patterns that stress the signed 16-bit products and the carries (all ones, all 0x80, zeros).
TEST(RowCheck, VectorKernelsEqualScalarAcrossRoundsAndExtremes) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<char> src(40000), dst(40100);
  const auto kernels = tokens::row_check_kernels();
  for (int fill : {-1, 0x00, 0xFF, 0x80, 0x7F}) {
    for (size_t i = 0; i < src.size(); ++i) src[i] = fill < 0 ? char(rng()) : char(fill);
    for (size_t n : {511u, 512u, 513u, 543u, 544u, 545u, 1023u, 1024u, 1025u, 1055u, 1056u, 1057u, 4096u,
                     16384u + 17, 32768u + 31, 39999u}) {
      const uint64_t seed = rng(), want = tokens::row_check_scalar(src.data(), n, seed);
      for (const auto& k : kernels) {
        ASSERT_EQ(k.check(src.data(), n, seed), want) << k.name << " " << n << " fill " << fill;
        ASSERT_EQ(k.copy_check(dst.data() + 3, src.data(), n, seed), want) << k.name << " " << n;
        ASSERT_EQ(std::memcmp(dst.data() + 3, src.data(), n), 0) << k.name << " " << n;
      }
    }
  }
}

// Token formats 4 and 5 (token_rows.h: each row's check in the row's own slot, after the row and a zero
// pad): one corrupt byte anywhere in a row's slot, whatever its value, is a miss of that row alone
// when it is a row or check byte (the gather names it, and every other row of the block still
// gathers exactly), and changes nothing delivered when it is a pad byte. A block sealed by another
// format version (its header says so) resolves to nothing: a miss.
TEST_F(TokenRows, FormatFiveAnyCorruptByteIsThatRowsMissOnly) {
  for (uint32_t R : {656u, 1152u, 132u}) {
    const auto g = TokenGeometry::make(2, 64, R);
    ASSERT_EQ(g.row_stride(), (R + 7) / 8 * 8 + 8);
    auto pool = create(opts(32 * MiB, 1 * MiB));
    auto ns = pool->open_namespace(layout("tokens-f4-" + std::to_string(R), g.block_bytes()));
    std::mt19937_64 rng(std::random_device{}());
    const uint64_t seq = rng();
    OneBlock one;
    ASSERT_NO_FATAL_FAILURE(put_one_block(*pool, ns, g, seq, rng, one));
    std::vector<char>& block = one.bytes;
    tokens::SeqRows s{&g, seq, 0, 64, &one.offset, 1};
    const uint64_t offset = one.offset;
    std::vector<int64_t> every(64), others;
    std::iota(every.begin(), every.end(), 0);
    for (int64_t t = 0; t < 64; ++t)
      if (t != 20) others.push_back(t);
    std::vector<char> out(2 * 64 * R);  // two layers of (at most) 64 rows
    char* slot = const_cast<char*>(pool->arena_bytes(offset + g.row_off(1, 20), g.row_stride()));
    ASSERT_NE(slot, nullptr);
    for (uint32_t b = 0; b < g.row_stride(); ++b) {
      const char flip = char(1 + rng() % 255);
      slot[b] ^= flip;
      auto res = tokens::gather_rows(pool->arena_view(), s, 0, 2, every.data(), 64, false, out.data());
      if (b >= R && b < g.check_at()) {  // a pad byte: never read, the row still verifies exactly
        ASSERT_EQ(res.status, GatherResult::kOk) << R << " pad byte " << b;
        ASSERT_EQ(std::memcmp(out.data() + (64 + 20) * R, block.data() + g.row_off(1, 20), R), 0);
        slot[b] ^= flip;
        continue;
      }
      ASSERT_EQ(res.status, GatherResult::kMiss) << R << " byte " << b;
      ASSERT_EQ(res.bad_layer, 1u);
      ASSERT_EQ(res.bad_index, 20);
      ASSERT_EQ(
          tokens::gather_rows(pool->arena_view(), s, 0, 2, others.data(), others.size(), false, out.data())
              .status,
          GatherResult::kOk)
          << R << " byte " << b;
      for (size_t i = 0; i < others.size(); i += 21)
        ASSERT_EQ(std::memcmp(out.data() + (others.size() + i) * R,
                              block.data() + g.row_off(1, uint32_t(others[i])), R),
                  0);
      slot[b] ^= flip;
    }
    ASSERT_EQ(tokens::gather_rows(pool->arena_view(), s, 0, 2, every.data(), 64, false, out.data()).status,
              GatherResult::kOk);
    pool->release(one.pins);
    // the same bytes under a version-4 header (its own hash right): foreign to a format-5 reader
    tokens::TokenBlockHeader h;
    std::memcpy(&h, block.data() + g.header_off(), sizeof h);
    ASSERT_EQ(h.version, 5u);
    h.version = 4;
    h.header_hash = xxh3(&h, offsetof(tokens::TokenBlockHeader, header_hash));
    std::memcpy(block.data() + g.header_off(), &h, sizeof h);
    const Key old_key = key_of(8);
    const Piece p{block.data(), g.block_bytes()};
    ASSERT_TRUE(pool->put(ns, old_key, &p, 1, 0));
    auto old_pins = pool->acquire(ns, &old_key, 1);
    EXPECT_TRUE(resolve(*pool, ns, g, &old_key, 1, seq, 0, 0).empty());
    pool->release(old_pins);
    pool.reset();
    ::unlink(path_.c_str());  // the next row size's pool takes the same path
  }
}

// seal_block's output depends only on the rows it was given: whatever the pads, checks and rows past
// valid_tokens held before, they come out zero (a resumed partial chunk is re-sealed and compared
// byte for byte: token_store.py), and each check sits at check_off.
TEST(TokenSeal, PadsAndUnusedSlotsAreZeroAndChecksSitBesideTheirRows) {
  const auto g = TokenGeometry::make(2, 8, 132);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<char> a(g.block_bytes()), b(g.block_bytes());
  for (auto& x : a) x = char(rng());
  for (auto& x : b) x = char(rng());
  for (uint32_t l = 0; l < 2; ++l)
    for (uint32_t t = 0; t < 5; ++t) std::memcpy(b.data() + g.row_off(l, t), a.data() + g.row_off(l, t), 132);
  tokens::seal_block(a.data(), g, 99, 0, 3, 5);
  tokens::seal_block(b.data(), g, 99, 0, 3, 5);
  ASSERT_EQ(a, b);
  for (uint32_t l = 0; l < 2; ++l)
    for (uint32_t t = 0; t < 8; ++t) {
      const char* slot = a.data() + g.row_off(l, t);
      for (uint64_t x = (t < 5 ? 132 : 0); x < g.check_at(); ++x) ASSERT_EQ(slot[x], 0) << l << " " << t;
      uint64_t c;
      std::memcpy(&c, a.data() + g.check_off(l, t), 8);
      const uint64_t want =
          t < 5 ? tokens::row_check(slot, 132, tokens::row_seed(tokens::layer_seed(99, 0, l), 3 * 8 + t)) : 0;
      ASSERT_EQ(c, want) << l << " " << t;
    }
}

TEST_F(TokenRows, GeometryRefusesNonsense) {
  EXPECT_THROW(TokenGeometry::make(0, 16, 656), ArgumentError);
  EXPECT_THROW(TokenGeometry::make(61, 0, 656), ArgumentError);
  EXPECT_THROW(TokenGeometry::make(61, 64, 0), ArgumentError);
  const auto g = TokenGeometry::make(61, 64, 1152);
  EXPECT_EQ(g.payload_bytes(), 61u * 64 * (1152 + 8));
  EXPECT_EQ(g.block_bytes() % 64, 0u);
  EXPECT_GE(g.header_off(), g.payload_bytes());
  EXPECT_EQ(g.check_off(1, 2) - g.row_off(1, 2), 1152u);
}

}  // namespace
}  // namespace cxlkv::test
