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
constexpr uint64_t kP32_1 = xxh3k::kScrambleMul;        // XXH3's scramble multiplier
constexpr uint64_t kLengthMul = 0x9E3779B185EBCA87ull;  // the row length enters the seed times this
constexpr size_t kStripe = 64;
constexpr uint32_t kStripesPerRound = 16;  // stripes between two scrambles (the product keys' period)
// 64-byte keys of the 192-byte XXH3 default secret for the scrambles of the products (P) and of
// the sums (S): after every 16 stripes, and the final one before the lanes are added.
constexpr size_t kRoundKeyP = 0, kRoundKeyS = 128, kFoldKeyP = 64, kFoldKeyS = 96;

// The product keys: word w of stripe s (mod 16) is multiplied by kMulKeys[s][w]. Each key is odd
// (so a nonzero 16-bit change times it is nonzero mod 2^32) and all 512 differ: bits 1-4 are s, bits
// 5-9 are w, the top 6 bits splitmix64's. So a word swapped with its pair partner, or a stripe
// moved by 1-15 stripes, changes a product lane (the sums alone cannot see a move).
struct MulKeys {
  alignas(64) int16_t k[kStripesPerRound][32];
};
constexpr MulKeys make_mul_keys() {
  MulKeys m{};
  uint64_t x = 0x243F6A8885A308D3ull;  // splitmix64's state, from pi's digits
  for (uint32_t s = 0; s < kStripesPerRound; ++s)
    for (uint32_t w = 0; w < 32; ++w) {
      x += 0x9E3779B97F4A7C15ull;
      uint64_t z = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      m.k[s][w] = int16_t(uint16_t((z & 0xFC00u) | (w << 5) | (s << 1) | 1u));
    }
  return m;
}
constexpr MulKeys kMulKeys = make_mul_keys();

// The lanes' initial values (XXH3's accumulator init), one aligned constant: the vector kernels load
// it with one instruction (eight scalar stores read back as one vector stall on store forwarding,
// ~a third of a short row's check).
alignas(64) constexpr uint64_t kInit[8] = {
    0xC2B2AE3Du,           0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
    0x85EBCA77C2B2AE63ull, 0x85EBCA77u,           0x27D4EB2F165667C5ull, 0x9E3779B1u};

inline uint64_t finish(uint64_t folded, size_t n, uint64_t seed) {
  return check_mix(folded ^ seed ^ (uint64_t(n) * kLengthMul));
}

#if defined(__x86_64__)
#define CXLKV_ROWS_AVX2 __attribute__((target("avx2")))
CXLKV_ROWS_AVX2 inline __m256i scramble_avx2(__m256i acc, const uint8_t* key) {
  const __m256i prime = _mm256_set1_epi32(int(kP32_1));
  acc = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  __m256i lo = _mm256_mul_epu32(acc, prime);
  __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

// One stripe into the four half-lanes (products p, sums q; _0 the stripe's first 32 bytes).
// (a function, not a lambda: a lambda does not inherit the target attribute)
CXLKV_ROWS_AVX2 inline void stripe_avx2(__m256i* acc, __m256i d0, __m256i d1, const int16_t* key) {
  acc[0] = _mm256_add_epi32(acc[0],
                            _mm256_madd_epi16(d0, _mm256_load_si256(reinterpret_cast<const __m256i*>(key))));
  acc[1] = _mm256_add_epi32(
      acc[1], _mm256_madd_epi16(d1, _mm256_load_si256(reinterpret_cast<const __m256i*>(key + 16))));
  acc[2] = _mm256_add_epi64(acc[2], d0);
  acc[3] = _mm256_add_epi64(acc[3], d1);
}
CXLKV_ROWS_AVX2 inline void scramble4_avx2(__m256i* acc, size_t key_p, size_t key_s) {
  const uint8_t* secret = xxh3k::default_secret();
  acc[0] = scramble_avx2(acc[0], secret + key_p);
  acc[1] = scramble_avx2(acc[1], secret + key_p + 32);
  acc[2] = scramble_avx2(acc[2], secret + key_s);
  acc[3] = scramble_avx2(acc[3], secret + key_s + 32);
}

// The check over bytes already delivered (dst): two 256-bit halves per stripe.
CXLKV_ROWS_AVX2 uint64_t check_avx2(const void* row, size_t n, uint64_t seed) {
  const char* p = static_cast<const char*>(row);
  const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInit));
  const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInit + 4));
  __m256i acc[4] = {lo, hi, lo, hi};
  uint32_t s = 0;
  const size_t full = n / kStripe;
  for (size_t j = 0; j < full; ++j) {
    const char* in = p + kStripe * j;
    stripe_avx2(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32)), kMulKeys.k[s]);
    if (++s == kStripesPerRound) scramble4_avx2(acc, kRoundKeyP, kRoundKeyS), s = 0;
  }
  if (const size_t t = n % kStripe) {
    alignas(64) char pad[kStripe] = {};
    std::memcpy(pad, p + kStripe * full, t);
    stripe_avx2(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(pad)),
                _mm256_load_si256(reinterpret_cast<const __m256i*>(pad + 32)), kMulKeys.k[s]);
  }
  scramble4_avx2(acc, kFoldKeyP, kFoldKeyS);
  __m256i sum = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
  __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  return finish(uint64_t(_mm_cvtsi128_si64(s2)) + uint64_t(_mm_extract_epi64(s2, 1)), n, seed);
}

