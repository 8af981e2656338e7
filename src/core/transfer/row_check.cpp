// The per-row check of token blocks and its kernels (row_check.h says what it is and why).
#include "row_check.h"

#include <cstring>

#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cxlkv::tokens {

namespace {
constexpr uint64_t kLengthMul = 0x9E3779B185EBCA87ull;  // the row length enters the seed times this
constexpr size_t kPiece = 32;
constexpr uint32_t kPiecesPerRound = 16;  // pieces between two triplings of P (the keys' period)

// The product keys: 16-bit word w of piece j (mod 16) is multiplied by kMulKeys[j % 16][w]. Each
// key is odd (a nonzero 16-bit change times it is nonzero mod 2^32) and all 256 differ: bits 1-4
// are j % 16, bits 5-8 are w, the top 7 bits splitmix64's.
struct MulKeys {
  alignas(64) int16_t k[kPiecesPerRound][16];  // 64: check_avx512 loads two pieces' keys aligned
};
constexpr MulKeys make_mul_keys() {
  MulKeys m{};
  uint64_t x = 0x243F6A8885A308D3ull;  // splitmix64's state, from pi's digits
  for (uint32_t j = 0; j < kPiecesPerRound; ++j)
    for (uint32_t w = 0; w < 16; ++w) {
      x += 0x9E3779B97F4A7C15ull;
      uint64_t z = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      m.k[j][w] = int16_t(uint16_t((z & 0xFE00u) | (w << 5) | (j << 1) | 1u));
    }
  return m;
}
constexpr MulKeys kMulKeys = make_mul_keys();

// Initial S and P lanes (digits of e, arbitrary but fixed), one aligned constant per set.
alignas(32) constexpr uint64_t kInitS[4] = {0xB7E151628AED2A6Aull, 0xBF7158809CF4F3C7ull,
                                            0x62E7160F38B4DA56ull, 0xA784D9045190CFEFull};
alignas(32) constexpr uint64_t kInitP[4] = {0x324E7738926CFBE5ull, 0xF4BF8D8D8C31D763ull,
                                            0xDA06C80ABB1185EBull, 0x4F7C7B5757F59584ull};

inline uint64_t rotl(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }

// The fold of the lanes (row_check.h): v_i = S_i + P_i with P_i's halves swapped, then
// v0 + rotl(v1, 16) + rotl(v2, 32) + rotl(v3, 48), then check_mix with the seed and the length.
inline uint64_t finish(const uint64_t* s, const uint64_t* p, size_t n, uint64_t seed) {
  uint64_t u = 0;
  for (unsigned i = 0; i < 4; ++i) u += i ? rotl(s[i] + rotl(p[i], 32), 16 * i) : s[i] + rotl(p[i], 32);
  return check_mix(u ^ seed ^ (uint64_t(n) * kLengthMul));
}

// One piece, one lane at a time: sum lane i gains the piece's 64-bit word i; each 32-bit half h of
// product lane i gains w0 * k0 + w1 * k1 (mod 2^32) for its two signed 16-bit words (vpmaddwd, vpaddd).
inline void piece_scalar(uint64_t* s, uint64_t* p, const uint8_t* in, const int16_t* key) {
  for (int i = 0; i < 4; ++i) {
    uint64_t lane;
    std::memcpy(&lane, in + 8 * i, 8);
    s[i] += lane;
    uint32_t half[2];
    for (int h = 0; h < 2; ++h) {
      const int w = 4 * i + 2 * h;
      int16_t w0, w1;
      std::memcpy(&w0, in + 2 * w, 2);
      std::memcpy(&w1, in + 2 * w + 2, 2);
      half[h] = uint32_t(int32_t(w0) * key[w]) + uint32_t(int32_t(w1) * key[w + 1]);
    }
    const uint32_t lo = uint32_t(p[i]) + half[0], hi = uint32_t(p[i] >> 32) + half[1];
    p[i] = uint64_t(lo) | (uint64_t(hi) << 32);
  }
}
inline void triple_scalar(uint64_t* p) {  // each 32-bit half times 3
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = uint32_t(p[i]) * 3u, hi = uint32_t(p[i] >> 32) * 3u;
    p[i] = uint64_t(lo) | (uint64_t(hi) << 32);
  }
}

uint64_t copy_check_scalar(char* dst, const char* src, size_t n, uint64_t seed) {
  std::memcpy(dst, src, n);
  return row_check_scalar(dst, n, seed);  // the bytes as delivered, never the source again
}

#if defined(__x86_64__)
#define CXLKV_ROWS_AVX2 __attribute__((target("avx2")))

