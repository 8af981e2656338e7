// Token-addressable blocks: sealing, resolving and row gathers (token_rows.h has the format).
#include "token_rows.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "checksum.h"
#include "copy_threads.h"
#include "errors.h"

namespace cxlkv::tokens {

namespace {

uint64_t header_hash(const TokenBlockHeader& h) { return xxh3(&h, offsetof(TokenBlockHeader, header_hash)); }

}  // namespace

TokenGeometry TokenGeometry::make(uint64_t layers, uint64_t tokens_per_block, uint64_t row_bytes) {
  constexpr uint64_t kMax32 = std::numeric_limits<uint32_t>::max();
  if (layers == 0 || tokens_per_block == 0 || row_bytes == 0 || layers > 4096 || tokens_per_block > 65536 ||
      row_bytes > (1u << 20))
    throw ArgumentError(
        "token geometry out of range: layers 1..4096, tokens_per_block 1..65536, row bytes "
        "1..1 MiB (got " +
        std::to_string(layers) + ", " + std::to_string(tokens_per_block) + ", " + std::to_string(row_bytes) +
        ")");
  TokenGeometry g{uint32_t(layers), uint32_t(tokens_per_block), uint32_t(row_bytes)};
  if (g.block_bytes() > kMax32 * 16) throw ArgumentError("token block too large");
  return g;
}

uint64_t layer_seed(uint64_t seq_hash, uint32_t stream, uint32_t layer) {
  return check_mix(seq_hash ^ check_mix((uint64_t(stream) << 48) ^ (uint64_t(layer) << 32) ^ kLayerSeedSalt));
}

void seal_block(char* block, const TokenGeometry& g, uint64_t seq_hash, uint32_t stream, uint64_t chunk,
                uint32_t valid_tokens) {
  if (valid_tokens == 0 || valid_tokens > g.tokens_per_block)
    throw ArgumentError("valid_tokens must be 1.." + std::to_string(g.tokens_per_block));
  std::memset(block + g.payload_bytes(), 0, g.header_off() - g.payload_bytes());
  const uint64_t base_pos = chunk * g.tokens_per_block, R = g.row_bytes, S = g.row_stride();
  for (uint32_t l = 0; l < g.layers; ++l) {
    const uint64_t ls = layer_seed(seq_hash, stream, l);
    for (uint32_t t = 0; t < g.tokens_per_block; ++t) {
      char* slot = block + g.row_off(l, t);
      if (t >= valid_tokens) {
        std::memset(slot, 0, S);
        continue;
      }
      std::memset(slot + R, 0, S - R);  // the pad, then the check
      const uint64_t h = row_check(slot, R, row_seed(ls, base_pos + t));
      std::memcpy(slot + g.check_at(), &h, 8);
    }
  }
  TokenBlockHeader hdr{kTokenBlockMagic,
                       kTokenBlockVersion,
                       stream,
                       g.layers,
                       g.tokens_per_block,
                       g.row_bytes,
                       valid_tokens,
                       chunk,
                       seq_hash,
                       0,
                       0};
  hdr.header_hash = header_hash(hdr);
  std::memcpy(block + g.header_off(), &hdr, sizeof hdr);
}

std::vector<ResolvedBlock> resolve_blocks(const ArenaView& arena, const LocateBlock& locate,
                                          const NsHandle& ns, const TokenGeometry& g, const Key* keys,
                                          size_t n, uint64_t seq_hash, uint32_t stream,
                                          uint64_t first_chunk) {
  std::vector<ResolvedBlock> out;
  if (ns.block_bytes != g.block_bytes())
    throw ArgumentError("namespace block size " + std::to_string(ns.block_bytes) +
                        " is not the token block size " + std::to_string(g.block_bytes()));
  for (size_t i = 0; i < n; ++i) {
    uint64_t off = 0, len = 0;
    if (!locate(keys[i], &off, &len) || len != g.block_bytes()) break;
    const char* hp = arena.bytes(off + g.header_off(), sizeof(TokenBlockHeader));
    if (!hp) break;
    TokenBlockHeader h;  // a private copy: validated, then believed
    std::memcpy(&h, hp, sizeof h);
    const bool ok = h.magic == kTokenBlockMagic && h.version == kTokenBlockVersion && h.stream == stream &&
                    h.layers == g.layers && h.tokens_per_block == g.tokens_per_block &&
                    h.row_bytes == g.row_bytes && h.valid_tokens >= 1 &&
                    h.valid_tokens <= g.tokens_per_block && h.chunk == first_chunk + i &&
                    h.seq_hash == seq_hash && h.reserved == 0 && h.header_hash == header_hash(h);
    if (!ok) break;
    out.push_back({off, h.valid_tokens});
    if (h.valid_tokens < g.tokens_per_block) break;  // a partial block ends the sequence
  }
  return out;
}

namespace {
// Gathers and verifies output rows [lo, hi) of a gather_rows call: row r is rank r % k of layer
// first_layer + r / k, its index indices[r] (per layer) or indices[r % k], its bytes at out + r * R.
//
// One pass per row (format 5): copy_row_check loads each 32-byte piece of the row once, stores it to
// out and folds it into the row's check from the same register; the stored check (the slot's last 8
// bytes, on the row's last line) is compared right after. Why one pass (BENCHMARKS.md, "Token format
// 5"): format 4 copied a batch of rows, then checked the batch in L1, so the check's arithmetic was
// serialised after the copies (0.64-0.71x of a packed memcpy); a one-pass kernel lets the CPU run one
// row's arithmetic under the next rows' cache misses. Format 4's one-pass kernel (AVX-512, with a
// vector-multiply scramble per row) was 2-10x slower than its two phases; without vector multiplies
// in the row's pass (format 5's scalar fold) it still ran ~0.7x. The likely reason (an estimate from
// instruction counts; no perf on the VM measured): a 656-B row's pass is ~140 instructions, so the
// reorder buffer holds only 3-4 rows' cache misses, where glibc's memcpy of a row is ~50. So the loop
// also prefetches the first two lines of the row kAhead rows ahead (a prefetch retires without
// waiting for its line, so it keeps misses in flight beyond the reorder buffer; the hardware's
// prefetchers appear to fetch the rest of the row). kAhead = 8 and two lines measured best among
// 4/6/8/12/16 rows and 1/2/3/all lines (BENCHMARKS.md, "Token format 5").
constexpr size_t kAhead = 8;
// `arena` by value: a local copy that no store to `out` (char*, which may alias anything) can change,
// so its three fields are never reloaded through a pointer (registers or this frame's own slots).
GatherResult gather_range(ArenaView arena, const SeqRows& s, uint32_t first_layer, const int64_t* indices,
                          size_t k, bool indices_per_layer, char* out, size_t lo, size_t hi) {
  const TokenGeometry& g = *s.g;
  const uint64_t R = g.row_bytes, S = g.row_stride(), check_at = g.check_at(), block_bytes = g.block_bytes();
  const uint32_t T = g.tokens_per_block;
  // Index math without a division per row (a 64-bit divide costs as much as a quarter of a short
  // row's check): tokens_per_block is a power of two in every layout we know (a shift), and the
  // layer and rank of a row advance with it.
  const bool t_pow2 = (T & (T - 1)) == 0;
  const unsigned t_shift = unsigned(__builtin_ctz(T));
  GatherResult r;
  uint32_t layer = first_layer + uint32_t(lo / k);
  size_t rank = lo % k;  // the row's place among its layer's k
  uint64_t seed = layer_seed(s.seq_hash, s.stream, layer);
  for (size_t row = lo; row < hi; ++row, ++rank) {
    if (rank == k) rank = 0, ++layer, seed = layer_seed(s.seq_hash, s.stream, layer);
    const uint64_t p = uint64_t(indices_per_layer ? indices[row] : indices[rank]);
    const uint64_t chunk = t_pow2 ? p >> t_shift : p / T;
    const uint32_t t = uint32_t(t_pow2 ? p & (T - 1) : p % T);
    if (rank + kAhead < k) {  // the same layer's row kAhead ahead (indices were all checked)
      const uint64_t p2 = uint64_t(indices_per_layer ? indices[row + kAhead] : indices[rank + kAhead]);
      const char* b2 = arena.bytes(s.offsets[t_pow2 ? p2 >> t_shift : p2 / T], block_bytes);
      if (b2) {
        const char* s2 = b2 + (uint64_t(layer) * T + uint32_t(t_pow2 ? p2 & (T - 1) : p2 % T)) * S;
        __builtin_prefetch(s2, 0, 3);
        __builtin_prefetch(s2 + 64, 0, 3);
      }
    }
    const char* blk = arena.bytes(s.offsets[chunk], block_bytes);
    bool ok = blk != nullptr;
    if (ok) {
      const char* slot = blk + (uint64_t(layer) * T + t) * S;  // g.row_off(layer, t)
      // The check of the bytes as delivered (the same registers were stored to out; the pool is never
      // read again): a concurrent writer can only make the comparison fail, never make it pass for
      // bytes other than those in out.
      const uint64_t got = copy_row_check(out + row * R, slot, R, row_seed(seed, p));
      uint64_t want;
      std::memcpy(&want, slot + check_at, 8);
      ok = got == want;
    }
    if (!ok) {
      r.status = GatherResult::kMiss, r.bad_pos = row, r.bad_index = int64_t(p), r.bad_layer = layer;
      return r;
    }
  }
  return r;
}

// A gather of at least this many bytes is split over the copy threads in contiguous row ranges.
// Each part's check phases run beside the other parts' copies; the hand-off to a parked worker costs a few
// microseconds: ~1% of a 1 MiB gather (~100-200 us here).
constexpr uint64_t kParallelGatherBytes = 1ull << 20;
constexpr size_t kMinRowsPerPart = 256;
}  // namespace

GatherResult gather_rows(const ArenaView& arena, const SeqRows& s, uint32_t first_layer, uint32_t n_layers,
                         const int64_t* indices, size_t k, bool indices_per_layer, char* out) {
  const TokenGeometry& g = *s.g;
  GatherResult r;
  const size_t n_idx = indices_per_layer ? size_t(n_layers) * k : k;
  for (size_t i = 0; i < n_idx; ++i) {
    if (indices[i] < 0 || uint64_t(indices[i]) >= s.n_tokens ||
        uint64_t(indices[i]) / g.tokens_per_block >= s.n_blocks) {
      r.status = GatherResult::kIndexOutOfRange, r.bad_pos = i, r.bad_index = indices[i];
      return r;
    }
  }
  const size_t rows = size_t(n_layers) * k;
  unsigned parts = 1;
  if (uint64_t(rows) * g.row_bytes >= kParallelGatherBytes)
    parts = unsigned(std::min<size_t>(copy_thread_count(), rows / kMinRowsPerPart));
  if (parts <= 1) return gather_range(arena, s, first_layer, indices, k, indices_per_layer, out, 0, rows);
  std::vector<GatherResult> part(parts);
  run_on_copy_threads(parts, [&](unsigned p) {
    part[p] = gather_range(arena, s, first_layer, indices, k, indices_per_layer, out, rows * p / parts,
                           rows * (p + 1) / parts);
  });
  for (const GatherResult& x : part)              // parts are ordered ranges: the first failure of the first
    if (x.status != GatherResult::kOk) return x;  // failing part is the first failing row
  return r;
}

}  // namespace cxlkv::tokens
