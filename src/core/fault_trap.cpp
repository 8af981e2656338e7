// The test-only fault trap of real processes (fault_trap.h).
#include "fault_trap.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "coherence.h"
#include "errors.h"

namespace cxlkv::fault_trap {

namespace {
// The protocol's named points (Coherence::fault callers and the lock wrapper in pool.cpp).
constexpr const char* kPoints[] = {"insert.claimed", "insert.copied", "evict.claimed",
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
      armed = g_point.c_str();
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
    } catch (const Error& e) {
      g_error = e.what();
    }
  });
  if (!g_error.empty()) throw ArgumentError(g_error);
}

void hit(const char* name) {
  if (std::strcmp(name, armed) != 0) return;
  if (g_hits.fetch_add(1, std::memory_order_relaxed) + 1 != g_nth) return;
  std::string line = "cxlkv-fault " + g_point + " " + std::to_string(::getpid()) + "\n";
  [[maybe_unused]] ssize_t n = ::write(2, line.data(), line.size());
  ::kill(::getpid(), g_stop ? SIGSTOP : SIGKILL);
}

namespace {
class LockTrap final : public Arbiter {
 public:
  explicit LockTrap(Arbiter& inner) : inner_(inner) {}
  void lock(const void* line) override {
    inner_.lock(line);
    hit("lock.held");
  }
  void unlock(const void* line) override { inner_.unlock(line); }
  void check_fence() override { inner_.check_fence(); }

 private:
  Arbiter& inner_;
};
}  // namespace

std::unique_ptr<Arbiter> trap_lock(Arbiter& inner) { return std::make_unique<LockTrap>(inner); }

}  // namespace cxlkv::fault_trap
