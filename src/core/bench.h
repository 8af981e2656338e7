// Core-side micro-benchmarks, timed in C++ so that Python call overhead does not hide the
// index's own latency. Used by `cxlkv bench index`.
#pragma once
#include <cstdint>

#include "pool.h"

namespace cxlkv {

struct IndexBenchResult {
  uint64_t lookups = 0, inserts = 0;
  double lookup_p50_ns = 0, lookup_p99_ns = 0, lookup_mean_ns = 0;
  double insert_p50_ns = 0, insert_p99_ns = 0;
  double lookups_per_s = 0;  // untimed loop: back-to-back lookups, no per-op clock reads
  double inserts_per_s = 0;
};

// Inserts `inserts` fresh keys (payload `payload_bytes`, seeded by `seed`) and looks up
// `lookups` random keys among them, for at least `seconds` of lookup throughput measurement.
IndexBenchResult bench_index(Pool& pool, const NsHandle& ns, uint64_t inserts, uint64_t lookups,
                             uint64_t payload_bytes, uint64_t seed, double seconds);

}  // namespace cxlkv
