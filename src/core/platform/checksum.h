// Hashing: XXH3-64. Short hashes (keys, headers) call libxxhash. Block checksums go through
// Checksum, a streaming XXH3-64 of our own (checksum_kernels.h) whose value is bit-identical with
// XXH3_64bits() of the same bytes, so that its copy kernel can hash the registers it stores.
#pragma once
#include <cstddef>
#include <cstdint>

#include "checksum_kernels.h"

namespace cxlkv {

uint64_t xxh3(const void* p, size_t n, uint64_t seed = 0);
// XXH3-64 with seed 0, bit-identical with xxh3(p, n): inputs over 240 bytes run the stripe loop
// picked for this CPU (AVX2), where xxh3() is libxxhash compiled for baseline x86-64 (SSE2).
// For hashing many short rows (token_rows.cpp): no per-call state beyond the stack.
uint64_t xxh3_vec(const void* p, size_t n);
// "avx512-fused" / "bounce-avx2" / "bounce-scalar": how Checksum::update_copy copies and hashes.
const char* checksum_copy_kernel_name();

// Streaming XXH3-64 (seed 0) of a payload that arrives in pieces.
class Checksum {
 public:
  Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;
  // Hashes n bytes of p as read; p must not change meanwhile (use update_copy for shared memory).
  void update(const void* p, size_t n);
  // Copies n bytes src -> dst and hashes exactly the bytes that reach dst: each source byte is
  // read once, into a register (AVX-512 fused kernel: streamed to dst and hashed from that same
  // register) or into a small L1 bounce buffer (other CPUs: hashed there and streamed out of it).
  // So a concurrent writer of src can make the digest wrong, but never make it match bytes other
  // than the delivered ones (F2). No fence inside: call kernels::store_fence() before publishing
  // dst. Any alignment of dst and src, any n. `next_src` / `next_n`: where the caller's next
  // update_copy will read (the next fragment); a prefetch hint that lets one thread keep two
  // source streams in flight, never read through.
  void update_copy(void* dst, const void* src, size_t n, const void* next_src = nullptr, size_t next_n = 0);
  uint64_t digest() const;

 private:
  static constexpr size_t kHead = 256;  // inputs up to this size are hashed in one call at the end
  template <bool kCopy>
  void feed(char* dst, const char* src, size_t n, const char* ahead = nullptr, size_t ahead_n = 0);

  xxh3k::Acc acc_;
  uint64_t total_ = 0;
  uint32_t pend_len_ = 0;            // bytes of the current stripe seen, not yet accumulated
  alignas(64) uint8_t pend_[64];     // the current stripe (accumulated once more input follows)
  alignas(64) uint8_t prev_[64];     // the last accumulated stripe (the final stripe overlaps it)
  alignas(64) uint8_t head_[kHead];  // the first kHead bytes (XXH3 hashes short inputs apart)
};

}  // namespace cxlkv
