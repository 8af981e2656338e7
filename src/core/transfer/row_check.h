// The per-row check of token blocks (token_rows.h, format version 2), and a kernel that copies a
// row and computes its check in one pass (measured against the gather's copy-then-check batches in
// src/bench/gather_micro.cpp; the gather uses row_check over the delivered bytes).
//
// check(row, n, seed) = check_mix(fold(acc) ^ seed ^ n * P), where acc is XXH3-64's stripe
// accumulator (xxHash's published algorithm: eight 64-bit lanes, acc[i ^ 1] += d[i],
// acc[i] += lo32(d[i] ^ key[i]) * hi32(same), a scramble after every 16 stripes; default secret)
// run over the row's whole 64-byte stripes and then its last n % 64 bytes zero-padded to a stripe,
// and fold() scrambles every lane once more with its own key and adds them. It is not XXH3's value
// (format 1 checked XXH3-64 of the row): XXH3 hashes its last 64 bytes again as an overlapping
// stripe and merges with four 128-bit products, which a one-pass copy+check kernel cannot do from
// the registers it stores without realigning the tail; a zero-padded tail stripe and a
// few-instruction finish can. check_mix() (a bijection) then spreads every bit
// of the folded lanes and of the seed over the result. Strength: every byte of the row enters a
// 32x32-bit product and a plain sum, each lane with its own key per stripe position, so a changed,
// moved or foreign row matches with a probability near 2^-64 (it is an integrity check against
// faults, stale and foreign bytes, not a MAC against an adversary that can write the pool).
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
