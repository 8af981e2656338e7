// The per-row check of token blocks and its kernels (row_check.h says what it is and why).
#include "row_check.h"

#include <cstring>

#include "checksum_kernels.h"  // XXH3's default secret
#include "cpu_features.h"
#include "xxh3_scalar.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cxlkv::tokens {

namespace {
using xxh3k::rd64;
using xxh3k::scramble_scalar;
using xxh3k::stripe_scalar;
constexpr uint64_t kP32_1 = 0x9E3779B1u;                // XXH3's scramble multiplier
constexpr uint64_t kLengthMul = 0x9E3779B185EBCA87ull;  // the row length enters the seed times this
constexpr size_t kStripe = xxh3k::kStripe;
constexpr uint32_t kStripesPerBlock = xxh3k::kStripesPerBlock;
constexpr size_t kScrambleKey = 128;  // the secret's bytes the scramble after 16 stripes uses
constexpr size_t kFoldKey = 96;       // the final scramble's own 64 bytes of the 192-byte secret

// XXH3's accumulator init (xxh3k::init's values), as one aligned constant: the vector kernels load
// it with one instruction (filling an Acc with eight scalar stores and loading it as one vector
// stalls on store forwarding, ~a third of a short row's check).
alignas(64) constexpr uint64_t kInit[8] = {
    0xC2B2AE3Du,           0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
    0x85EBCA77C2B2AE63ull, 0x85EBCA77u,           0x27D4EB2F165667C5ull, 0x9E3779B1u};

inline uint64_t finish(uint64_t folded, size_t n, uint64_t seed) {
  return check_mix(folded ^ seed ^ (uint64_t(n) * kLengthMul));
}

#if defined(__x86_64__)
#define CXLKV_ROWS_AVX2 __attribute__((target("avx2")))
CXLKV_ROWS_AVX2 inline __m256i stripe_avx2(__m256i acc, __m256i d, const uint8_t* key) {
  __m256i dk = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
  __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));  // acc[i ^ 1] += d[i]
  return _mm256_add_epi64(acc, _mm256_add_epi64(prod, swapped));
}
CXLKV_ROWS_AVX2 inline __m256i scramble_avx2(__m256i acc, const uint8_t* key) {
  const __m256i prime = _mm256_set1_epi32(int(kP32_1));
  acc = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  __m256i lo = _mm256_mul_epu32(acc, prime);
  __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

// (a function, not a lambda: a lambda does not inherit the target attribute)
CXLKV_ROWS_AVX2 inline void stripe2_avx2(__m256i& lo, __m256i& hi, const char* in, const uint8_t* key) {
  lo = stripe_avx2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)), key);
  hi = stripe_avx2(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32)), key + 32);
}

// The check over bytes already delivered (dst): two 256-bit halves per stripe.
CXLKV_ROWS_AVX2 uint64_t check_avx2(const void* row, size_t n, uint64_t seed) {
  const uint8_t* secret = xxh3k::default_secret();
  const char* p = static_cast<const char*>(row);
  __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInit));
  __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInit + 4));
  uint32_t s = 0;
  const size_t full = n / kStripe;
  for (size_t j = 0; j < full; ++j) {
    stripe2_avx2(lo, hi, p + kStripe * j, secret + 8 * s);
    if (++s == kStripesPerBlock) {
      lo = scramble_avx2(lo, secret + kScrambleKey);
      hi = scramble_avx2(hi, secret + kScrambleKey + 32);
      s = 0;
    }
  }
  if (const size_t t = n % kStripe) {
    alignas(64) char pad[kStripe] = {};
    std::memcpy(pad, p + kStripe * full, t);
    stripe2_avx2(lo, hi, pad, secret + 8 * s);
  }
  lo = scramble_avx2(lo, secret + kFoldKey);
  hi = scramble_avx2(hi, secret + kFoldKey + 32);
  __m256i sum = _mm256_add_epi64(lo, hi);
  __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  return finish(uint64_t(_mm_cvtsi128_si64(s2)) + uint64_t(_mm_extract_epi64(s2, 1)), n, seed);
}

#define CXLKV_ROWS_AVX512 __attribute__((target("avx512f,avx512bw")))
CXLKV_ROWS_AVX512 inline __m512i stripe_avx512(__m512i acc, __m512i d, const uint8_t* key) {
  __m512i dk = _mm512_xor_si512(d, _mm512_loadu_si512(key));
  __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
  __m512i swapped = _mm512_shuffle_epi32(d, _MM_PERM_BADC);  // acc[i ^ 1] += d[i]
  return _mm512_add_epi64(acc, _mm512_add_epi64(prod, swapped));
}
CXLKV_ROWS_AVX512 inline __m512i scramble_avx512(__m512i acc, const uint8_t* key) {
  const __m512i prime = _mm512_set1_epi32(int(kP32_1));
  acc = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), _mm512_loadu_si512(key));
  __m512i lo = _mm512_mul_epu32(acc, prime);
  __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(acc, 32), prime);
  return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

