// Hashing: XXH3 from libxxhash. Block checksums use xxHash's run-time dispatch (SSE2 / AVX2 /
// AVX-512 chosen from CPUID), so the checksum keeps up with the copy on any x86-64 without
// -march flags; short hashes (keys, headers) use the plain entry points.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cxlkv {

uint64_t xxh3(const void* p, size_t n, uint64_t seed = 0);

// Streaming XXH3-64 of a payload that arrives in pieces.
class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;
  void update(const void* p, size_t n);
  // Copies n bytes src -> dst and hashes exactly the bytes that reach dst: each step of the
  // source is read once into a small L1-resident bounce buffer, hashed there, and streamed out
  // of it (non-temporal stores). So a concurrent writer of src can make the digest wrong, but
  // never make it match bytes other than the delivered ones (F2). No fence inside: call
  // kernels::store_fence() before publishing dst.
  void update_copy(void* dst, const void* src, size_t n);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t, kept opaque so xxhash.h stays out of the other headers
};

}  // namespace cxlkv