// finish() on vectors: v = S + P with P's halves swapped, lane i rotated left by 16 i, lanes added.
CXLKV_ROWS_AVX2 inline uint64_t finish_avx2(__m256i s, __m256i p, size_t n, uint64_t seed) {
  const __m256i v = _mm256_add_epi64(s, _mm256_shuffle_epi32(p, 0xB1));
  const __m256i r = _mm256_or_si256(_mm256_sllv_epi64(v, _mm256_set_epi64x(48, 32, 16, 0)),
                                    _mm256_srlv_epi64(v, _mm256_set_epi64x(16, 32, 48, 64)));
  const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  const uint64_t u = uint64_t(_mm_cvtsi128_si64(h)) + uint64_t(_mm_extract_epi64(h, 1));
  return check_mix(u ^ seed ^ (uint64_t(n) * kLengthMul));
}

CXLKV_ROWS_AVX2 inline void piece_avx2(__m256i& s, __m256i& p, __m256i d, uint32_t j) {
  s = _mm256_add_epi64(s, d);
  p = _mm256_add_epi32(
      p, _mm256_madd_epi16(
             d, _mm256_load_si256(reinterpret_cast<const __m256i*>(kMulKeys.k[j % kPiecesPerRound]))));
}

// The tail (1..31 bytes): loaded in 16/8/4/2/1-byte parts (nothing past the row is read), stored
// to dst from the same registers when kCopy, and returned zero-padded to a piece.
template <bool kCopy>
CXLKV_ROWS_AVX2 inline __m256i tail_avx2(char* dst, const char* src, size_t t) {
  __m128i lo = _mm_setzero_si128();
  size_t o = 0;
  if (t & 16) {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if constexpr (kCopy) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), lo);
    o = 16;
  }
  uint64_t q[2] = {0, 0};
  if (const size_t r = t & 15) {
    char* qb = reinterpret_cast<char*>(q);
    size_t at = 0;
    if (r & 8) std::memcpy(qb, src + o, 8), at = 8;
    if (r & 4) std::memcpy(qb + at, src + o + at, 4), at += 4;
    if (r & 2) std::memcpy(qb + at, src + o + at, 2), at += 2;
    if (r & 1) qb[at] = src[o + at];
    if constexpr (kCopy) {
      at = 0;
      if (r & 8) std::memcpy(dst + o, qb, 8), at = 8;
      if (r & 4) std::memcpy(dst + o + at, qb + at, 4), at += 4;
      if (r & 2) std::memcpy(dst + o + at, qb + at, 2), at += 2;
      if (r & 1) dst[o + at] = qb[at];
    }
  }
  const __m128i rest = _mm_set_epi64x(int64_t(q[1]), int64_t(q[0]));
  return o ? _mm256_set_m128i(rest, lo) : _mm256_set_m128i(_mm_setzero_si128(), rest);
}

// One pass: each 32-byte piece is loaded once, stored to dst (kCopy) and accumulated from that
// same register (a load, a store and three vector operations per piece; no vector multiply, and no
// per-row scramble: the fold is scalar). Plain stores: the caller reads the rows next.
template <bool kCopy>
CXLKV_ROWS_AVX2 uint64_t check_avx2(char* dst, const char* src, size_t n, uint64_t seed) {
  __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInitS));
  __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInitP));
  const size_t full = n / kPiece;
  uint32_t j = 0;
  for (; j < full; ++j) {
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kPiece * j));
    if constexpr (kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kPiece * j), d);
    piece_avx2(s, p, d, j);
    if (j % kPiecesPerRound == kPiecesPerRound - 1) p = _mm256_add_epi32(p, _mm256_add_epi32(p, p));
  }
  if (const size_t t = n % kPiece) {
    piece_avx2(s, p, tail_avx2<kCopy>(dst + kPiece * j, src + kPiece * j, t), j);
    if (j % kPiecesPerRound == kPiecesPerRound - 1) p = _mm256_add_epi32(p, _mm256_add_epi32(p, p));
  }
  return finish_avx2(s, p, n, seed);
}

uint64_t copy_check_avx2(char* dst, const char* src, size_t n, uint64_t seed) {
  return check_avx2<true>(dst, src, n, seed);
}
uint64_t check_only_avx2(const void* row, size_t n, uint64_t seed) {
  return check_avx2<false>(nullptr, static_cast<const char*>(row), n, seed);
}

#define CXLKV_ROWS_AVX512 __attribute__((target("avx512f,avx512bw")))

