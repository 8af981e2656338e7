// Cross-host mutual exclusion without atomic read-modify-write, and the fence of one attachment
// (multihost backend). See docs/ARCHITECTURE.md "Multi-host CXL 2.0" and LockLine in format.h.
//
// Two tiers, as in TraCT: a process-local mutex per stripe (threads of this attachment queue
// there, so only one of them competes across hosts), then Lamport's bakery among host slots on
// plain loads and stores of per-host lines (format::LockLine): a line is written back whole by
// its one writer and read only after the reader dropped its copy, so every line behaves as an
// atomic single-writer register, which is all the bakery needs. No CAS crosses hosts.
//
// Fence (lease self-check): a node stores into shared lines only while its last published beat is
// younger than half a lease. A peer declares it dead (and skips its ticket, or reclaims its slot)
// only after seeing its beat stand still for a whole lease on the peer's own clock, so every
// store the node made passed its check before any peer could act on its death. Assumption (not
// enforced, written down): no pause longer than half a lease between a check and the write-back
// that follows it (a few instructions), and clocks that run at the same rate.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "coherence.h"
#include "format.h"

namespace cxlkv {

class Bakery final : public Arbiter {
 public:
  struct Config {
    char* base = nullptr;  // pool base as this attachment maps it
    uint32_t hosts = 0;    // lock_hosts of the header
    uint32_t slot = 0;     // this attachment's host slot
    uint32_t max_nodes = 0;
    format::NodeSlot* nodes = nullptr;  // node table (to read a ticket holder's beat)
    uint64_t lease_ns = 0;
    Coherence coh;  // unarbitrated: flush/invalidate of lock lines
    std::atomic<bool>* fenced = nullptr;
    std::atomic<uint64_t>* last_beat = nullptr;
    std::function<void()> tick;  // called while waiting (emulated hosts beat from their thread)
  };
  explicit Bakery(Config c) : c_(std::move(c)) {}
  void set_node(uint32_t node, uint64_t node_word) { node_ = node, node_word_ = node_word; }
  void lock(const void* addr) override;
  void unlock(const void* addr) override;
  void check_fence() override;
  uint32_t stripe_of(const void* addr) const;
  // Tickets of other hosts skipped because they stood still for a lease with a silent holder.
  uint64_t skipped() const { return skipped_.load(std::memory_order_relaxed); }

 private:
  format::LockLine* line(uint32_t stripe, uint32_t host) const {
    return reinterpret_cast<format::LockLine*>(c_.base + format::kLockAreaOff) +
           (uint64_t(stripe) * c_.hosts + host);
  }
  void write_back(format::LockLine* l) const;
  bool holder_silent(const format::LockLine& seen, uint64_t beat_then) const;
  uint64_t holder_beat(uint64_t node) const;

  Config c_;
  uint32_t node_ = 0;
  uint64_t node_word_ = 0;
  std::array<std::mutex, format::kLockStripes> local_;  // tier 1
  std::array<uint32_t, format::kLockStripes> depth_{};  // re-entry guard (a bug, not a feature)
  std::atomic<uint64_t> skipped_{0};
};

}  // namespace cxlkv