#define CXLKV_ROWS_AVX512 __attribute__((target("avx512f,avx512bw")))
CXLKV_ROWS_AVX512 inline __m512i scramble_avx512(__m512i acc, const uint8_t* key) {
  const __m512i prime = _mm512_set1_epi32(int(kP32_1));
  acc = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), _mm512_loadu_si512(key));
  __m512i lo = _mm512_mul_epu32(acc, prime);
  __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(acc, 32), prime);
  return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

// One pass: each stripe is loaded once, stored to dst (kCopy) and accumulated from the same
// register: three vector operations per 64 bytes (a multiply-add, two adds). Plain stores, not
// streaming ones: the rows are read by the caller next, and a row's last line is shared with the
// next row's first in a packed output.
template <bool kCopy>
CXLKV_ROWS_AVX512 uint64_t check_avx512(char* dst, const char* src, size_t n, uint64_t seed) {
  const uint8_t* secret = xxh3k::default_secret();
  __m512i prod = _mm512_load_si512(kInit), sum = prod;
  uint32_t s = 0;
  const size_t full = n / kStripe;
  for (size_t j = 0; j < full; ++j) {
    __m512i d = _mm512_loadu_si512(src + kStripe * j);
    if constexpr (kCopy) _mm512_storeu_si512(dst + kStripe * j, d);
    prod = _mm512_add_epi32(prod, _mm512_madd_epi16(d, _mm512_load_si512(kMulKeys.k[s])));
    sum = _mm512_add_epi64(sum, d);
    if (++s == kStripesPerRound) {
      prod = scramble_avx512(prod, secret + kRoundKeyP);
      sum = scramble_avx512(sum, secret + kRoundKeyS);
      s = 0;
    }
  }
  if (const size_t t = n % kStripe) {  // masked: no byte past the row is read or written
    const __mmask64 m = (uint64_t(1) << t) - 1;
    __m512i d = _mm512_maskz_loadu_epi8(m, src + kStripe * full);
    if constexpr (kCopy) _mm512_mask_storeu_epi8(dst + kStripe * full, m, d);
    prod = _mm512_add_epi32(prod, _mm512_madd_epi16(d, _mm512_load_si512(kMulKeys.k[s])));
    sum = _mm512_add_epi64(sum, d);
  }
  __m512i acc =
      _mm512_add_epi64(scramble_avx512(prod, secret + kFoldKeyP), scramble_avx512(sum, secret + kFoldKeyS));
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

// One stripe, one lane at a time: product lane i (two 32-bit halves) gains w[2h] * k[2h] +
// w[2h+1] * k[2h+1] for its half h = 2i, 2i+1 (signed 16-bit words, mod 2^32: vpmaddwd then
// vpaddd), sum lane i gains the stripe's 64-bit word i.
inline void stripe_scalar(uint64_t* prod, uint64_t* sum, const uint8_t* in, const int16_t* key) {
  for (int i = 0; i < 8; ++i) {
    uint32_t half[2];
    for (int h = 0; h < 2; ++h) {
      const int w = 4 * i + 2 * h;
      int16_t w0, w1;
      std::memcpy(&w0, in + 2 * w, 2);
      std::memcpy(&w1, in + 2 * w + 2, 2);
      half[h] = uint32_t(int32_t(w0) * key[w]) + uint32_t(int32_t(w1) * key[w + 1]);
    }
    const uint32_t lo = uint32_t(prod[i]) + half[0], hi = uint32_t(prod[i] >> 32) + half[1];
    prod[i] = uint64_t(lo) | (uint64_t(hi) << 32);
    sum[i] += rd64(in + 8 * i);
  }
}

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
  uint64_t prod[8], sum[8];
  std::memcpy(prod, kInit, sizeof kInit);
  std::memcpy(sum, kInit, sizeof kInit);
  const uint8_t* secret = xxh3k::default_secret();
  const uint8_t* p = static_cast<const uint8_t*>(row);
  uint32_t s = 0;
  const size_t full = n / kStripe;
  for (size_t j = 0; j < full; ++j) {
    stripe_scalar(prod, sum, p + kStripe * j, kMulKeys.k[s]);
    if (++s == kStripesPerRound) {
      scramble_scalar(prod, secret + kRoundKeyP);
      scramble_scalar(sum, secret + kRoundKeyS);
      s = 0;
    }
  }
  if (const size_t t = n % kStripe) {
    alignas(64) uint8_t pad[kStripe] = {};
    std::memcpy(pad, p + kStripe * full, t);
    stripe_scalar(prod, sum, pad, kMulKeys.k[s]);
  }
  scramble_scalar(prod, secret + kFoldKeyP);
  scramble_scalar(sum, secret + kFoldKeyS);
  uint64_t folded = 0;
  for (int i = 0; i < 8; ++i) folded += prod[i] + sum[i];
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
