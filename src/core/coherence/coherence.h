// The coherence layer: the ONLY way the rest of the core touches shared pool metadata.
//
// Every primitive is named by what it guarantees to other participants, not by how:
//   read(w)          see the latest published value of a shared word (acquire)
//   publish(w, v)    make v, and everything written before it, visible to others (release)
//   claim(w, e, d)   take exclusive ownership of a word: succeeds for exactly one contender
//   flush(p, n)      make plain writes in [p, p+n) visible to other hosts
//   invalidate(p, n) drop stale copies of [p, p+n) before reading what other hosts wrote
//   snapshot(d,s,n,v,seen)  copy a record guarded by version word v: true only if the copy is
//                    the whole version `seen` (seqlock read; no data race, seen by the emulator);
//                    snapshot_matches compares words of it in place instead of copying
//   fence()          order this participant's earlier stores before its later loads
//   stream_copy      copy a payload into the pool without leaving it in this CPU's cache
//
// Backends (chosen at pool creation, stored in the header):
//   coherent  one host; hardware coherence; claim is a CAS. flush/invalidate are no-ops.
//   flush     the software discipline of non-coherent CXL 2.0 memory (Beluga, TraCT): metadata
//             writes are written back with clwb/clflushopt, metadata reads drop the line first,
//             payloads go through streaming stores. claim is still a CAS here, which is only
//             correct while all participants share one coherence domain; the multi-host backend
//             replaces claim alone (lock-manager arbitration), nothing else in the protocols.
//   multihost several hosts, no coherence and no atomic RMW between them (CXL 2.0): the flush
//             discipline, plus claim and publish_shared as read-compare-store-write-back under a
//             striped cross-host lock (Lamport's bakery on per-host lines, arbiter.h), plus the
//             lease self-check (fencing) before every store that others may see.
//
// Tests plug a CacheModel (src/sim: a non-coherent cache emulator) under any backend: then
// flush/invalidate/stream_written act on the model's private copy of the pool instead of the CPU.
//
// Protocol rule: no code outside this header may use an atomic read-modify-write on pool memory.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "backend.h"
#include "copy_kernels.h"
#include "fault_trap.h"

namespace cxlkv {

// A model of a non-coherent cache (tests only; src/sim/emu_cache.h). `point` marks a coherence
// call where the model may act (random eviction, pause, crash); false inside a claim's critical
// section, whose steps are one atomic action of the protocol.
class CacheModel {
 public:
  virtual ~CacheModel() = default;
  virtual void writeback(const void* p, size_t n, bool point) = 0;   // clwb/clflushopt + sfence
  virtual void invalidate(const void* p, size_t n, bool point) = 0;  // clflushopt + mfence
  virtual void streamed(const void* p, size_t n) = 0;                // non-temporal stores + sfence
  // The cross-host lock's own ticket write-backs (a test switch drops them: a negative control).
  virtual bool drop_lock_writeback() const { return false; }
  // Row healing that resets a ticket under a stripe a thread of ours holds (a test switch: the
  // negative control of the rule that healing never clears a live holder's row).
  virtual bool heal_ignores_holders() const { return false; }
  // Oracle of the lock: called on entering and leaving a critical section of stripe k; own_line is
  // the holder's lock line of that stripe, whose ticket memory must hold while it is inside.
  virtual void lock_entered(uint32_t, const void* /*own_line*/) {}
  virtual void lock_left(uint32_t) {}
  // A named fault point of a protocol (insert, evict, alloc, lock): a test crashes the host there.
  virtual void fault_point(const char*) {}
};

// Cross-host arbitration and fencing of one attachment (arbiter.h); multihost backend only.
class Arbiter {
 public:
  virtual ~Arbiter() = default;
  virtual void lock(const void* line) = 0;
  virtual void unlock(const void* line) = 0;
  // Throws FencedError once this attachment may have been declared dead by a peer (fencing).
  virtual void check_fence() = 0;
};

class Coherence {
 public:
  explicit Coherence(Backend b = Backend::coherent, CacheModel* model = nullptr, Arbiter* arb = nullptr)
      : backend_(b), model_(model), arb_(b == Backend::multihost ? arb : nullptr) {}
  Backend backend() const { return backend_; }
  bool needs_flush() const { return backend_ != Backend::coherent; }
  CacheModel* model() const { return model_; }
  // The same discipline without arbitration or fencing (the heartbeat: it must beat to stay
  // alive, and it checks its own state word instead).
  Coherence unarbitrated() const { return Coherence(backend_, model_, nullptr); }

