// XXH3's stripe step and accumulator scramble, one lane at a time: the portable kernels of the
// block checksum (checksum_kernels.cpp) and of the token rows' per-row check
// (transfer/row_check.cpp) share them. Written from xxHash's published algorithm description:
// acc[i ^ 1] += data[i]; acc[i] += lo32(data[i] ^ key[i]) * hi32(same); after a block of stripes,
// acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1.
#pragma once

#include <cstdint>
#include <cstring>

namespace cxlkv::xxh3k {

inline constexpr uint64_t kScrambleMul = 0x9E3779B1u;  // XXH3's PRIME32_1

inline uint64_t rd64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian hosts only (x86-64, aarch64): XXH3 reads little-endian words
}

inline void stripe_scalar(uint64_t* acc, const uint8_t* in, const uint8_t* key) {
  for (int i = 0; i < 8; ++i) {
    uint64_t d = rd64(in + 8 * i), dk = d ^ rd64(key + 8 * i);
    acc[i ^ 1] += d;
    acc[i] += (dk & 0xFFFFFFFFu) * (dk >> 32);
  }
}

inline void scramble_scalar(uint64_t* acc, const uint8_t* key) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= rd64(key + 8 * i);
    acc[i] = a * kScrambleMul;
  }
}

}  // namespace cxlkv::xxh3k
