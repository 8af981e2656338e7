// A new pool's geometry: the creation options and the pure function that places every area of the
// pool from them (geometry.cpp). Format facts only: the façade (pool.h) and the tests use it.
#pragma once
#include <cstdint>

#include "backend.h"
#include "format.h"

namespace cxlkv {

struct CreateOptions {
  uint64_t size = 0;
  uint64_t chunk_bytes = 0;  // 0: derived from size
  uint64_t index_slots = 0;  // 0: derived from size
  uint32_t max_nodes = 64;
  uint32_t pin_slots = 0;  // 0: derived from size, at most format::kDefaultPinSlots
  uint32_t max_namespaces = 64;
  Backend backend = Backend::coherent;
  uint32_t lease_ms = format::kLeaseMsDefault;  // heartbeat lease for nodes of another kernel
  uint32_t lock_hosts = 0;    // multihost: host slots of the lock area; 0: kLockHostsDefault
  uint64_t stripe_bytes = 0;  // a pool over several devices: 0 = format::kStripeBytesDefault
  // Block-less intents one node may hold at once, in thousandths of the index (format 2.5).
  uint32_t intent_permille = format::kIntentPermilleDefault;
  bool allow_foreign_owner = false;  // with exist_ok: see OpenOptions
  bool allow_group = false;
};

// Fills the geometry fields of `h` (area offsets, node/pin/namespace/index/chunk counts, lock area
// for multihost) for a pool of opt.size bytes; the zero options are derived from the size.
// Throws ArgumentError when an option is out of range or the size cannot hold the metadata plus
// one chunk. Pure: no I/O (geometry.cpp; table tests in tests/cpp/test_geometry.cpp).
void plan_geometry(format::PoolHeader& h, const CreateOptions& opt);
// The same for a pool striped over `devices` devices: the size is rounded down to a multiple of
// the stripe, then planned as above, then the stripe table `t` (device sizes) is filled.
void plan_striped_geometry(format::PoolHeader& h, format::StripeTable& t, const CreateOptions& opt,
                           uint32_t devices, bool devdax);

}  // namespace cxlkv
