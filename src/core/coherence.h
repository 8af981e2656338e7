// The coherence layer: the ONLY way the rest of the core touches shared pool metadata.
//
// Every primitive is named by what it guarantees to other participants, not by how:
//   read(w)          see the latest published value of a shared word (acquire)
//   publish(w, v)    make v, and everything written before it, visible to others (release)
//   claim(w, e, d)   take exclusive ownership of a word: succeeds for exactly one contender
//   flush(p, n)      make plain writes in [p, p+n) visible to other hosts
//   invalidate(p, n) drop stale copies of [p, p+n) before reading what other hosts wrote
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
//
// Protocol rule: no code outside this header may use an atomic read-modify-write on pool memory.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "copy_kernels.h"

namespace cxlkv {

enum class Backend : uint32_t { coherent = 1, flush = 2 };

class Coherence {
 public:
  explicit Coherence(Backend b = Backend::coherent) : backend_(b) {}
  Backend backend() const { return backend_; }
  bool needs_flush() const { return backend_ != Backend::coherent; }

  uint64_t read(const uint64_t* w) const {
    if (needs_flush()) kernels::evict_lines(w, sizeof *w);
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(w)).load(std::memory_order_acquire);
  }
  // Relaxed read for hints (access times): a stale value is harmless by design.
  uint64_t read_hint(const uint64_t* w) const {
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(w)).load(std::memory_order_relaxed);
  }
  void publish(uint64_t* w, uint64_t v) const {
    std::atomic_ref<uint64_t>(*w).store(v, std::memory_order_release);
    if (needs_flush()) kernels::writeback_lines(w, sizeof *w);
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
  void write_hint(uint64_t* w, uint64_t v) const {
    std::atomic_ref<uint64_t>(*w).store(v, std::memory_order_relaxed);
  }
  // On success the caller owns the word's transition; on failure `expected` holds what it saw.
  bool claim(uint64_t* w, uint64_t& expected, uint64_t desired) const {
    if (needs_flush()) kernels::evict_lines(w, sizeof *w);
    bool ok = std::atomic_ref<uint64_t>(*w).compare_exchange_strong(
        expected, desired, std::memory_order_seq_cst, std::memory_order_acquire);
    if (ok && needs_flush()) kernels::writeback_lines(w, sizeof *w);
    return ok;
  }
  // Increment of a counter in this node's own area: only threads of the owning process write it,
  // so the RMW never crosses hosts; others read it with read_hint.
  void bump_owned(uint64_t* w, uint64_t v) const {
    std::atomic_ref<uint64_t>(*w).fetch_add(v, std::memory_order_relaxed);
  }
  void flush(const void* p, size_t n) const {
    if (needs_flush()) kernels::writeback_lines(p, n);
  }
  void invalidate(const void* p, size_t n) const {
    if (needs_flush()) kernels::evict_lines(p, n);
  }
  void fence() const { kernels::full_fence(); }
  void stream_copy(void* dst, const void* src, size_t n) const { kernels::stream_copy(dst, src, n); }
  void stream_fence() const { kernels::store_fence(); }

 private:
  Backend backend_;
};

}  // namespace cxlkv
