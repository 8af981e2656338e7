// XXH3-64's stripe loop (see checksum_kernels.h): a portable version, an AVX2 one, and the
// AVX-512 fused copy+hash kernel. Written from xxHash's published algorithm description
// (doc/xxhash_spec.md): acc[i ^ 1] += data[i]; acc[i] += lo32(data[i] ^ key[i]) * hi32(same);
// after each full block acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1.
#include "checksum_kernels.h"

#include "xxhash_inline.h"  // XXH3_generateSecret_fromSeed

#include <cstring>

#include "cpu_features.h"
#include "xxh3_scalar.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cxlkv::xxh3k {

namespace {
constexpr uint64_t kP32_1 = 0x9E3779B1u, kP32_2 = 0x85EBCA77u, kP32_3 = 0xC2B2AE3Du;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull, kP64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP64_3 = 0x165667B19E3779F9ull, kP64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP64_5 = 0x27D4EB2F165667C5ull;
constexpr size_t kScrambleKey = kSecretBytes - kStripe;        // 128
constexpr size_t kLastStripeKey = kSecretBytes - kStripe - 7;  // 121
constexpr size_t kMergeKey = 11;

void hash_scalar(Acc& a, const uint8_t* secret, const char* src, size_t k) {
  for (size_t j = 0; j < k; ++j) {
    stripe_scalar(a.v, reinterpret_cast<const uint8_t*>(src) + kStripe * j, secret + 8 * a.stripe);
    if (++a.stripe == kStripesPerBlock) {
      scramble_scalar(a.v, secret + kScrambleKey);
      a.stripe = 0;
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) inline __m256i stripe_avx2(__m256i acc, __m256i d, __m256i key) {
  __m256i dk = _mm256_xor_si256(d, key);
  __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
  __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));  // acc[i ^ 1] += d[i]
  return _mm256_add_epi64(acc, _mm256_add_epi64(prod, swapped));
}
__attribute__((target("avx2"))) inline __m256i scramble_avx2(__m256i acc, __m256i key) {
  const __m256i prime = _mm256_set1_epi32(int(kP32_1));
  acc = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)), key);
  __m256i lo = _mm256_mul_epu32(acc, prime);
  __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}
__attribute__((target("avx2"))) void hash_avx2(Acc& a, const uint8_t* secret, const char* src, size_t k) {
  __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.v));
  __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.v + 4));
  uint32_t s = a.stripe;
  for (size_t j = 0; j < k; ++j) {
    const char* p = src + kStripe * j;
    const uint8_t* key = secret + 8 * s;
    lo = stripe_avx2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
    hi = stripe_avx2(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)),
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 32)));
    if (++s == kStripesPerBlock) {
      const uint8_t* sk = secret + kScrambleKey;
      lo = scramble_avx2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sk)));
      hi = scramble_avx2(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sk + 32)));
      s = 0;
    }
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(a.v), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(a.v + 4), hi);
  a.stripe = s;
}

#define CXLKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi")))
CXLKV_AVX512 inline __m512i stripe_avx512(__m512i acc, __m512i d, const uint8_t* key) {
  __m512i dk = _mm512_xor_si512(d, _mm512_loadu_si512(key));
  __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
  __m512i swapped = _mm512_shuffle_epi32(d, _MM_PERM_BADC);  // acc[i ^ 1] += d[i]
  return _mm512_add_epi64(acc, _mm512_add_epi64(prod, swapped));
}
CXLKV_AVX512 inline __m512i scramble_avx512(__m512i acc, const uint8_t* key) {
  const __m512i prime = _mm512_set1_epi32(int(kP32_1));
  acc = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), _mm512_loadu_si512(key));
  __m512i lo = _mm512_mul_epu32(acc, prime);
  __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(acc, 32), prime);
  return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

