// The stripe loop of XXH3-64 (xxHash's long-input path: 64-byte stripes, 16 stripes per block of
// the default 192-byte secret, a scramble after every full block), written so that one copy
// kernel can hash the very registers it stores. Internal to checksum.cpp; the result is
// bit-identical with XXH3_64bits() of the same bytes (tests/cpp/test_checksum.cpp checks every
// size 0..4096 and large ones against libxxhash), so the pool format does not change.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cxlkv::xxh3k {

constexpr size_t kStripe = 64;
constexpr uint32_t kStripesPerBlock = 16;  // (kSecretBytes - kStripe) / 8
constexpr size_t kSecretBytes = 192;       // XXH3's default secret

// The eight 64-bit accumulators and the position inside the current block.
struct Acc {
  alignas(64) uint64_t v[8];
  uint32_t stripe = 0;  // stripes accumulated in the current block, 0..15
};

void init(Acc& a);
// XXH3's default secret (XXH3_kSecret), fetched once from libxxhash.
const uint8_t* default_secret();

// Accumulates k whole stripes of src, scrambling after each 16th stripe of a block.
using HashFn = void (*)(Acc& a, const uint8_t* secret, const char* src, size_t k);
// Copies k whole stripes src -> dst with streaming stores (any alignment of either) and
// accumulates the stripes it stored, all k of them, or the first k-1 when hold_last (the
// caller does not know yet whether more input follows). Each source byte is loaded once; the
// stored bytes and the hashed bytes are the same registers. Writes what it stored of stripe k-1
// to last[64] and, if before != nullptr and k >= 2, of stripe k-2 to before[64]. No fence.
// `ahead` (may be null) is where the caller's next copy will read from: while it copies line j
// the kernel asks for line j of `ahead` too (into L2, for the first ahead_len bytes), so two
// source streams are in flight at once (see copy_hash_avx512). A hint only: never dereferenced.
using CopyHashFn = void (*)(Acc& a, const uint8_t* secret, char* dst, const char* src, size_t k,
                            bool hold_last, uint8_t* last, uint8_t* before, const char* ahead,
                            size_t ahead_len);

HashFn pick_hash();
// nullptr where the CPU has no fused kernel (then the caller copies through a bounce buffer).
CopyHashFn pick_copy_hash();

// The final digest of a long input (total > 240 bytes): `last` is the input's final 64 bytes.
uint64_t finish(const Acc& a, const uint8_t* secret, const uint8_t* last, uint64_t total);

}  // namespace cxlkv::xxh3k
