// Token-addressable, layer-first blocks (SAC §4.3.1): the row store behind `pool.token_store`.
//
// A sequence's rows are cut into chunks of `tokens_per_block` tokens; chunk c is ONE pool block of
// a token namespace (an ordinary namespace: index, pins, eviction and the whole-block checksum of
// put/get all apply). Inside the block the rows are layer-first, so the rows of one layer for a
// chunk are contiguous and a top-k gather of one layer touches only the rows it asks for. Each row
// is followed by its check, in one slot of `row_stride` bytes (formats 4 and 5):
//
//   [0, payload)             slots: slot (layer l, token t) at (l * T + t) * S, S = row_stride():
//                              [0, R)        the row's bytes
//                              [R, R8)       zero (R8 = R rounded up to 8; none for R % 8 == 0)
//                              [R8, R8 + 8)  the row's check: row_check of its R bytes with the seed
//                                            of (sequence, stream, layer, position) (row_check.h,
//                                            row_seed below)
//   [header_off, +64)        TokenBlockHeader (below), header_off = payload rounded up to 64
//
// Why beside the row (format 3 kept all checks after the rows): a gather reads the row's lines and
// its check; stored apart, the check was one more DRAM miss (and, in blocks past 4 KiB, one more
// TLB miss) per row. Beside it, the check shares the row's last line (656-B rows: 11.25 lines per
// row on average instead of 12; 1,152-B rows: 19 lines either way, but the same page).
//
// Integrity at row granularity: a gather checks every row it delivered (the bytes that reached
// the caller's memory: the same registers that were stored there, never the pool's bytes read again)
// and compares it with the row's stored check. The seed binds a
// row to its sequence, stream, layer and absolute position, so bytes of another block, another sequence or a
// reused block never verify: a sequence evicted, overwritten or corrupted under a reader is a
// miss, never wrong rows (probability ~2^-64 per row). Cost: one check per row read, not per block.
//
// The block's bytes are payload to the pool format (format.h is unchanged); their own format is
// versioned here (kTokenBlockVersion) and part of the namespace identity through block_bytes and
// the namespace name the Python layer gives (python/cxlkv/token_store.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "arena_view.h"
#include "row_check.h"
#include "store_types.h"

