// Where a key lives in the index: the ONE recipe, shared by the index (index.cpp) and the checker
// (check_blocks.cpp). Part of the persistent format: changing it moves every key of existing
// pools out of its probe window, so it needs a kFormatMajor bump.
//   h    = XXH3_64(key[32], seed = namespace id)
//   home = h & (index_slots - 1)          the first slot of the key's probe window
//   tag  = bits 40..63 of h (24 bits)     stored in the entry's state word (format.h IndexEntry)
#pragma once
#include <cstdint>

// Inlined into the lookup loops (XXH_INLINE_ALL): the same XXH3-64 as xxh3() in checksum.cpp,
// without a call per key.
#include "xxhash_inline.h"

namespace cxlkv {

struct KeyHash {
  uint64_t home;
  uint32_t tag;
};
inline uint64_t key_hash64(const uint8_t* key32, uint32_t ns_id) {
  return XXH3_64bits_withSeed(key32, 32, ns_id);
}
inline uint32_t key_tag(uint64_t h) { return uint32_t(h >> 40) & 0xFFFFFF; }
inline KeyHash key_hash_split(uint64_t h, uint64_t slot_mask) { return {h & slot_mask, key_tag(h)}; }
inline KeyHash key_hash(const uint8_t* key32, uint32_t ns_id, uint64_t slot_mask) {
  return key_hash_split(key_hash64(key32, ns_id), slot_mask);
}

}  // namespace cxlkv
