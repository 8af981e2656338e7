#include "checksum.h"

#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include <cstring>
#include <new>

#include "copy_kernels.h"

namespace cxlkv {

uint64_t xxh3(const void* p, size_t n, uint64_t seed) { return XXH3_64bits_withSeed_dispatch(p, n, seed); }

Checksum::Checksum() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
Checksum::~Checksum() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Checksum::update(const void* p, size_t n) {
  XXH3_64bits_update_dispatch(static_cast<XXH3_state_t*>(state_), p, n);
}
void Checksum::update_copy(void* dst, const void* src, size_t n) {
  // 8 KiB: the bounce buffer and the hash's working set stay in L1 (32-48 KiB) while the next
  // step's source lines stream in; larger steps spill to L2 and cost bandwidth.
  constexpr size_t kBounce = 8192;
  alignas(64) thread_local char bounce[kBounce];
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  while (n) {
    size_t len = n < kBounce ? n : kBounce;
    std::memcpy(bounce, s, len);  // the one read of the source
    XXH3_64bits_update_dispatch(static_cast<XXH3_state_t*>(state_), bounce, len);
    kernels::stream_copy(d, bounce, len);
    d += len, s += len, n -= len;
  }
}
uint64_t Checksum::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace cxlkv
