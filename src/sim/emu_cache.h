// A non-coherent cache emulator (issue 9): each simulated host sees the pool through a PRIVATE
// full copy of the shared region, so every plain load and store of the real pool code hits that
// copy, stale until the host drops the line. Per 64-byte line the host also keeps `clean`, the
// line as it last came from or went to memory: dirty <=> private != clean.
//   writeback(line)  dirty: the WHOLE line goes to memory (a partial update overwrites the rest of
//                    the line: that is the hazard), clean = private
//   invalidate(line) dirty: misuse (the host's stores are lost: reported), then private = clean =
//                    memory
//   streamed(range)  non-temporal stores: memory = clean = private
// At every coherence call the host may evict a line (seeded RNG): a dirty one is written back, a
// clean one re-fetched, so partial updates reach memory in arbitrary order. Host-local atomics
// (the pool's CAS-free multihost protocol uses none across hosts) act on the private copy.
//
// Detectors (all counted as violations by the checker, sim.h):
//   lost_update       a write-back puts into memory a word that another host changed since this
//                     host fetched the line (one-writer-per-line broken, or a stale line written);
//                     metadata lines only (payload lines: see Memory::payload)
//   invalidate_dirty  the host dropped a line holding its own unpublished stores
//   lock_overlap      two hosts inside a critical section of one lock stripe at once
//   lost_ticket       a host inside a critical section whose ticket memory does not hold (its
//                     row reads empty to the other hosts: healing, or a writer, cleared it)
// Lines that are lossy by design are excluded: access hints (many writers) and per-node counters.
//
// Test switches (negative controls): flushes become no-ops; invalidations are skipped; the lock's
// ticket write-backs are dropped; row healing resets the row of a stripe the host holds.
//
// A host's heartbeat chores (row healing, Bakery::heal_own_row) run on a second thread of the
// host, as a real attachment's heartbeat thread runs them beside its workers, but stepped: at a
// coherence point of the host's thread (set_chores), which waits meanwhile. So the chores meet the
// host's stripes held (its thread parked inside lock(), tier 1 and ticket taken) and judge them as
// a heartbeat thread must, by the process-local mutex another thread holds, never by re-entering
// it, and the private cache needs no locking (one thread of the host runs at a time).
// Debugging: CXLKV_SIM_TRACE=1 prints a backtrace to stderr at every lost update or dirty drop
// (addr2line/c++filt turn it into the pool code path that did it).
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "coherence.h"
#include "format.h"

namespace cxlkv::sim {

struct Switches {
  bool no_flush = false;       // --break flush
  bool no_invalidate = false;  // --break invalidate
  bool no_lock_flush = false;  // --break lock
  bool heal_holders = false;   // --break heal
};

struct Counters {
  std::atomic<uint64_t> lost_update{0}, invalidate_dirty{0}, lock_overlap{0}, lost_ticket{0};
  std::atomic<uint64_t> evictions{0}, writebacks{0}, pause_deferred{0};
};

// The shared memory of the pod (coherent on this machine; accessed only by whole-line copies).
class Memory {
 public:
  Memory(std::vector<char> image, const format::PoolHeader& h);
  char* bytes() { return bytes_.data(); }
  uint64_t size() const { return bytes_.size(); }
  bool excluded(uint64_t line) const;  // lossy by design: not checked
  // Payload lines: written with streaming stores only, so a host's `clean` copy of them is no
  // baseline (it never fetched them); their integrity is checked end to end (every accepted read
  // is verified against its (key, version); torn blocks must fail their checksum).
  bool payload(uint64_t line) const;
  std::string region(uint64_t line) const;  // which pool area a line is in (reports)
  void report(const std::string& what);     // first few findings, with where
  std::vector<std::string> reports;
  std::mutex reports_mu;
  std::mutex& line_mu(uint64_t line) { return mu_[line % mu_.size()]; }
  Counters counters;
  std::array<std::atomic<int>, format::kLockStripes> holder;  // lock oracle: host in the CS, -1

