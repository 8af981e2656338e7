// `cxlkv sim`: N simulated hosts (threads, each its own Pool over its own EmuCache of one shared
// region) run put/get/match/remove/lease/namespace workloads on a multihost pool, with random
// host crashes and pauses past the lease; a checker counts every violation (see SimResult).
// Payloads derive from (namespace, key, version), so every accepted read is verified.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace cxlkv::sim {

struct SimOptions {
  int hosts = 3;
  // The whole run, wall clock: the workload gets what is left after the phases planned up front
  // (reserved_seconds). A run whose lease leaves no workload is refused (ArgumentError).
  double seconds = 4.0;
  uint64_t seed = 1;
  // "", "flush", "invalidate", "lock", "heal" (row healing resets a held stripe's ticket)
  std::string brk;
  // multihost, or flush: the one-host discipline (claim = CAS on the host's own cache), which the
  // emulator shows is not enough across hosts
  std::string backend = "multihost";
  uint32_t lease_ms = 500;  // long: a thread starved on a loaded CI machine must not look paused
  bool crashes = true;
  bool pauses = true;
  uint64_t pool_bytes = 4ull << 20;
  std::string tmp_dir = "/dev/shm";
  // Crash events hit this named fault point (insert.claimed, insert.copied, evict.claimed,
  // release.claimed, alloc.claimed, alloc.carving, lock.held) instead of a random coherence call.
  std::string fault;
  // Tests: the pool's creator is fenced before it closes (on a loaded machine its heartbeat thread
  // can starve past half a lease), so its node is left ALIVE in the image, as a crashed node's.
  bool creator_fenced = false;
};

struct SimResult {
  uint64_t ops = 0, verified_reads = 0, crashes = 0, pauses = 0, fenced = 0, attaches = 0;
  uint64_t fault_crashes = 0;  // crashes at the named fault point
  uint64_t misses = 0, other_errors = 0, lock_skips = 0, evictions = 0, pause_deferred = 0;
  // Row healing (the hosts' heartbeat chore): passes run, and stripes of a row it reset.
  uint64_t heal_passes = 0, healed = 0;
  // Row-less observers (one per host, reaping) that became writers on their host's row.
  uint64_t observer_writes = 0;
  // The final check could not run: its host was starved past half a lease (fenced) every time.
  // Safe (a fence, not a violation), but the run then proved less: reported, never hidden.
  bool check_incomplete = false;
  // violations, by kind (their sum is `violations`)
  std::map<std::string, uint64_t> kinds;
  uint64_t violations() const;
  std::vector<std::string> notes;  // first check errors and unexpected exceptions
  std::string to_json(const SimOptions& o) const;
};

// The part of o.seconds that is not workload: hosts stopping, then the final check, which waits
// a lease behind a crashed host's lock ticket, then two so that every crashed host is judged dead by
// lease before it checks the pool.
double reserved_seconds(const SimOptions& o);
// The shortest o.seconds run_sim accepts for o.lease_ms (reserved_seconds + a minimal workload).
double min_seconds(const SimOptions& o);

SimResult run_sim(const SimOptions& o);

}  // namespace cxlkv::sim
