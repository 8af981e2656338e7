// The per-row check of token blocks (token_rows.h, format versions 3 and 4), and a kernel that copies a
// row and computes its check in one pass (src/bench/gather_micro.cpp measures both; the gather uses
// row_check over the delivered bytes).
//
// check(row, n, seed) = check_mix(fold(P, S) ^ seed ^ n * K). The row is read as 64-byte stripes
// (the last n % 64 bytes zero-padded to one) into two sets of eight 64-bit lanes:
// * P, products: each 32-bit half of lane i gains w0 * k0 + w1 * k1 (mod 2^32) for its two signed
//   16-bit words w0, w1 of the stripe, with keys k of the stripe's position mod 16 (512 distinct
//   odd constants): one vpmaddwd and one vpaddd per stripe;
// * S, sums: lane i gains the stripe's 64-bit word i (one vpaddq);
// after every 16 stripes both sets are scrambled (XXH3's scramble, (x ^ x >> 47 ^ key) * PRIME32_1,
// a bijection per lane) and fold() scrambles both once more with their own keys and adds the 16
// lanes. check_mix() (a bijection) then spreads every bit of that and of the seed over the result.
//
// Strength (an integrity check against faults, stale and foreign bytes, not a MAC against an
// adversary that can write the pool): a change within one 8-byte lane of one stripe always changes
// S; a word swapped with its pair partner, or a stripe moved by 1-15 stripes, always changes P
// (the keys differ and are odd, and |change x key| < 2^32); what changes the lanes reaches the
// 64-bit result but with a chance near 2^-64 of matching, and so does a random, stale or foreign
// row (its seed differs too). A structured change that cancels in P and S both needs several
// words changed with values tied to the keys (~2^-32 for such a pattern at random) before the fold.
// Format 2 (XXH3's stripe step: xor, shift, multiply, shuffle, two adds per stripe) has twice the
// vector operations, yet measured only 10-15% slower per 656-1,152-B row (BENCHMARKS.md, "Token
// format 3"); the gather serialises the check after the copies (token_rows.cpp), so the check's
// cost is what separates it from a memcpy.
//
// Kernels (picked once per process; every one returns the same value, tests/cpp/test_token_rows.cpp
// compares them on every length 1..1,200 and random seeds):
// * AVX-512 (F + BW): each 64-byte stripe of the row is loaded once into a register, stored to dst
//   and accumulated from that same register; the tail is a byte-masked load and store (nothing past
//   the row is read or written). So a concurrent writer of src can make the check fail, never make
//   it match bytes other than those that reached dst.
// * otherwise: memcpy, then the check over dst (the bytes as delivered), AVX2 or scalar.
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
