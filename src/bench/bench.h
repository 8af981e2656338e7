// Core-side micro-benchmarks, timed in C++ so that Python call overhead does not hide the
// index's own latency. Used by `cxlkv bench index`.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "pool.h"

namespace cxlkv {

struct IndexBenchResult {
  uint64_t lookups = 0, inserts = 0;
  double lookup_p50_ns = 0, lookup_p99_ns = 0, lookup_mean_ns = 0;
  double insert_p50_ns = 0, insert_p99_ns = 0;
  double lookups_per_s = 0;  // untimed loop: back-to-back lookups, no per-op clock reads
  double inserts_per_s = 0;
  // The memory's limit, measured in the same run: a dependent random 64-byte read (pointer
  // chase, one clock read per hop like the lookups) in a private mapping as large as the index.
  double line_read_p50_ns = 0;
  // The connector's real call: match_prefix / acquire+release of 256 present keys, per key.
  double prefix256_match_ns_per_key = 0, prefix256_acquire_ns_per_key = 0;
  double lookup_vs_line_read = 0, prefix256_vs_line_read = 0;
  // (name, value) of every field above: the binding's dict is built from this one list.
  std::vector<std::pair<const char*, double>> fields() const;
};

// Inserts `inserts` fresh keys (payload `payload_bytes`, seeded by `seed`) and looks up
// `lookups` random keys among them, for at least `seconds` of lookup throughput measurement.
IndexBenchResult bench_index(Pool& pool, const NsHandle& ns, uint64_t inserts, uint64_t lookups,
                             uint64_t payload_bytes, uint64_t seed, double seconds);

}  // namespace cxlkv