// One pass: each stripe is loaded once, stored to dst (kCopy) and accumulated from the same
// register. Plain stores, not streaming ones: the rows are read by the caller next, and a row's
// last line is shared with the next row's first in a packed output.
template <bool kCopy>
CXLKV_ROWS_AVX512 uint64_t check_avx512(char* dst, const char* src, size_t n, uint64_t seed) {
  const uint8_t* secret = xxh3k::default_secret();
  __m512i acc = _mm512_load_si512(kInit);
  uint32_t s = 0;
  const size_t full = n / kStripe;
  for (size_t j = 0; j < full; ++j) {
    __m512i d = _mm512_loadu_si512(src + kStripe * j);
    if constexpr (kCopy) _mm512_storeu_si512(dst + kStripe * j, d);
    acc = stripe_avx512(acc, d, secret + 8 * s);
    if (++s == kStripesPerBlock) {
      acc = scramble_avx512(acc, secret + kScrambleKey);
      s = 0;
    }
  }
  if (const size_t t = n % kStripe) {  // masked: no byte past the row is read or written
    const __mmask64 m = (uint64_t(1) << t) - 1;
    __m512i d = _mm512_maskz_loadu_epi8(m, src + kStripe * full);
    if constexpr (kCopy) _mm512_mask_storeu_epi8(dst + kStripe * full, m, d);
    acc = stripe_avx512(acc, d, secret + 8 * s);
  }
  acc = scramble_avx512(acc, secret + kFoldKey);
  // the lanes' sum by vector adds (GCC's _mm512_reduce_add_epi64 ends with a signed scalar add,
  // undefined on the overflow a hash sum has, and UBSan says so)
  __m256i s4 = _mm256_add_epi64(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  return finish(uint64_t(_mm_cvtsi128_si64(s2)) + uint64_t(_mm_extract_epi64(s2, 1)), n, seed);
}

uint64_t copy_check_avx512(char* dst, const char* src, size_t n, uint64_t seed) {
  return check_avx512<true>(dst, src, n, seed);
}
uint64_t check_only_avx512(const void* row, size_t n, uint64_t seed) {
  return check_avx512<false>(nullptr, static_cast<const char*>(row), n, seed);
}
uint64_t copy_check_avx2(char* dst, const char* src, size_t n, uint64_t seed) {
  std::memcpy(dst, src, n);
  return check_avx2(dst, n, seed);  // the bytes as delivered, never the source again
}
#endif

uint64_t copy_check_scalar(char* dst, const char* src, size_t n, uint64_t seed) {
  std::memcpy(dst, src, n);
  return row_check_scalar(dst, n, seed);
}

using CheckFn = uint64_t (*)(const void*, size_t, uint64_t);
using CopyCheckFn = uint64_t (*)(char*, const char*, size_t, uint64_t);

struct Kernels {
  CheckFn check = row_check_scalar;
  CopyCheckFn copy_check = copy_check_scalar;
  const char* name = "scalar";
  Kernels() {
#if defined(__x86_64__)
    const auto& f = cpu_features();
    if (f.avx512f && f.avx512bw) {
      check = check_only_avx512, copy_check = copy_check_avx512, name = "avx512";
    } else if (f.avx2) {
      check = check_avx2, copy_check = copy_check_avx2, name = "avx2";
    }
#endif
  }
};
const Kernels& kernels() {
  static const Kernels k;
  return k;
}
}  // namespace

// splitmix64's finalizer: a cheap bijective mix, so distinct (layer, position) give distinct seeds.
uint64_t check_mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t row_check_scalar(const void* row, size_t n, uint64_t seed) {
  xxh3k::Acc a;
  std::memcpy(a.v, kInit, sizeof kInit);
  const uint8_t* secret = xxh3k::default_secret();
  const uint8_t* p = static_cast<const uint8_t*>(row);
  uint32_t s = 0;
  const size_t full = n / kStripe;
  for (size_t j = 0; j < full; ++j) {
    stripe_scalar(a.v, p + kStripe * j, secret + 8 * s);
    if (++s == kStripesPerBlock) {
      scramble_scalar(a.v, secret + kScrambleKey);
      s = 0;
    }
  }
  if (const size_t t = n % kStripe) {
    alignas(64) uint8_t pad[kStripe] = {};
    std::memcpy(pad, p + kStripe * full, t);
    stripe_scalar(a.v, pad, secret + 8 * s);
  }
  scramble_scalar(a.v, secret + kFoldKey);
  uint64_t folded = 0;
  for (uint64_t v : a.v) folded += v;
  return finish(folded, n, seed);
}

uint64_t row_check(const void* row, size_t n, uint64_t seed) { return kernels().check(row, n, seed); }

uint64_t copy_row_check(char* dst, const char* src, size_t n, uint64_t seed) {
  return kernels().copy_check(dst, src, n, seed);
}

const char* row_check_kernel_name() { return kernels().name; }

std::vector<RowCheckKernel> row_check_kernels() {
  std::vector<RowCheckKernel> out{{"scalar", copy_check_scalar, row_check_scalar}};
#if defined(__x86_64__)
  const auto& f = cpu_features();
  if (f.avx2) out.push_back({"avx2", copy_check_avx2, check_avx2});
  if (f.avx512f && f.avx512bw) out.push_back({"avx512", copy_check_avx512, check_only_avx512});
#endif
  return out;
}

}  // namespace cxlkv::tokens
