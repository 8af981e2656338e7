// Shared helpers of the GoogleTest suite: a fixture that owns a unique pool path under /dev/shm,
// deterministic keys and payloads derived from an id, and a raw MAP_SHARED view of a pool file so
// tests can read (and corrupt) the on-pool format directly, independently of the Pool object.
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dtype.h"
#include "format.h"
#include "pool.h"

namespace cxlkv::test {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

inline std::string unique_pool_path() {
  static std::atomic<int> counter{0};
  return "/dev/shm/cxlkv-gtest-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

// Fixture: a fresh pool path per test, removed afterwards (pool objects must be closed by then).
class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = unique_pool_path(); }
  void TearDown() override { ::unlink(path_.c_str()); }

  static CreateOptions opts(uint64_t size, uint64_t chunk_bytes = 0, uint64_t index_slots = 0) {
    CreateOptions o;
    o.size = size;
    o.chunk_bytes = chunk_bytes;
    o.index_slots = index_slots;
    return o;
  }
  std::unique_ptr<Pool> create(const CreateOptions& o) { return Pool::create(path_, o, false); }

  std::string path_;
};

inline Layout layout(const std::string& name, uint64_t block_bytes) {
  Layout l;
  l.name = name;
  l.model_id = "gtest-model";
  l.dtype = uint32_t(DType::bytes);
  l.kind = format::kLayoutOpaque;
  l.block_bytes = block_bytes;
  return l;
}

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Key of id: the id in the first 8 bytes (so a key read back from the pool names its id), the
// rest derived from it, so a torn or foreign key is recognisable with key_matches_id().
inline Key key_of(uint64_t id, uint64_t salt = 0) {
  Key k{};
  std::memcpy(k.data(), &id, 8);
  uint64_t s = cxlkv::xxh3(&id, 8, 0x6B6579 + salt);
  for (int i = 8; i < 32; i += 8) {
    uint64_t v = splitmix(s);
    std::memcpy(k.data() + i, &v, 8);
  }
  return k;
}
inline uint64_t id_of(const uint8_t* key) {
  uint64_t id;
  std::memcpy(&id, key, 8);
  return id;
}
inline bool key_matches_id(const uint8_t* key, uint64_t salt = 0) {
  Key k = key_of(id_of(key), salt);
  return std::memcmp(k.data(), key, 32) == 0;
}

// Payload of id: a pseudo-random byte pattern seeded by xxh3(id, seed).
inline void fill_payload(uint64_t id, char* buf, uint64_t len, uint64_t seed = 0) {
  uint64_t s = cxlkv::xxh3(&id, 8, 0x7061796C + seed);
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t v = splitmix(s);
    std::memcpy(buf + i, &v, 8);
  }
  if (i < len) {
    uint64_t v = splitmix(s);
    std::memcpy(buf + i, &v, len - i);
  }
}
inline std::vector<char> payload(uint64_t id, uint64_t len, uint64_t seed = 0) {
  std::vector<char> v(len);
  fill_payload(id, v.data(), len, seed);
  return v;
}

// A raw shared view of a pool file, mapped independently of any Pool object.
class RawMap {
 public:
  explicit RawMap(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0) throw std::runtime_error("RawMap: cannot open " + path);
    struct stat st;
    ::fstat(fd_, &st);
    size_ = uint64_t(st.st_size);
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) throw std::runtime_error("RawMap: cannot map " + path);
    base_ = static_cast<char*>(p);
  }
  ~RawMap() {
    ::munmap(base_, size_);
    ::close(fd_);
  }
  RawMap(const RawMap&) = delete;
  RawMap& operator=(const RawMap&) = delete;

  char* base() const { return base_; }
  const format::PoolHeader& hdr() const { return *reinterpret_cast<const format::PoolHeader*>(base_); }
  uint64_t desc_bytes() const { return format::chunk_desc_bytes(hdr().chunk_bytes); }
  uint64_t chunk_stride() const { return desc_bytes() + hdr().chunk_bytes; }
  format::IndexEntry* entry(uint64_t slot) const {
    return reinterpret_cast<format::IndexEntry*>(base_ + hdr().index_off) + slot;
  }
  uint64_t chunk_word(uint64_t c) const {
    return reinterpret_cast<const uint64_t*>(base_ + hdr().chunk_map_off)[c];
  }
  uint64_t block_desc(uint64_t chunk, uint32_t block) const {
    return reinterpret_cast<const uint64_t*>(base_ + hdr().arena_off + chunk * chunk_stride())[block];
  }
  char* payload(uint64_t chunk, uint32_t block, uint64_t block_stride) const {
    return base_ + hdr().arena_off + chunk * chunk_stride() + desc_bytes() + block * block_stride;
  }
  std::vector<uint64_t> slots_in_state(uint8_t st) const {
    std::vector<uint64_t> out;
    for (uint64_t s = 0; s < hdr().index_slots; ++s)
      if (format::entry_state(__atomic_load_n(&entry(s)->state, __ATOMIC_ACQUIRE)) == st) out.push_back(s);
    return out;
  }
  std::vector<uint64_t> ready_slots() const { return slots_in_state(format::kReady); }

 private:
  int fd_ = -1;
  char* base_ = nullptr;
  uint64_t size_ = 0;
};

// Forks a child that runs body() and _exit()s with its result. Call from a process whose only other
// threads are cxlkv's own (fork-safe once open/attach returned); the child must use nothing but
// the cxlkv API (no gtest assertions). Reap it with wait_child (bounded).
template <class F>
pid_t spawn(F&& body) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  return pid;
}

// What a child process is doing, thread by thread, from /proc (state, kernel wait channel, the
// system call it is in): the message of a child that did not finish in time.
inline std::string describe_process(pid_t pid) {
  auto slurp = [](const std::string& path) {
    std::string out;
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      char buf[512];
      size_t n = std::fread(buf, 1, sizeof buf - 1, f);
      std::fclose(f);
      out.assign(buf, n);
      while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
    }
    return out;
  };
  std::string task = "/proc/" + std::to_string(pid) + "/task";
  std::string s;
  if (DIR* d = ::opendir(task.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::string t = task + "/" + e->d_name;
      std::string stat = slurp(t + "/stat");
      size_t paren = stat.rfind(')');
      std::string state =
          paren != std::string::npos && paren + 2 < stat.size() ? stat.substr(paren + 2, 1) : "?";
      s += std::string("\n  thread ") + e->d_name + " (" + slurp(t + "/comm") + "): state " + state +
           ", wchan " + slurp(t + "/wchan") + ", syscall " + slurp(t + "/syscall");
    }
    ::closedir(d);
  }
  return s.empty() ? " (no /proc entry)" : s;
}

// Waits at most `limit` for child `pid`. Returns "" with *status set once it ended; else kills it
// and returns what it was doing (describe_process), for the test to fail with.
inline std::string wait_child(pid_t pid, int* status, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    pid_t got = ::waitpid(pid, status, WNOHANG);
    if (got == pid) return "";
    if (got < 0) return "waitpid(" + std::to_string(pid) + ") failed: " + std::strerror(errno);
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::string what = "child " + std::to_string(pid) + " still running after " +
                     std::to_string(limit.count()) + " ms:" + describe_process(pid);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, status, 0);  // SIGKILL cannot be caught or blocked: this returns
  return what;
}

inline std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& e : v) s += "\n  " + e;
  return s;
}

}  // namespace cxlkv::test
