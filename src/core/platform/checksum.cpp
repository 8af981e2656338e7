#include "checksum.h"

#include "xxhash_inline.h"

#include <algorithm>
#include <cstring>

#include "copy_kernels.h"
#include "cpu_features.h"

namespace cxlkv {

namespace {
const xxh3k::HashFn kHash = xxh3k::pick_hash();
const xxh3k::CopyHashFn kCopyHash = xxh3k::pick_copy_hash();
}  // namespace

uint64_t xxh3(const void* p, size_t n, uint64_t seed) { return XXH3_64bits_withSeed(p, n, seed); }

uint64_t xxh3_vec(const void* p, size_t n) {
  constexpr size_t kMidsizeMax = 240;  // XXH3 hashes inputs up to this size without stripes
  if (n <= kMidsizeMax) return XXH3_64bits(p, n);
  // XXH3's long path: (n - 1) / 64 whole stripes (a scramble after every 16th), then the final 64
  // bytes as the last stripe, then the merge (xxh3k::finish).
  xxh3k::Acc acc;
  xxh3k::init(acc);
  const uint8_t* secret = xxh3k::default_secret();
  const char* s = static_cast<const char*>(p);
  kHash(acc, secret, s, (n - 1) / 64);
  return xxh3k::finish(acc, secret, reinterpret_cast<const uint8_t*>(s + n - 64), n);
}

const char* checksum_copy_kernel_name() {
  if (kCopyHash) return "avx512-fused";
  return cpu_features().avx2 ? "bounce-avx2" : "bounce-scalar";  // pick_hash() follows the same flag
}

Checksum::Checksum() { xxh3k::init(acc_); }

// Invariants between calls: the first min(total_, kHead) bytes are in head_; once total_ > kHead,
// every whole stripe followed by at least one more byte has been accumulated (XXH3 treats the
// final stripe apart), pend_len_ in 1..64 bytes of the stripe after them are in pend_, and prev_
// holds the stripe before pend_ (the final 64 bytes may reach back into it).
template <bool kCopy>
void Checksum::feed(char* d, const char* s, size_t n, const char* ahead, size_t ahead_n) {
  const uint8_t* secret = xxh3k::default_secret();
  auto advance = [&](size_t t) {
    s += t, n -= t, total_ += t;
    if (kCopy) d += t;
    if (ahead) {  // keep the hint at the same offset as the source
      const size_t a = std::min(t, ahead_n);
      ahead += a, ahead_n -= a;
    }
  };
  if (n == 0) return;
  if (total_ < kHead) {
    size_t t = std::min<size_t>(n, kHead - total_);
    std::memcpy(head_ + total_, s, t);             // the one read of these source bytes
    if (kCopy) std::memcpy(d, head_ + total_, t);  // deliver what was read
    advance(t);
    if (n == 0) return;
  }
  if (total_ == kHead) {  // the first byte after the head: its 4 stripes are ordinary ones
    kHash(acc_, secret, reinterpret_cast<const char*>(head_), kHead / 64);
    std::memcpy(prev_, head_ + kHead - 64, 64);
    pend_len_ = 0;
  }
  while (n) {
    if (pend_len_ == 64) {  // more input follows the pending stripe: it is an ordinary stripe
      kHash(acc_, secret, reinterpret_cast<const char*>(pend_), 1);
      std::memcpy(prev_, pend_, 64);
      pend_len_ = 0;
    }
    if (pend_len_ == 0 && n >= 64) {
      const size_t k = n / 64;
      const bool hold = n % 64 == 0;  // the call ends on a stripe: keep it pending
      if (kCopy) {
        kCopyHash(acc_, secret, d, s, k, hold, hold ? pend_ : prev_, hold ? prev_ : nullptr, ahead, ahead_n);
      } else {
        kHash(acc_, secret, s, k - hold);
        if (hold && k >= 2) std::memcpy(prev_, s + 64 * (k - 2), 64);
        std::memcpy(hold ? pend_ : prev_, s + 64 * (k - 1), 64);
      }
      if (hold) pend_len_ = 64;
      advance(64 * k);
      continue;
    }
    size_t t = std::min<size_t>(n, 64 - pend_len_);
    std::memcpy(pend_ + pend_len_, s, t);
    if (kCopy) std::memcpy(d, pend_ + pend_len_, t);
    pend_len_ += uint32_t(t);
    advance(t);
  }
}

void Checksum::update(const void* p, size_t n) { feed<false>(nullptr, static_cast<const char*>(p), n); }

void Checksum::update_copy(void* dst, const void* src, size_t n, const void* next_src, size_t next_n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (kCopyHash) {
    feed<true>(d, s, n, static_cast<const char*>(next_src), next_src ? next_n : 0);
    return;
  }
  // No fused kernel on this CPU: read each step of the source once into an L1-resident bounce
  // buffer (8 KiB: it and the hash's working set stay in L1 while the next step streams in),
  // hash it there and stream it out of there.
  constexpr size_t kBounce = 8192;
  alignas(64) thread_local char bounce[kBounce];
  while (n) {
    size_t len = std::min(n, kBounce);
    std::memcpy(bounce, s, len);
    update(bounce, len);
    kernels::stream_copy(d, bounce, len);
    d += len, s += len, n -= len;
  }
}

uint64_t Checksum::digest() const {
  if (total_ <= kHead) return XXH3_64bits(head_, total_);
  alignas(64) uint8_t last[64];  // the input's final 64 bytes: the tail of prev_, then pend_
  std::memcpy(last, prev_ + pend_len_, 64 - pend_len_);
  std::memcpy(last + 64 - pend_len_, pend_, pend_len_);
  return xxh3k::finish(acc_, xxh3k::default_secret(), last, total_);
}

}  // namespace cxlkv
