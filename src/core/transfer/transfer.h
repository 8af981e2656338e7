// Types of the device-transfer protocol (transfer.cpp): a save in two phases, whose bytes a device
// (a GPU's DMA through a registered, UVA-mapped pool) writes between reserve and commit, and a
// load whose blocks are pinned and verified before a device reads them.
//
// Integrity: the checksum of a saved block is computed by the CPU over the pool bytes at commit,
// after the device's copy completed (never over the device's source): it covers the bytes that
// readers will see, with the core's one checksum (XXH3-64, checksum.h). A load is verified over
// the pool bytes while pinned, before the device copy, and rechecked after it: a pinned READY
// block is immutable by protocol, so only a stray writer could change it in between, and the
// recheck turns that into a miss. See docs/ARCHITECTURE.md, "The CUDA data path".
#pragma once
#include <array>
#include <cstdint>

#include "store_types.h"

namespace cxlkv {

// One block reserved for a key: an entry in WRITING owned by this node, naming the key, with the
// block recorded. Nobody else reads it, and other puts of the key see it in flight. Without a
// block (with_block false) it is an intent: the entry only, which other puts and reserves of the
// key see in flight, which is never published (commit refuses) and which costs no pool block.
struct Reservation {
  // capped: an intent refused because this node holds Pool::intent_cap() of them already.
  enum State : uint8_t { reserved, present, in_flight, failed, committed, aborted, capped };
  State state = failed;
  std::array<uint8_t, 32> key{};
  uint16_t depth = 0;
  uint64_t slot = 0;
  uint32_t gen = 0;
  uint32_t tag = 0;
  uint64_t chunk = 0;
  uint32_t block = 0;
  uint64_t offset = 0;  // payload's offset in the pool (reserved with a block only)
  bool with_block = true;
  QuotaCharge charged;  // what the block was charged to: an abort refunds exactly this
};

// One pinned, verified block of a load.
struct VerifiedBlock {
  uint64_t slot = 0;
  uint64_t word = 0;  // the READY state word it was verified under
  uint32_t pin_index = 0;
  uint64_t offset = 0;  // payload's offset in the pool
  uint64_t length = 0;
  uint64_t checksum = 0;
};

}  // namespace cxlkv
