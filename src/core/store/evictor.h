// Evictor: which index entries to evict, chosen by their access hints (format.h: the oldest
// millisecond first, within one the deepest block of its chain first). Owns the per-namespace
// victim queues and the hand that samples the index for them. Choosing is all it does: the
// eviction itself (claim EVICTING, the pin check, handing the block over) is the index protocol's
// (Index::evict_victim, index_evict.cpp), passed in as `try_evict`.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "region.h"

namespace cxlkv {

class Evictor {
 public:
  // A candidate as sampled: its access hint and state word then (0 access: CONDEMNED, goes first).
  struct Victim {
    uint64_t access, slot, word;
  };

  explicit Evictor(const Region& region) : region_(region) {}

  // Window eviction: the candidates of the full probe window at `home` (any namespace), READY
  // and CONDEMNED ones, oldest first.
  std::vector<Victim> window(uint64_t home) const;

  // Which sampled entries of the namespace a caller may take over (e.g. only blocks in some part
  // of the pool); empty: all of them.
  using Accept = std::function<bool(const format::IndexEntry&)>;

  // Namespace eviction from a sampled, sorted candidate queue: calls try_evict on each candidate
  // still unchanged since it was sampled (state word and access hint), oldest first, until one
  // returns true; refills the queue once when it runs dry. Queues are kept per `queue_key` (the
  // namespace id, or a finer key when callers of one namespace accept different entries). One
  // eviction at a time per process (the queues are shared by the threads of this attachment).
  template <class TryEvict>
  bool from_queue(uint32_t queue_key, uint32_t ns_id, const Accept& accept, TryEvict&& try_evict) {
    std::lock_guard<std::mutex> g(mu_);
    Queue& q = queues_[queue_key];
    for (int refill = 0; refill < 2; ++refill) {
      refill_if_stale(ns_id, accept, q, refill != 0);
      while (!q.v.empty()) {
        Victim c = q.v.back();
        q.v.pop_back();
        if (!unchanged(c)) continue;
        if (try_evict(c)) return true;
      }
    }
    return false;
  }

 private:
  struct Queue {
    std::vector<Victim> v;  // sorted, oldest last
    uint64_t filled_us = 0;
  };
  // Refills q when it is empty, older than its maximum age, or `force`: up to a sample of
  // accepted candidates of namespace ns_id read from the moving hand. Caller holds mu_.
  void refill_if_stale(uint32_t ns_id, const Accept& accept, Queue& q, bool force);
  // A block touched or changed since it was sampled is not evicted on stale information.
  bool unchanged(const Victim& c) const;

  const Region& region_;
  std::mutex mu_;
  std::unordered_map<uint32_t, Queue> queues_;  // by queue key; process-local
  std::atomic<uint64_t> hand_{0};               // where the next sample starts
};

}  // namespace cxlkv
