// The test-only fault trap of real processes (fault_trap.h).
#include "fault_trap.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "errors.h"

namespace cxlkv::fault_trap {

namespace {
// The protocol's named points (the Coherence::fault callers).
constexpr const char* kPoints[] = {"insert.claimed", "insert.copied", "evict.claimed", "release.claimed",
                                   "alloc.claimed",  "alloc.carving", "lock.held"};
std::string g_point;
bool g_stop = false;
uint64_t g_nth = 1;
std::atomic<uint64_t> g_hits{0};
std::once_flag g_once;
std::string g_error;

void parse(const char* v) {
  std::string s(v);
  if (auto at = s.find('@'); at != std::string::npos) {
    char* end = nullptr;
    unsigned long long n = std::strtoull(s.c_str() + at + 1, &end, 10);
    if (at + 1 == s.size() || *end || n == 0) throw ArgumentError("CXLKV_TEST_FAULT: bad count in " + s);
    g_nth = n;
    s.resize(at);
  }
  if (auto colon = s.find(':'); colon != std::string::npos) {
    std::string action = s.substr(colon + 1);
    if (action != "kill" && action != "stop")
      throw ArgumentError("CXLKV_TEST_FAULT: action must be kill or stop, not " + action);
    g_stop = action == "stop";
    s.resize(colon);
  }
  for (const char* p : kPoints)
    if (s == p) {
      g_point = s;
      return;
    }
  throw ArgumentError("CXLKV_TEST_FAULT: unknown fault point " + s);
}
}  // namespace

void arm_from_env() {
  std::call_once(g_once, [] {
    const char* v = std::getenv("CXLKV_TEST_FAULT");
    if (!v || !*v) return;
    try {
      parse(v);
      hook.store(&hit, std::memory_order_release);
    } catch (const Error& e) {
      g_error = e.what();
    }
  });
  if (!g_error.empty()) throw ArgumentError(g_error);
}

void hit(const char* name) {
  if (g_point != name) return;
  if (g_hits.fetch_add(1, std::memory_order_relaxed) + 1 != g_nth) return;
  std::string line = "cxlkv-fault " + g_point + " " + std::to_string(::getpid()) + "\n";
  [[maybe_unused]] ssize_t n = ::write(2, line.data(), line.size());
  ::kill(::getpid(), g_stop ? SIGSTOP : SIGKILL);
}

}  // namespace cxlkv::fault_trap
