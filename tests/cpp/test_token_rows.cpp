// Token blocks (src/core/token_rows.*): sealed blocks resolve and gather exactly, indices out of
// range are refused before any copy, and a row whose bytes changed in the pool (or a block of
// another sequence or chunk) never verifies.
#include <random>

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
  auto r = tokens::resolve_blocks(*pool, ns, g, keys.data(), 3, seq, 0, 0);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[2].valid_tokens, 8u);
  EXPECT_TRUE(tokens::resolve_blocks(*pool, ns, g, keys.data(), 3, seq ^ 1, 0, 0).empty());  // other sequence
  EXPECT_TRUE(tokens::resolve_blocks(*pool, ns, g, keys.data() + 1, 2, seq, 0, 0).empty());  // wrong chunk
  std::vector<uint64_t> offs{r[0].offset, r[1].offset, r[2].offset};
  tokens::SeqRows s{&g, seq, 0, n_tokens, offs.data(), offs.size()};
  const std::vector<int64_t> idx{39, 0, 0, 17, 16, 31};
  std::vector<char> out(idx.size() * 656, char(0xA5));
  auto res = tokens::gather_rows(*pool, s, 2, 1, idx.data(), idx.size(), false, out.data());
  ASSERT_EQ(res.status, GatherResult::kOk);
  for (size_t i = 0; i < idx.size(); ++i) {
    const auto& b = blocks[idx[i] / 16];
    EXPECT_EQ(std::memcmp(out.data() + i * 656, b.data() + g.row_off(2, idx[i] % 16), 656), 0) << i;
  }
  const int64_t bad[] = {3, 40};
  res = tokens::gather_rows(*pool, s, 0, 1, bad, 2, false, out.data());
  EXPECT_EQ(res.status, GatherResult::kIndexOutOfRange);
  EXPECT_EQ(res.bad_pos, 1u);
  // one byte of row (layer 1, token 20) changes in the pool: that row is a miss, others are not
  char* row = const_cast<char*>(pool->arena_bytes(offs[1] + g.row_off(1, 4), 656));
  ASSERT_NE(row, nullptr);
  row[300] ^= 1;
  const int64_t hit[] = {20};
  EXPECT_EQ(tokens::gather_rows(*pool, s, 0, 1, hit, 1, false, out.data()).status, GatherResult::kOk);
  res = tokens::gather_rows(*pool, s, 1, 1, hit, 1, false, out.data());
  EXPECT_EQ(res.status, GatherResult::kMiss);
  EXPECT_EQ(res.bad_index, 20);
  // offsets outside the arena are a miss, never a read
  std::vector<uint64_t> wild{~0ull / 2, offs[1], offs[2]};
  tokens::SeqRows w{&g, seq, 0, n_tokens, wild.data(), wild.size()};
  const int64_t first[] = {0};
  EXPECT_EQ(tokens::gather_rows(*pool, w, 0, 1, first, 1, false, out.data()).status, GatherResult::kMiss);
  pool->release(pins);
}

TEST_F(TokenRows, GeometryRefusesNonsense) {
  EXPECT_THROW(TokenGeometry::make(0, 16, 656), ArgumentError);
  EXPECT_THROW(TokenGeometry::make(61, 0, 656), ArgumentError);
  EXPECT_THROW(TokenGeometry::make(61, 64, 0), ArgumentError);
  const auto g = TokenGeometry::make(61, 64, 1152);
  EXPECT_EQ(g.payload_bytes(), 61u * 64 * 1152);
  EXPECT_EQ(g.block_bytes() % 64, 0u);
  EXPECT_GE(g.hashes_off(), g.payload_bytes());
}

}  // namespace
}  // namespace cxlkv::test