namespace cxlkv::tokens {

constexpr uint64_t kTokenBlockMagic = 0x4b4f54564b4c5843ull;  // "CXLKVTOK" little-endian
// 5: format 4's slots and seeds with row_check.h's one-pass check (32-byte pieces, sums and products,
// no vector multiply; the gather copies and checks each row in one pass); 4: format 3's check and
// seeds, each check stored beside its row (the slots above); 3: the row
// check of row_check.h (products and sums, three vector operations per 64 bytes) with the seeds
// below, all checks after the rows; 2: XXH3's stripe accumulator per row, four mixes per seed; 1:
// check_mix(XXH3-64 of the row ^ seed). A block of another version is foreign to resolve_blocks (a miss), and
// the version is part of every block's key (token_store.py), so a reader never checks rows of one version
// with another's check.
constexpr uint32_t kTokenBlockVersion = 5;

// Invariants: written once by the block's writer before put(); header_hash = XXH3-64 of the 56
// bytes before it; 1 <= valid_tokens <= tokens_per_block; rows at positions >= valid_tokens are
// zero, their checks too (never read: a gather refuses indices >= the sequence length); the pad
// bytes [R, R8) of every slot and [payload, header_off) are zero.
struct TokenBlockHeader {
  uint64_t magic;
  uint32_t version, stream;
  uint32_t layers, tokens_per_block;
  uint32_t row_bytes, valid_tokens;
  uint64_t chunk;     // index of this block in its sequence: tokens [chunk*T, chunk*T + valid)
  uint64_t seq_hash;  // the sequence this block belongs to (token_store.py derives it)
  uint64_t reserved;  // 0
  uint64_t header_hash;
};
static_assert(sizeof(TokenBlockHeader) == 64);

struct TokenGeometry {
  uint32_t layers = 0, tokens_per_block = 0, row_bytes = 0;
  // Throws ArgumentError on a zero field or a block too large to describe.
  static TokenGeometry make(uint64_t layers, uint64_t tokens_per_block, uint64_t row_bytes);
  uint64_t rows() const { return uint64_t(layers) * tokens_per_block; }
  // Bytes of one row's slot: the row rounded up to 8, then its 8-byte check.
  uint64_t row_stride() const { return check_at() + 8; }
  // Where a row's check lies inside its slot.
  uint64_t check_at() const { return (uint64_t(row_bytes) + 7) / 8 * 8; }
  uint64_t payload_bytes() const { return rows() * row_stride(); }
  uint64_t header_off() const { return (payload_bytes() + 63) / 64 * 64; }
  uint64_t block_bytes() const { return header_off() + sizeof(TokenBlockHeader); }
  uint64_t row_off(uint32_t layer, uint32_t t) const {
    return (uint64_t(layer) * tokens_per_block + t) * row_stride();
  }
  uint64_t check_off(uint32_t layer, uint32_t t) const { return row_off(layer, t) + check_at(); }
};

// The seed of the rows of one layer of a sequence's stream (two mixes, computed once per layer a
// gather touches), and of row (layer, position): the layer's seed ^ (position + 1) * an odd constant,
// one multiply per row. The check's final mix (row_check.h) takes it with the row's folded lanes, so
// a row at another position, layer, stream or sequence never verifies with its own bytes (distinct
// positions give distinct seeds of one layer: the multiply is a bijection), and with other bytes
// with a probability near 2^-64.
constexpr uint64_t kLayerSeedSalt = 0x6A09E667F3BCC909ull;  // sqrt(2)'s fraction (SHA-512's first word)
constexpr uint64_t kPositionMul = 0xD6E8FEB86659FD93ull;    // odd
uint64_t layer_seed(uint64_t seq_hash, uint32_t stream, uint32_t layer);
inline uint64_t row_seed(uint64_t layer_seed, uint64_t position) {
  return layer_seed ^ ((position + 1) * kPositionMul);
}

// Completes a block the caller filled with rows (at row_off; positions >= valid zeroed here): the
// rows' checks, the zero pads and the header. `block` holds g.block_bytes() bytes.
void seal_block(char* block, const TokenGeometry& g, uint64_t seq_hash, uint32_t stream, uint64_t chunk,
                uint32_t valid_tokens);

// Where a key's block lies: pool offset and length (Pool::locate); false if absent.
using LocateBlock = std::function<bool(const Key&, uint64_t*, uint64_t*)>;

// One pinned block of a sequence: where its bytes lie in the pool and how many tokens it holds.
struct ResolvedBlock {
  uint64_t offset;
  uint32_t valid_tokens;
};

// Locates keys[i] (chunk first_chunk + i of the sequence) and checks each block's header against
// what the caller expects. Returns the leading blocks that are present and well-formed; the first
// absent or foreign one stops the list (the caller should hold pins on them: see token_store.py).
// `locate` finds a key's block (Pool::locate), `arena` reads its header (Pool::arena_view).
std::vector<ResolvedBlock> resolve_blocks(const ArenaView& arena, const LocateBlock& locate,
                                          const NsHandle& ns, const TokenGeometry& g, const Key* keys,
                                          size_t n, uint64_t seq_hash, uint32_t stream, uint64_t first_chunk);

// What one gather asks for (its rows are read through an ArenaView: arena_view.h). offsets[c]: pool offset of
// chunk c's block (from resolve_blocks); n_tokens: the sequence length the caller resolved (every index must
// be below it).
struct SeqRows {
  const TokenGeometry* g;
  uint64_t seq_hash;
  uint32_t stream;
  uint64_t n_tokens;
  const uint64_t* offsets;
  size_t n_blocks;
};

// The result of a gather: ok, an index out of range (bad_pos: its position in `indices`), or a
// row that failed verification / lies outside the arena (a miss: bad_pos names it).
struct GatherResult {
  enum Status { kOk, kIndexOutOfRange, kMiss } status = kOk;
  size_t bad_pos = 0;
  int64_t bad_index = 0;
  uint32_t bad_layer = 0;
};

// Copies rows into out: for j in [0, n_layers) and i in [0, k), the row (first_layer + j,
// indices[j * k + i]) (indices_per_layer) or (first_layer + j, indices[i]) (shared) goes to
// out + (j * k + i) * row_bytes. Every delivered row is verified; all indices are checked before
// any byte is copied.
GatherResult gather_rows(const ArenaView& arena, const SeqRows& s, uint32_t first_layer, uint32_t n_layers,
                         const int64_t* indices, size_t k, bool indices_per_layer, char* out);

}  // namespace cxlkv::tokens