// One 512-bit register holds the whole stripe: half the instructions of hash_avx2. The token
// rows' check (xxh3_vec) runs on it: a 656 / 1,152-B row in L1/L2 hashes in ~22 / ~34 ns here,
// against ~26 / ~45 ns with hash_avx2 and ~33 / ~53 ns with libxxhash's SSE2 build (best of 20
// runs on the loaded 2-core VM); the hash is what a verified row gather pays on top of the copy.
CXLKV_AVX512 void hash_avx512(Acc& a, const uint8_t* secret, const char* src, size_t k) {
  __m512i acc = _mm512_load_si512(a.v);
  uint32_t s = a.stripe;
  for (size_t j = 0; j < k; ++j) {
    acc = stripe_avx512(acc, _mm512_loadu_si512(src + kStripe * j), secret + 8 * s);
    if (++s == kStripesPerBlock) {
      acc = scramble_avx512(acc, secret + kScrambleKey);
      s = 0;
    }
  }
  _mm512_store_si512(a.v, acc);
  a.stripe = s;
}

// dst 64-byte aligned: each stripe is one aligned line of dst; load, stream it out, hash it.
// dst misaligned by m: the lines of dst straddle the hash's stripes, so the kernel loads the
// source in dst-line steps (w[j], streamed to the aligned line j) and forms stripe j from the
// last 64-m bytes of w[j-1] and the first m of w[j] (one two-register byte permute). The partial
// lines at either end are byte-masked loads and stores. Either way every source byte is loaded
// once and the stored and the hashed bytes come from the same register.
CXLKV_AVX512 void copy_hash_avx512(Acc& a, const uint8_t* secret, char* dst, const char* src, size_t k,
                                   bool hold_last, uint8_t* last, uint8_t* before, const char* ahead,
                                   size_t ahead_len) {
  __m512i acc = _mm512_load_si512(a.v);
  uint32_t s = a.stripe;
  const size_t hashed = k - (hold_last ? 1 : 0);
  __m512i cur = _mm512_setzero_si512(), prev = cur;
  // (a macro, not a lambda: a lambda does not inherit the target attribute and is not inlined)
#define CXLKV_HASH_STRIPE(j, d)                            \
  do {                                                     \
    prev = cur;                                            \
    cur = (d);                                             \
    if ((j) < hashed) {                                    \
      acc = stripe_avx512(acc, cur, secret + 8 * s);       \
      if (++s == kStripesPerBlock) {                       \
        acc = scramble_avx512(acc, secret + kScrambleKey); \
        s = 0;                                             \
      }                                                    \
    }                                                      \
  } while (0)
  const size_t m = reinterpret_cast<uintptr_t>(dst) & 63;
#ifndef CXLKV_PREFETCH_AHEAD
  // Source lines requested 8 lines ahead: a 32 KiB fragment is a short stream that the hardware
  // prefetcher picks up late. Gathering 64 fragments of 32 KiB per block, 128 MiB, one thread,
  // medians of 6 A/B runs on the loaded 2-core VM: 1.18x -> 1.32x of one glibc memcpy of 128 MiB.
#define CXLKV_PREFETCH_AHEAD 512
#endif
  // One core streams from one source at a time, and one stream leaves DRAM bandwidth unused
  // (glibc's large memcpy interleaves pages for the same reason). The next copy's source is
  // requested line for line beside this one's, into L2. A pool store of 64 fragments of 32 KiB per
  // 2 MiB block, one thread, huge pages, quiet 2-core VM (scripts/bench_copy_micro.sh): 0.85x ->
  // 0.97-0.98x of one glibc memcpy of the same 1 GiB, 0.83-0.87x -> 0.94-0.96x of 128 MiB.
  const size_t ahead_lines = ahead ? ahead_len / kStripe : 0;
  if (m == 0) {
    for (size_t j = 0; j < k; ++j) {
      if (j < ahead_lines) _mm_prefetch(ahead + kStripe * j, _MM_HINT_T1);
      if (CXLKV_PREFETCH_AHEAD) _mm_prefetch(src + kStripe * j + CXLKV_PREFETCH_AHEAD, _MM_HINT_T0);
      __m512i d = _mm512_loadu_si512(src + kStripe * j);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + kStripe * j), d);
      CXLKV_HASH_STRIPE(j, d);
    }
  } else {
    const size_t head = 64 - m;  // bytes of stripe 0 before dst's first line boundary
    const __m512i idx = _mm512_add_epi8(
        _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43,
                        42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22,
                        21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi8(char(m)));  // byte i of the stripe is byte i + m of (w[j-1] : w[j])
    const __mmask64 upper = ~0ull << m, lower = ~upper;
    // w[-1]: the line of dst that holds the stripe's first `head` bytes, as its bytes m..63.
    const uintptr_t line0 = reinterpret_cast<uintptr_t>(dst) - m;
    const uintptr_t src0 = reinterpret_cast<uintptr_t>(src) - m;
    __m512i w_prev = _mm512_maskz_loadu_epi8(upper, reinterpret_cast<const void*>(src0));
    _mm512_mask_storeu_epi8(reinterpret_cast<void*>(line0), upper, w_prev);
    for (size_t j = 0; j < k; ++j) {
      char* dl = dst + head + kStripe * j;
      const char* sl = src + head + kStripe * j;
      __m512i w;
      if (j < ahead_lines) _mm_prefetch(ahead + kStripe * j, _MM_HINT_T1);
      if (j + 1 < k) {
        if (CXLKV_PREFETCH_AHEAD) _mm_prefetch(sl + CXLKV_PREFETCH_AHEAD, _MM_HINT_T0);
        w = _mm512_loadu_si512(sl);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dl), w);
      } else {  // the last stripe ends m bytes into this line
        w = _mm512_maskz_loadu_epi8(lower, sl);
        _mm512_mask_storeu_epi8(dl, lower, w);
      }
      CXLKV_HASH_STRIPE(j, _mm512_permutex2var_epi8(w_prev, idx, w));
      w_prev = w;
    }
  }
