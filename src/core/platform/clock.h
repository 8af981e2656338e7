// The two clocks of the core: wall time in ns (what the pool records for people: attach and beat
// times, events) and monotonic time in us (eviction ages, rate limits: never steps back).
#pragma once
#include <chrono>
#include <cstdint>

namespace cxlkv {

inline uint64_t now_unix_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count());
}
inline uint64_t now_mono_us() {
  return uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

}  // namespace cxlkv
