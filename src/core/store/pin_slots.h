// PinSlots: this process's allocator over its own node's pin array (format.h: NodeAreaFixed and
// the pins after it). Process-local state only: a free list of pin indexes and the high-water
// mark, which it publishes (pin_hw) so that other nodes know how far to scan for pins. The
// high-water mark only grows while attached: a pin index is reused from the free list first.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

namespace cxlkv {

class PinSlots {
 public:
  // A free pin index, else the next one above the high-water mark if that is below `limit`
  // (the pool's pin_slots); a new mark goes to publish_hw(mark) under the lock, so concurrent
  // allocations publish it in increasing order. False: every pin slot is taken.
  template <class PublishHw>
  bool alloc(uint32_t* idx, uint64_t limit, PublishHw&& publish_hw) {
    std::lock_guard<std::mutex> g(mu_);
    if (free_.empty()) {
      if (hw_ >= limit) return false;
      *idx = uint32_t(hw_++);
      publish_hw(hw_);
      return true;
    }
    *idx = free_.back();
    free_.pop_back();
    return true;
  }
  void free(uint32_t idx) {
    std::lock_guard<std::mutex> g(mu_);
    free_.push_back(idx);
  }
  // How far this process's pins reach (detach clears them up to here).
  uint64_t high_water() const { return hw_; }

 private:
  std::mutex mu_;
  std::vector<uint32_t> free_;
  uint64_t hw_ = 0;
};

}  // namespace cxlkv