#undef CXLKV_HASH_STRIPE
  _mm512_store_si512(a.v, acc);
  a.stripe = s;
  _mm512_storeu_si512(last, cur);
  if (before && k >= 2) _mm512_storeu_si512(before, prev);
}
#endif
}  // namespace

void init(Acc& a) {
  const uint64_t v[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  std::memcpy(a.v, v, sizeof v);
  a.stripe = 0;
}

const uint8_t* default_secret() {
  struct Secret {
    alignas(64) uint8_t b[kSecretBytes];
    Secret() { XXH3_generateSecret_fromSeed(b, 0); }  // seed 0: exactly XXH3's default secret
  };
  static const Secret s;
  return s.b;
}

HashFn pick_hash() {
#if defined(__x86_64__)
  const auto& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vbmi) return hash_avx512;  // the copy kernel's CPUs
  if (f.avx2) return hash_avx2;
#endif
  return hash_scalar;
}

CopyHashFn pick_copy_hash() {
#if defined(__x86_64__)
  const auto& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vbmi) return copy_hash_avx512;
#endif
  return nullptr;
}

uint64_t finish(const Acc& a, const uint8_t* secret, const uint8_t* last, uint64_t total) {
  uint64_t acc[8];
  std::memcpy(acc, a.v, sizeof acc);
  stripe_scalar(acc, last, secret + kLastStripeKey);
  uint64_t r = total * kP64_1;
  for (int i = 0; i < 4; ++i) {
    unsigned __int128 p = (unsigned __int128)(acc[2 * i] ^ rd64(secret + kMergeKey + 16 * i)) *
                          (acc[2 * i + 1] ^ rd64(secret + kMergeKey + 16 * i + 8));
    r += uint64_t(p) ^ uint64_t(p >> 64);
  }
  r ^= r >> 37;  // XXH3's avalanche
  r *= 0x165667919E3779F9ull;
  return r ^ (r >> 32);
}

}  // namespace cxlkv::xxh3k