// The same check on 64 bytes at a time: lanes 0-3 of each zmm accumulator take the even pieces,
// lanes 4-7 the odd ones (the keys of pieces j and j + 1 are 64 contiguous bytes of kMulKeys), and
// the halves are added before the fold. Tripling P after every 16 pieces triples both halves
// (multiplying by 3 distributes over their sum mod 2^32). Fewer instructions per byte than AVX2
// (a load, a store, three vector operations and the loop's two per 64 bytes), which is what lets
// the CPU keep several rows' cache misses in flight (row_check.h). The tail is a byte-masked load
// and store: nothing past the row is read or written.
template <bool kCopy>
CXLKV_ROWS_AVX512 uint64_t check_avx512(char* dst, const char* src, size_t n, uint64_t seed) {
  __m512i s = _mm512_zextsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(kInitS)));
  __m512i p = _mm512_zextsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(kInitP)));
  const char* keys = reinterpret_cast<const char*>(kMulKeys.k);
  const size_t pairs = n / 64;
  size_t i = 0;
  while (i < pairs) {  // rounds of up to 8 pairs (16 pieces), P tripled after a whole round
    const size_t end = pairs - i < 8 ? pairs : i + 8;
    for (size_t r = 0; i < end; ++i, ++r) {
      const __m512i d = _mm512_loadu_si512(src + 64 * i);
      if constexpr (kCopy) _mm512_storeu_si512(dst + 64 * i, d);
      s = _mm512_add_epi64(s, d);
      p = _mm512_add_epi32(p, _mm512_madd_epi16(d, _mm512_load_si512(keys + 64 * r)));
    }
    if (i % 8 == 0) p = _mm512_add_epi32(p, _mm512_add_epi32(p, p));
  }
  if (const size_t t = n % 64) {
    const __mmask64 m = (uint64_t(1) << t) - 1;
    const __m512i d = _mm512_maskz_loadu_epi8(m, src + 64 * i);
    if constexpr (kCopy) _mm512_mask_storeu_epi8(dst + 64 * i, m, d);
    s = _mm512_add_epi64(s, d);
    p = _mm512_add_epi32(p, _mm512_madd_epi16(d, _mm512_load_si512(keys + 64 * (i % 8))));
    // piece 2i + 1 may close a round (i % 8 == 7 and t > 32), piece 2i may not (it is even)
    if (i % 8 == 7 && t > 32) p = _mm512_add_epi32(p, _mm512_add_epi32(p, p));
  }
  const __m256i s4 = _mm256_add_epi64(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
  const __m256i p4 = _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
  return finish_avx2(s4, p4, n, seed);
}

uint64_t copy_check_avx512(char* dst, const char* src, size_t n, uint64_t seed) {
  return check_avx512<true>(dst, src, n, seed);
}
uint64_t check_only_avx512(const void* row, size_t n, uint64_t seed) {
  return check_avx512<false>(nullptr, static_cast<const char*>(row), n, seed);
}
#endif

using CheckFn = uint64_t (*)(const void*, size_t, uint64_t);
using CopyCheckFn = uint64_t (*)(char*, const char*, size_t, uint64_t);

struct Kernels {
  CheckFn check = row_check_scalar;
  CopyCheckFn copy_check = copy_check_scalar;
  const char* name = "scalar";
  Kernels() {
#if defined(__x86_64__)
    const auto& f = cpu_features();
    if (f.avx512f && f.avx512bw)
      check = check_only_avx512, copy_check = copy_check_avx512, name = "avx512";
    else if (f.avx2)
      check = check_only_avx2, copy_check = copy_check_avx2, name = "avx2";
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
  uint64_t s[4], p[4];
  std::memcpy(s, kInitS, sizeof s);
  std::memcpy(p, kInitP, sizeof p);
  const uint8_t* in = static_cast<const uint8_t*>(row);
  const size_t pieces = (n + kPiece - 1) / kPiece;
  for (size_t j = 0; j < pieces; ++j) {
    alignas(8) uint8_t pad[kPiece] = {};
    const uint8_t* at = in + kPiece * j;
    if (kPiece * (j + 1) > n) {  // the tail, zero-padded to a piece
      std::memcpy(pad, at, n - kPiece * j);
      at = pad;
    }
    piece_scalar(s, p, at, kMulKeys.k[j % kPiecesPerRound]);
    if (j % kPiecesPerRound == kPiecesPerRound - 1) triple_scalar(p);
  }
  return finish(s, p, n, seed);
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
  if (f.avx2) out.push_back({"avx2", copy_check_avx2, check_only_avx2});
  if (f.avx512f && f.avx512bw) out.push_back({"avx512", copy_check_avx512, check_only_avx512});
#endif
  return out;
}

}  // namespace cxlkv::tokens
