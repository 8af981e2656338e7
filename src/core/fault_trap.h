// Test-only trap at a named fault point in a REAL process (the emulator's CacheModel::fault_point
// does the same for simulated hosts). `CXLKV_TEST_FAULT=<point>[:kill|:stop][@N]`, read once at
// the first attach of the process, arms one point (insert.claimed, insert.copied, evict.claimed,
// alloc.claimed, alloc.carving, lock.held): its N-th hit (default 1st) writes one line
// "cxlkv-fault <point> <pid>" to stderr, then SIGKILLs the process (kill -9 exactly there) or
// SIGSTOPs it (a slow host, resumed later by SIGCONT; it fires once). Unarmed, a fault point costs
// one load of `armed` and a predictable branch (Coherence::fault); a production process never sets
// the variable (tests/python/test_multihost_procs.py does).
#pragma once
#include <cstdint>
#include <memory>

namespace cxlkv {
class Arbiter;
}

namespace cxlkv::fault_trap {

// The armed point's name, nullptr when none. Written once (arm_from_env, under std::call_once)
// before the first attachment of the process publishes anything, read-only afterwards.
inline const char* armed = nullptr;

// Reads CXLKV_TEST_FAULT once per process; throws ArgumentError on a malformed value.
void arm_from_env();
// Called at a fault point when `armed` is set: fires when `name` is the armed point's N-th hit.
void hit(const char* name);
// "lock.held" (the cross-host lock of a claim is held; the emulator's point sits in
// Coherence::locked_rmw): an Arbiter that forwards to `inner` and hits the point right after
// each lock(). Pool::setup_arbiter installs it only when lock.held is armed.
std::unique_ptr<Arbiter> trap_lock(Arbiter& inner);

}  // namespace cxlkv::fault_trap
