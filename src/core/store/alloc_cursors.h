// AllocCursors: where this process's allocator looks first, per namespace (allocator.cpp).
// Process-local hints only: a cursor that names a chunk taken by another namespace meanwhile is
// re-checked against the chunk map before use, so a stale cursor costs a scan, never a block.
#pragma once
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace cxlkv {

class AllocCursors {
 public:
  struct Cursor {
    uint64_t home = ~0ull;        // chunk this node allocates from first
    uint32_t cursor = 0;          // where the last scan of the home chunk stopped
    uint64_t steal_after_us = 0;  // a scan of other chunks found nothing: skip scans until then
  };
  // key: the namespace id, or a finer key when allocators of one namespace draw from
  // different chunks.
  Cursor get(uint32_t key) {
    std::lock_guard<std::mutex> g(mu_);
    return by_key_[key];
  }
  void set(uint32_t key, const Cursor& c) {
    std::lock_guard<std::mutex> g(mu_);
    by_key_[key] = c;
  }

 private:
  std::mutex mu_;
  std::unordered_map<uint32_t, Cursor> by_key_;
};

}  // namespace cxlkv