  uint64_t read(const uint64_t* w) const {
    invalidate(w, sizeof *w);
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(w)).load(std::memory_order_acquire);
  }
  // Relaxed read for hints (access times): a stale value is harmless by design.
  uint64_t read_hint(const uint64_t* w) const {
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(w)).load(std::memory_order_relaxed);
  }
  // For a word alone in its line or in a line only this node writes (one writer per line).
  void publish(uint64_t* w, uint64_t v) const {
    if (arb_) arb_->check_fence();
    std::atomic_ref<uint64_t>(*w).store(v, std::memory_order_release);
    flush(w, sizeof *w);
  }
  // For a word whose cache line other nodes write too (chunk map, block descriptors: 8 words per
  // line): a plain write-back would put this host's stale copy of the neighbours back into memory.
  void publish_shared(uint64_t* w, uint64_t v) const {
    if (!arb_) return publish(w, v);
    uint64_t dummy = 0;
    locked_rmw(w, dummy, v, /*compare=*/false);
  }
  // Before plain stores to shared metadata that a flush will publish: a fenced node must stop
  // before its stores, because a dirty line reaches memory whether or not it is flushed.
  void check_fence() const {
    if (arb_) arb_->check_fence();
  }
  // Batched publication (RPC, rpc.h): publish_deferred() stores and writes back the line but
  // leaves out the fence; one publish_fence() after a batch orders all of them.
  void publish_deferred(uint64_t* w, uint64_t v) const {
    std::atomic_ref<uint64_t>(*w).store(v, std::memory_order_release);
    if (needs_flush()) kernels::writeback_lines_nofence(w, sizeof *w);
  }
  void publish_fence() const {
    if (needs_flush()) kernels::store_fence();
  }
  // Batched reads: one invalidate(p, n) (which ends with a fence) for many lines, then this
  // acquire load per word inside [p, p+n).
  uint64_t read_after_invalidate(const uint64_t* w) const {
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(w)).load(std::memory_order_acquire);
  }
  // Seqlock read of the n-byte record at src (whole 8-byte words, 8-aligned) guarded by the
  // version word *version, which the caller read a moment ago as `seen` (read()). Drops stale
  // lines, copies every word with a relaxed atomic load (a torn copy is possible, a data race in
  // C++ terms is not), orders those loads before the re-read (acquire fence), and re-reads the
  // version. True: no writer moved the version meanwhile, so dst holds one consistent version of
  // the record, the one published as `seen`. False: discard dst. Relies on the writers' rule:
  // move the version away (claim) before changing a field, publish it back last (publish).
  bool snapshot(void* dst, const void* src, size_t n, const uint64_t* version, uint64_t seen) const {
    invalidate(src, n);
    copy_words(dst, src, n);
    return read(version) == seen;
  }
  // The seqlock compare, for a lookup that only asks "is it this key?": true if the `words` words
  // at src, each masked by mask[i], equal expect[i] in one version of the record, the one
  // published as `seen`. snapshot() without the copy: the same invalidate, relaxed loads, acquire
  // fence and re-read of the version, compared in registers.
  bool snapshot_matches(const void* src, const uint64_t* expect, const uint64_t* mask, size_t words,
                        const uint64_t* version, uint64_t seen) const {
    invalidate(src, words * 8);
    auto* s = static_cast<uint64_t*>(const_cast<void*>(src));
    uint64_t diff = 0;
    for (size_t i = 0; i < words; ++i)
      diff |= (std::atomic_ref<uint64_t>(s[i]).load(std::memory_order_relaxed) ^ expect[i]) & mask[i];
    std::atomic_thread_fence(std::memory_order_acquire);
    return read(version) == seen && diff == 0;
  }
  // The same after the caller's own invalidate of [src, src+n) (batched reads, as
  // read_after_invalidate): `seen` came from read_after_invalidate.
  bool snapshot_after_invalidate(void* dst, const void* src, size_t n, const uint64_t* version,
                                 uint64_t seen) const {
    copy_words(dst, src, n);
    return read_after_invalidate(version) == seen;
  }
  void write_hint(uint64_t* w, uint64_t v) const {
    std::atomic_ref<uint64_t>(*w).store(v, std::memory_order_relaxed);
  }
  // On success the caller owns the word's transition; on failure `expected` holds what it saw.
  bool claim(uint64_t* w, uint64_t& expected, uint64_t desired) const {
    if (arb_) return locked_rmw(w, expected, desired, /*compare=*/true);
    if (model_)
      model_->invalidate(w, sizeof *w, true);
    else if (needs_flush())
      hw_evict(w, sizeof *w);
    bool ok = std::atomic_ref<uint64_t>(*w).compare_exchange_strong(
        expected, desired, std::memory_order_seq_cst, std::memory_order_acquire);
    if (ok) flush(w, sizeof *w);
    return ok;
  }
  // Increment of a counter in this node's own area: only threads of the owning process write it,
  // so the RMW never crosses hosts; others read it with read_hint.
  void bump_owned(uint64_t* w, uint64_t v) const {
    std::atomic_ref<uint64_t>(*w).fetch_add(v, std::memory_order_relaxed);
  }
  void flush(const void* p, size_t n) const {
    if (model_)
      model_->writeback(p, n, true);
    else if (needs_flush())
      hw_writeback(p, n);
  }
  void invalidate(const void* p, size_t n) const {
    if (model_)
      model_->invalidate(p, n, true);
    else if (needs_flush())
      hw_evict(p, n);
  }
  // multihost metadata uses clflush both ways (docs/ARCHITECTURE.md: clflush vs clflushopt).
  void hw_writeback(const void* p, size_t n) const {
    if (backend_ == Backend::multihost)
      kernels::flush_lines_sync(p, n);
    else
      kernels::writeback_lines(p, n);
  }
  void hw_evict(const void* p, size_t n) const {
    if (backend_ == Backend::multihost)
      kernels::flush_lines_sync(p, n);
    else
      kernels::evict_lines(p, n);
  }
  // Named fault point (tests: the cache model may crash the host here; in a real process the
  // test-only hook of fault_trap.h may stop or kill it). Unset: one relaxed load and a branch.
  void fault(const char* name) const {
    if (model_)
      model_->fault_point(name);
    else if (auto hook = fault_trap::hook.load(std::memory_order_relaxed)) [[unlikely]]
      hook(name);
  }
  void fence() const { kernels::full_fence(); }
  void stream_copy(void* dst, const void* src, size_t n) const {
    kernels::stream_copy(dst, src, n);
    if (model_) model_->streamed(dst, n);
  }
  void stream_fence() const { kernels::store_fence(); }
  // [p, p+n) was just written with streaming stores (Checksum::update_copy): on hardware they
  // bypassed the cache already; a cache model pushes them to its memory now.
  // The streaming stores are issued already (they cannot be recalled): a model gets them first;
  // then the fence check stops a fenced writer before it publishes anything about them (a block
  // handed to another node meanwhile is torn, and its checksum says so).
  void stream_written(const void* p, size_t n) const {
    if (model_) model_->streamed(p, n);
    if (arb_) arb_->check_fence();
  }

 private:
  // Relaxed atomic word loads, then an acquire fence: the copying half of snapshot().
  static void copy_words(void* dst, const void* src, size_t n) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<uint64_t*>(const_cast<void*>(src));
    for (size_t i = 0; i < n / 8; ++i) {
      const uint64_t v = std::atomic_ref<uint64_t>(s[i]).load(std::memory_order_relaxed);
      std::memcpy(d + i * 8, &v, 8);  // dst may be any record type: no aliasing through uint64_t
    }
    std::atomic_thread_fence(std::memory_order_acquire);
  }
  // Lock the stripe of w's line, check the fence, drop the line, read, compare, store, write the
  // line back, unlock (arbiter.cpp). Nothing between the fence check and the write-back may block.
  bool locked_rmw(uint64_t* w, uint64_t& expected, uint64_t desired, bool compare) const;

  Backend backend_;
  CacheModel* model_ = nullptr;
  Arbiter* arb_ = nullptr;
};

}  // namespace cxlkv