 private:
  std::vector<char> bytes_;
  uint64_t access_lo_, access_hi_;          // line range of access hints
  uint64_t area_off_, area_bytes_, nodes_;  // node areas: counters lines 1 and 2 of each
  format::PoolHeader h_;
  std::array<std::mutex, 1024> mu_;
};

struct HostCrashed {};  // thrown once at the crash point; the host's later calls throw it too

struct EmuConfig {
  Switches sw;
  double p_evict = 0.05;  // per coherence call
  double p_yield = 0.02;  // per coherence call: lets other hosts' threads interleave
  double p_cs_yield = 0.05;
};

class EmuCache final : public CacheModel {
 public:
  EmuCache(Memory& m, int host, uint64_t seed, const EmuConfig& cfg);
  char* base() { return priv_.data(); }
  void writeback(const void* p, size_t n, bool point) override;
  void invalidate(const void* p, size_t n, bool point) override;
  void streamed(const void* p, size_t n) override;
  bool drop_lock_writeback() const override { return cfg_.sw.no_lock_flush; }
  bool heal_ignores_holders() const override { return cfg_.sw.heal_holders; }
  void lock_entered(uint32_t k, const void* own_line) override;
  void lock_left(uint32_t k) override;
  void fault_point(const char* name) override;
  // Crash at the next pass through the named fault point (instead of a random coherence call).
  void arm_fault(const std::string& name) { fault_armed_ = name; }

  // Driven by the simulation: the crash or pause happens at a later random coherence call.
  void arm_crash() { crash_armed_ = true; }
  // End of a run: a host still inside an operation (a broken discipline can stall it for leases)
  // crashes at its next coherence call. Set from another thread.
  void force_crash() { force_crash_.store(true, std::memory_order_relaxed); }
  // The host's heartbeat: run at coherence calls at most every interval_ns, as an independent
  // heartbeat thread would (and, like it, not while the host is paused or crashed).
  void set_ticker(std::function<void()> fn, uint64_t interval_ns) {
    ticker_ = std::move(fn), tick_interval_ns_ = interval_ns;
  }
  // The host's heartbeat chores (row healing): run on the host's chores thread at a coherence
  // point at most every interval_ns, while this host's thread waits (see the top). Set and cleared
  // from the host's thread; fn must not throw (a crash inside it shows at the host's next call).
  void set_chores(std::function<void()> fn, uint64_t interval_ns);
  uint64_t chore_runs() const { return chore_runs_; }
  ~EmuCache();
  void arm_pause(uint64_t ms) { pause_ms_ = ms; }
  bool crashed() const { return crashed_; }
  uint64_t pauses() const { return pauses_; }
  uint64_t fault_crashes() const { return fault_crashes_; }
  // After a crash: the host reboots with an empty cache (private = clean = memory).
  void reboot();
  // Every dirty line is written back or lost (each with probability 1/2): a host that stops.
  void resolve_dirty_lines();
  uint64_t dirty_checked_lines();

 private:
  uint64_t line_of(const void* p) const { return uint64_t(static_cast<const char*>(p) - priv_.data()) >> 6; }
  bool dirty(uint64_t line) const;
  void wb_line(uint64_t line);
  void fetch_line(uint64_t line);
  void at_point(const void* p, size_t n);
  void note(uint64_t line);

  Memory& m_;
  const int host_;
  EmuConfig cfg_;
  std::vector<char> priv_, clean_;
  std::mt19937_64 rng_;
  std::array<uint64_t, 64> recent_{};
  uint32_t recent_n_ = 0;
  bool crashed_ = false, crash_armed_ = false;
  std::string fault_armed_;
  std::atomic<bool> force_crash_{false};
  std::function<void()> ticker_;
  uint64_t tick_interval_ns_ = 0, last_tick_ns_ = 0;
  bool in_tick_ = false;
  // The chores thread and its hand-over (one of the host's two threads runs at a time).
  struct Chores;
  std::unique_ptr<Chores> chores_;
  uint64_t chores_interval_ns_ = 0, last_chores_ns_ = 0, chore_runs_ = 0;
  void run_chores();
  uint64_t pause_ms_ = 0, pauses_ = 0, fault_crashes_ = 0;
};

}  // namespace cxlkv::sim
