// Pool geometry: where every area of a new pool goes, from its size and the creation options.
// A pure function of its inputs (no I/O), tested by table in tests/cpp/test_geometry.cpp; the
// open path re-validates every field it writes (Pool::validate_and_attach), so a forged header
// never relies on this code having produced it.
#include <algorithm>
#include <string>

#include "geometry.h"

#include "errors.h"
#include "format.h"
#include "stripe_table.h"

namespace cxlkv {

using namespace format;

namespace {
uint64_t pow2_floor(uint64_t v) { return v ? 1ull << (63 - __builtin_clzll(v)) : 0; }
uint64_t pow2_ceil(uint64_t v) { return v <= 1 ? 1 : 1ull << (64 - __builtin_clzll(v - 1)); }

}  // namespace

void plan_geometry(PoolHeader& h, const CreateOptions& opt) {
  if (opt.max_nodes == 0 || opt.max_nodes > kMaxNodes)
    throw ArgumentError("max_nodes must be in 1.." + std::to_string(kMaxNodes));
  if (opt.pin_slots > (1u << 20)) throw ArgumentError("pin_slots must be in 1..1048576");
  // 0: derived. The pin arrays of all nodes take at most 1/32 of the pool, between 256 and
  // kDefaultPinSlots per node: a 4 MiB test pool keeps its room for blocks, a pool of 64 MiB or
  // more gets the full default (a small pool cannot hold enough blocks to need more pins anyway).
  uint32_t pin_slots = opt.pin_slots;
  if (pin_slots == 0)
    pin_slots = uint32_t(std::clamp<uint64_t>(opt.size / 32 / opt.max_nodes / 8, 256, kDefaultPinSlots));
  if (opt.intent_permille == 0 || opt.intent_permille > kIntentPermilleMax)
    throw ArgumentError("intent_permille must be in 1.." + std::to_string(kIntentPermilleMax));
  if (opt.max_namespaces == 0 || opt.max_namespaces > kMaxNamespaces)
    throw ArgumentError("max_namespaces must be in 1.." + std::to_string(kMaxNamespaces));
  uint64_t size = opt.size;
  uint64_t chunk = opt.chunk_bytes;
  if (chunk == 0) {
    chunk = pow2_floor(size / 64);
    chunk = std::max<uint64_t>(4ull << 20, std::min<uint64_t>(chunk, 64ull << 20));
  }
  if (chunk < 64 * 1024 || chunk % kMetaAlign)
    throw ArgumentError("chunk size must be a multiple of 4 KiB and at least 64 KiB");
  uint64_t slots = opt.index_slots;
  if (slots == 0) {
    slots = pow2_ceil(2 * (size / (8 * 1024)));
    while (slots > 4096 && slots * (sizeof(IndexEntry) + 8) > size / 16) slots /= 2;
    slots = std::max<uint64_t>(slots, 4096);
  }
  if (slots & (slots - 1)) throw ArgumentError("index_slots must be a power of two");
  if (slots < 64 || slots > (1ull << 36)) throw ArgumentError("index_slots out of range");

  uint64_t off = kSharedWordsOff + kMetaAlign;
  // Only the multihost backend has a lock area: a host count for another one would be ignored.
  if (opt.lock_hosts && opt.backend != Backend::multihost)
    throw ArgumentError(
        "lock_hosts is only meaningful for the multihost backend (the lock area's host rows)");
  if (opt.backend == Backend::multihost) {
    uint32_t hosts = opt.lock_hosts ? opt.lock_hosts : kLockHostsDefault;
    if (hosts > kMaxLockHosts)
      throw ArgumentError("lock_hosts must be in 1.." + std::to_string(kMaxLockHosts));
    h.lock_hosts = hosts;
    off = round_up(kLockAreaOff + uint64_t(kLockStripes) * hosts * sizeof(LockLine), kMetaAlign);
  }
  h.node_table_off = off;
  off = round_up(off + uint64_t(opt.max_nodes) * sizeof(NodeSlot), kMetaAlign);
  h.node_area_bytes = round_up(admin_mailbox_off(pin_slots) + admin_mailbox_bytes(opt.max_nodes), kMetaAlign);
  h.node_area_off = off;
  off += uint64_t(opt.max_nodes) * h.node_area_bytes;
  h.ns_table_off = off;
  off = round_up(off + uint64_t(opt.max_namespaces) * sizeof(NamespaceEntry), kMetaAlign);
  h.index_off = off;
  off += slots * sizeof(IndexEntry);
  h.access_off = off;
  off = round_up(off + slots * 8, kMetaAlign);
  h.chunk_map_off = off;
  uint64_t stride = chunk_desc_bytes(chunk) + chunk;
  uint64_t rest = size > off ? size - off : 0;
  uint64_t count = rest / (stride + 8);
  while (count > 0 && round_up(off + count * 8, 65536) + count * stride > size) --count;
  if (count == 0) {
    // A pool smaller than one default chunk: shrink the chunk to what is left.
    if (opt.chunk_bytes == 0 && rest > 2 * 65536 + 65536) {
      CreateOptions o = opt;
      o.chunk_bytes = round_up((rest - 2 * 65536) / 2, kMetaAlign);
      if (o.chunk_bytes > 64 * 1024 && o.chunk_bytes < chunk) return plan_geometry(h, o);
    }
    throw ArgumentError("pool size " + std::to_string(size) + " is too small for its metadata (" +
                        std::to_string(off) + " bytes) plus one chunk of " + std::to_string(stride) +
                        " bytes");
  }
  h.chunk_count = count;
  h.chunk_bytes = chunk;
  h.arena_off = round_up(off + count * 8, 65536);
  h.index_slots = slots;
  h.max_nodes = opt.max_nodes;
  h.pin_slots = pin_slots;
  h.max_namespaces = opt.max_namespaces;
  h.pool_bytes = size;
}

// A striped pool: the areas are laid out exactly as in one device (the pool is one range), so the
// only rules are the stripe's: the size is cut to whole stripes, at least one per device, and the
// stripe table records each device's share. Chunks may span stripes (their stride is not tied to
// the stripe): a large block copy then spreads over devices, and device placement works per block
// (placement.cpp: a bound namespace takes only blocks inside one stripe of its device).
void plan_striped_geometry(PoolHeader& h, StripeTable& t, const CreateOptions& opt, uint32_t devices,
                           bool devdax) {
  const uint64_t stripe = opt.stripe_bytes ? opt.stripe_bytes : kStripeBytesDefault;
  CreateOptions o = opt;
  if (stripe) o.size = opt.size / stripe * stripe;
  plan_stripes(t, o.size, devices, stripe, devdax);  // validates stripe and size first
  plan_geometry(h, o);
}

}  // namespace cxlkv
