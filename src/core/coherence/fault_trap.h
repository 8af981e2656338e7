// Test-only trap at a named fault point in a REAL process (the emulator's CacheModel::fault_point
// does the same for simulated hosts). The points: insert.claimed, insert.copied, evict.claimed,
// release.claimed (a reclaimer holds an abandoned entry), alloc.claimed, alloc.carving, lock.held
// (Coherence::locked_rmw, the cross-host lock held). Two ways to arm them, one hook:
//  * `CXLKV_TEST_FAULT=<point>[:kill|:stop][@N]`, read once at the first attach of the process
//    (tests/python/test_multihost_procs.py): the N-th hit (default 1st) of that point writes one
//    line "cxlkv-fault <point> <pid>" to stderr, then SIGKILLs the process (kill -9 exactly there)
//    or SIGSTOPs it (a slow host, resumed later by SIGCONT; it fires once).
//  * a C++ test sets `hook` itself (tests/cpp/test_host_slot.cpp), e.g. in a forked child.
// Unset, a fault point costs one relaxed load of `hook` and a predictable branch
// (Coherence::fault); a production process never sets either.
#pragma once
#include <atomic>

namespace cxlkv::fault_trap {

using Hook = void (*)(const char* point);
// Called at every named fault point of a Coherence without a cache model; nullptr: none.
inline std::atomic<Hook> hook{nullptr};

// Reads CXLKV_TEST_FAULT once per process (installs `hit` as the hook when set); throws
// ArgumentError on a malformed value.
void arm_from_env();
// The hook CXLKV_TEST_FAULT installs: fires when `name` is the armed point's N-th hit.
void hit(const char* name);

}  // namespace cxlkv::fault_trap
