// The per-row check of token blocks (token_rows.h, format version 5), and a kernel that copies a
// row and computes its check in one pass (the gather's: token_rows.cpp).
//
// check(row, n, seed) = check_mix(fold(S, P) ^ seed ^ n * K). The row is read as 32-byte pieces
// (the last n % 32 bytes zero-padded to one) into two sets of four 64-bit lanes:
// * S, sums: lane i gains the piece's 64-bit word i (one vpaddq);
// * P, products: each 32-bit half of lane i gains w0 * k0 + w1 * k1 (mod 2^32) for its two signed
//   16-bit words w0, w1 of the piece, with keys k of the piece's position mod 16 (256 distinct odd
//   constants): one vpmaddwd and one vpaddd per piece; after every 16 pieces each 32-bit half of P
//   is tripled (two adds), so pieces 16 apart, which share keys, are weighted apart.
// fold: v_i = S_i + (P_i with its halves swapped), u = v_0 + rotl(v_1, 16) + rotl(v_2, 32) +
// rotl(v_3, 48); check_mix() (a bijection) then spreads every bit of u and of the seed over the
// result. There is no vector multiply and no per-row vector scramble (format 4 had two per row):
// that is what lets one pass per row overlap one row's arithmetic with the next rows' cache misses.
//
// What it is for, and why it suffices: an integrity check against stray writes (a bug or a device
// writing into a pinned block), torn rows (a row rewritten under a reader, a block freed and reused)
// and stale or foreign bytes (another sequence, layer or position: the seed differs). It is not a
// MAC: the pool's threat model (docs/ARCHITECTURE.md, "Integrity at row granularity") is that of
// faults and bugs, and a writer that can write the pool can also write a matching check (as with
// format 4: no change there). Against those causes:
// * a change confined to one 32-bit half of one 8-byte lane of one piece (any single-bit or
//   single-word error, a torn write of at most 4 aligned bytes) always changes v_i, so u: in the low
//   half it changes S_i's low 32 bits and v_i's low half, which gets P's other half (fed only by the
//   high words) swapped in; in the high half it changes S_i's high 32 bits (by d2 + d3 * 2^16 for the
//   words' changes d, |d| < 2^16, nonzero) and v_i's high half, which gets P's low half (fed only by
//   the low words). A change across both halves of a lane is caught unless it cancels in both
//   halves at once (values tied to the keys: ~2^-64 at random);
// * a word swapped with its pair partner, or a piece moved by 1-15 pieces, changes P (distinct
//   odd keys), one moved by 16 the tripling (S alone cannot see a move);
// * anything else that changes the lanes (a random, torn or foreign row) reaches the 64-bit result
//   but with a chance near 2^-64 of matching; changes that cancel in S and P both need several
//   words changed with values tied to the keys (~2^-32 for such a pattern at random), and a stray
//   writer does not know them. What it gives up against format 4: nothing a fault produces; its
//   fold is linear before check_mix, so crafted collisions are easier, which only an adversary
//   with write access to the pool could exploit, and that adversary already defeats any unkeyed
//   check.
//
// Kernels (picked once per process; every one returns the same value, tests/cpp/test_token_rows.cpp
// compares them on every length 1..1,200, rows over several 16-piece rounds and extreme patterns):
// * AVX-512 (F + BW): two pieces per 64-byte register (lanes 0-3 the even piece, 4-7 the odd one,
//   added before the fold); the tail is a byte-masked load and store;
// * AVX2: one piece per register; the tail is loaded in 16/8/4/2/1-byte parts;
// * scalar: memcpy, then the check over dst (the reference the others are tested against).
// Each vector kernel loads every byte of the row once into a register, stores that register to dst
// and accumulates it: nothing past the row is read or written, and a concurrent writer of src can
// make the check fail, never make it match bytes other than those that reached dst.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace cxlkv::tokens {

// The check of n bytes at row (n >= 1).
uint64_t row_check(const void* row, size_t n, uint64_t seed);

// Copies n bytes src -> dst (not overlapping) and returns row_check of the bytes that reached dst.
uint64_t copy_row_check(char* dst, const char* src, size_t n, uint64_t seed);

// splitmix64's finalizer, the bijective mix of row_check and row_seed.
uint64_t check_mix(uint64_t x);

// "avx512" / "avx2" / "scalar": the kernels row_check and copy_row_check use on this CPU.
const char* row_check_kernel_name();

// The portable definition (the reference the vector kernels are tested against).
uint64_t row_check_scalar(const void* row, size_t n, uint64_t seed);

// Every copy_row_check kernel this CPU can run, the picked one among them (tests compare them all).
struct RowCheckKernel {
  const char* name;
  uint64_t (*copy_check)(char* dst, const char* src, size_t n, uint64_t seed);
  uint64_t (*check)(const void* row, size_t n, uint64_t seed);
};
std::vector<RowCheckKernel> row_check_kernels();

}  // namespace cxlkv::tokens
