#include "checksum.h"

#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include <new>

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
uint64_t Checksum::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace cxlkv
