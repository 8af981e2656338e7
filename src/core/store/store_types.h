// The store's value types: what callers of the index and the allocator hand in and get back
// (a namespace handle, keys, payload pieces, pins, scan records, usage figures). Plain values, no
// pool state: every room that speaks to the store includes this, never pool.h.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "format.h"

namespace cxlkv {

struct NsHandle {
  uint32_t id = 0;  // 1-based namespace id (index in the table + 1)
  uint64_t block_bytes = 0;
  format::ChunkGeometry geo{};
  std::string name;
  int device = -1;         // placement (placement.cpp): -1 = any device, else blocks only on that device
  uint8_t tenant_row = 0;  // format/quota.h: the quota row of the tenant this handle writes for; 0 = none
};

// One device of the pool as `pool info` shows it (placement.cpp): its path, the pool bytes it
// holds, and the bytes of carved blocks (capacity) and of used blocks that lie on it.
struct DeviceUse {
  std::string path;
  uint64_t pool_bytes = 0, device_bytes = 0, capacity_bytes = 0, used_bytes = 0;
};

// One namespace's share of the arena (placement.cpp, `cxlkv exporter`, `pool info`): chunks
// carved for it, their blocks, and the blocks holding data (a descriptor != 0).
struct NamespaceUse {
  uint32_t id = 0;
  uint64_t chunks = 0, capacity_blocks = 0, used_blocks = 0;
};

using Key = std::array<uint8_t, 32>;

// What put() did: stored now; already present (READY); being stored right now by a live writer
// (not readable yet: not counted as stored); failed (no block could be allocated or evicted).
enum class PutResult { stored, present, in_flight, failed };

// A contiguous piece of a block's payload in caller memory (gather source / scatter target).
struct Piece {
  char* ptr;
  uint64_t bytes;
};

// One strided fragment family: for block id b, bytes at base + b * block_stride.
struct Fragment {
  uintptr_t base;
  int64_t block_stride;
  uint64_t bytes;
};

// One READY index entry as `Pool::scan_index` saw it (a consistent snapshot): which block of
// which namespace lives in `slot`, in which incarnation (`gen` changes on every reuse of the slot).
struct IndexRecord {
  uint64_t slot;
  uint32_t gen;
  uint32_t ns_id;  // checked: 1..max_namespaces
  uint16_t depth;  // the writer's chain depth (a hint)
  uint8_t key[32];
};

// The quota rows one block was charged to when a put took it (Index::quota_admit), kept by the
// writer: a put that gives the block back refunds exactly this, whatever the pool's copy of its
// entry says by then (the pool is untrusted).
struct QuotaCharge {
  uint8_t tenant_row = 0;
  uint8_t ns_row = 0;
};

struct PinRef {
  uint64_t slot;
  uint32_t gen;
  uint32_t pin_index;
};

// Stamps every access hint written by this thread while alive with one time (ms; 0 = now), so
// that the keys of one batch rank by chain depth alone (index.cpp: Index::touch; defined there).
class AccessStamp {
 public:
  explicit AccessStamp(uint64_t ms = 0);
  ~AccessStamp();
  AccessStamp(const AccessStamp&) = delete;
  AccessStamp& operator=(const AccessStamp&) = delete;
  static uint64_t current();

 private:
  uint64_t prev_;
};

}  // namespace cxlkv
