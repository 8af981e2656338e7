// Liveness primitives that depend neither on pids (PID namespaces) nor on the hostname (UTS
// namespaces). See docs/ARCHITECTURE.md "Liveness" and the NodeSlot invariants in format.h.
//
//  * Same kernel: a node holds an OFD lock (F_OFD_SETLK) on one byte of the pool file per node
//    slot for the attachment's life. The kernel drops it when the last descriptor of that open
//    file description goes away (process death included), in every PID namespace alike.
//  * Another kernel (a future CXL host, or a simulated one): a heartbeat counter in the node's own
//    cache line, advanced by one thread per process; a judge declares the node dead when the
//    counter has not moved for a whole lease measured on the judge's own monotonic clock.
//
// Fork: the child shares the parent's open file descriptions, so an inherited lock descriptor
// would keep the parent's lock alive after the parent died. A pthread_atfork child handler closes
// every lock descriptor this library opened (O_CLOEXEC covers exec), and the heartbeat thread does
// not exist in the child, so a child never keeps its parent's node alive. A fork is safe at any
// time after start_heartbeat returned: the thread is then in its loop, and it never exits.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "coherence.h"
#include "format.h"

namespace cxlkv::liveness {

// Identity of the liveness domain "this kernel": hash of /proc/sys/kernel/random/boot_id (shared
// by all containers of one kernel, unlike the hostname). CXLKV_HOST_ID overrides it, making the
// process act as another host: it is then judged by its heartbeat lease only (tests; issue 9's
// simulated hosts). Never 0.
uint64_t host_id();

// A lock descriptor on the pool file. lock_id is a hash of (st_dev, st_ino): two nodes see each
// other's locks only if they run on one kernel AND locked the same inode. 0 = no usable lock
// (the node is then judged by its lease only).
struct LockFile {
  int fd = -1;
  bool writable = false;
  uint64_t lock_id = 0;
};
// Opens path (O_NOFOLLOW) for locking; no usable lock unless it is still the mapped file
// (want_dev, want_ino): the path may have been replaced since it was mapped.
LockFile open_lock_file(const std::string& path, uint64_t want_dev, uint64_t want_ino);
void close_lock_file(LockFile& f);
// Non-blocking exclusive lock of byte `off`: true if taken (or already held by this descriptor).
bool try_lock(const LockFile& f, uint64_t off);
void unlock(const LockFile& f, uint64_t off);
// True if another open file description holds byte `off` (F_OFD_GETLK).
bool lock_held_by_other(const LockFile& f, uint64_t off);

// 32-bit tag of (host_id, lock_id) stored in the node state word, so that even a CLAIMED slot
// (whose identity fields are not published yet) can be judged. Never 0.
uint32_t domain_tag(uint64_t host_id, uint64_t lock_id);

// Registers the heartbeat of one attachment with the process's heartbeat thread. Every interval
// it checks that the slot's state word still equals `expected` (else the node was reclaimed:
// *fenced is set and beating stops) and advances slot->beat. Unregister before unmapping.
// last_beat (optional) receives the monotonic time taken just before each beat was published: the
// multihost fence (arbiter.h) refuses to store once it is older than half a lease.
// chores (optional): run by the heartbeat thread after each published beat (multihost: the
// attachment heals its own lock row, Bakery::heal_own_row); must not block.
uint64_t start_heartbeat(format::NodeSlot* slot, uint64_t expected, uint64_t interval_ns, Coherence coh,
                         std::atomic<bool>* fenced, const std::function<bool()>* intact = nullptr,
                         std::atomic<uint64_t>* last_beat = nullptr, uint64_t lapse_ns = 0,
                         const std::function<void()>* chores = nullptr);
// One beat, as the heartbeat thread does it (the emulator's hosts call it from their own thread):
// false, and *fenced set, once the slot's state word is no longer `expected`, or (lapse_ns > 0)
// once the previous beat is older than lapse_ns: a node that stood still that long may have been
// declared dead already, and a fresh beat must not un-fence it (multihost fencing, arbiter.h).
bool beat(format::NodeSlot* slot, uint64_t expected, const Coherence& coh, std::atomic<bool>* fenced,
          std::atomic<uint64_t>* last_beat, uint64_t lapse_ns = 0);
void stop_heartbeat(uint64_t handle);

uint64_t mono_ns();

}  // namespace cxlkv::liveness
