// Kernel-released node locks, the process heartbeat thread, and their fork discipline.
#include "liveness.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "checksum.h"
#include "errors.h"

namespace cxlkv::liveness {

using namespace format;

uint64_t mono_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

uint64_t host_id() {
  std::string id;
  if (const char* h = std::getenv("CXLKV_HOST_ID")) {
    id = std::string("host:") + h;
  } else {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, id);
    id = "boot:" + id;
  }
  return xxh3(id.data(), id.size(), 1) | 1;
}

uint32_t domain_tag(uint64_t host_id, uint64_t lock_id) {
  uint64_t v[2] = {host_id, lock_id};
  return uint32_t(xxh3(v, sizeof v, 2) >> 32) | 1;
}

namespace {

// Process-wide state, never destroyed: the heartbeat thread may outlive static destructors.
struct Beat {
  uint64_t handle;
  NodeSlot* slot;
  uint64_t expected;
  uint64_t interval_ns;
  uint64_t due_ns;
  Coherence coh;
  std::atomic<bool>* fenced;
  const std::function<bool()>* intact;  // false once the pool file shrank: stop touching it
  std::atomic<uint64_t>* last_beat;     // mono_ns taken before the last beat published (fencing)
  uint64_t lapse_ns;                    // > 0: fence instead of beating after such a gap
  const std::function<void()>* chores;  // after each beat that published (never throws out)
};
// The heartbeat thread is fork-safe only while it is in its loop: a fork() that copies a lock held
// by a thread still starting or already exiting (ASan's allocator and thread registry are not
// fork-safe) leaves the child hung on it at its first allocation or thread. So start_heartbeat
// returns only once the thread is in its loop, and the thread never exits: with no beat left it
// waits, idle, for the next attachment.
struct State {
  std::mutex mu;                     // guards everything below; held across fork() by the atfork handlers
  std::condition_variable cv;        // the heartbeat thread's wake-up (a beat added or removed)
  std::condition_variable ready_cv;  // the heartbeat thread reached its loop (thread_ready)
  std::vector<int> lock_fds;
  std::vector<Beat> beats;
  uint64_t next_handle = 1;
  bool thread_running = false;  // started in this process (it never exits)
  bool thread_ready = false;    // and in its loop
};

void fork_prepare();
void fork_parent();
void fork_child();

State& state() {
  static State* s = [] {
    auto* st = new State();
    ::pthread_atfork(fork_prepare, fork_parent, fork_child);
    return st;
  }();
  return *s;
}

void fork_prepare() { state().mu.lock(); }
void fork_parent() { state().mu.unlock(); }
// The child owns no node: drop its copies of the lock descriptors (the parent's locks live on
// through the parent's own descriptors) and forget the heartbeats (the thread is not here). The
// condition variables are made afresh, not destroyed: the parent's thread may have been waiting on
// one, and glibc would wait in the child for that waiter, who is not here, to leave it.
void fork_child() {
  State& s = state();
  for (int fd : s.lock_fds) ::close(fd);
  s.lock_fds.clear();
  s.beats.clear();
  s.thread_running = false;
  s.thread_ready = false;
  new (&s.cv) std::condition_variable();
  new (&s.ready_cv) std::condition_variable();
  s.mu.unlock();
}

// Returns false when this beat must stop: fenced, or the pool file shrank under us (a store
// into the lost pages would be a SIGBUS, and nothing of ours there matters any more).
bool beat_once(Beat& b) {
  if (b.intact && !(*b.intact)()) return false;
  if (!beat(b.slot, b.expected, b.coh, b.fenced, b.last_beat, b.lapse_ns)) return false;
  if (b.chores) try {
      (*b.chores)();
    } catch (...) {  // a chore is best effort: the beat itself was published
    }
  return true;
}

void heartbeat_loop() {
  State& s = state();
  std::unique_lock<std::mutex> g(s.mu);
  s.thread_ready = true;
  s.ready_cv.notify_all();
  for (;;) {
    if (s.beats.empty()) {  // idle until the next attachment: never exits (see State)
      s.cv.wait(g);
      continue;
    }
    uint64_t now = mono_ns(), next = now + 1'000'000'000ull;
    for (size_t i = 0; i < s.beats.size();) {
      Beat& b = s.beats[i];
      if (now >= b.due_ns) {
        bool keep = beat_once(b);
        b.due_ns = now + b.interval_ns;
        if (!keep) {
          s.beats.erase(s.beats.begin() + long(i));
          continue;
        }
      }
      next = std::min(next, b.due_ns);
      ++i;
    }
    s.cv.wait_for(g, std::chrono::nanoseconds(next > now ? next - now : 0));
  }
}

}  // namespace

LockFile open_lock_file(const std::string& path, uint64_t want_dev, uint64_t want_ino) {
  LockFile f;
  State& s = state();
  // Under the state mutex: a fork() sees the descriptor either not yet open or registered.
  std::lock_guard<std::mutex> g(s.mu);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW);
  f.writable = fd >= 0;
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW);
  if (fd < 0) return f;  // no lock: this process judges and is judged by leases only
  struct stat st;
  // The path must still name the file we mapped: a lock on a file put in its place would make
  // this node invisible to the others (they test the mapped file's locks).
  if (::fstat(fd, &st) != 0 || uint64_t(st.st_dev) != want_dev || uint64_t(st.st_ino) != want_ino) {
    ::close(fd);
    return LockFile{};
  }
  f.fd = fd;
  uint64_t v[2] = {uint64_t(st.st_dev), uint64_t(st.st_ino)};
  f.lock_id = xxh3(v, sizeof v, 3) | 1;
  // Probe once that OFD locks work on this file (old kernels, odd file systems): else lease only.
  struct flock fl{};
  fl.l_type = F_WRLCK, fl.l_whence = SEEK_SET, fl.l_start = 0, fl.l_len = 1;
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) f.lock_id = 0;
  // A read-only descriptor cannot take write locks: such a process neither holds nor tests locks.
  if (!f.writable) f.lock_id = 0;
  s.lock_fds.push_back(fd);
  return f;
}

void close_lock_file(LockFile& f) {
  if (f.fd < 0) return;
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  for (size_t i = 0; i < s.lock_fds.size(); ++i)
    if (s.lock_fds[i] == f.fd) {
      s.lock_fds.erase(s.lock_fds.begin() + long(i));
      ::close(f.fd);
      break;
    }
  f = LockFile{};
}

bool try_lock(const LockFile& f, uint64_t off) {
  if (f.fd < 0 || !f.lock_id || !f.writable) return false;
  struct flock fl{};
  fl.l_type = F_WRLCK, fl.l_whence = SEEK_SET, fl.l_start = off_t(off), fl.l_len = 1;
  if (::fcntl(f.fd, F_OFD_SETLK, &fl) == 0) return true;
  if (errno == EAGAIN || errno == EACCES) return false;
  throw OsError(errno, std::string("cannot take a node lock on the pool file: ") + std::strerror(errno));
}

void unlock(const LockFile& f, uint64_t off) {
  if (f.fd < 0 || !f.lock_id) return;
  struct flock fl{};
  fl.l_type = F_UNLCK, fl.l_whence = SEEK_SET, fl.l_start = off_t(off), fl.l_len = 1;
  (void)::fcntl(f.fd, F_OFD_SETLK, &fl);
}

bool lock_held_by_other(const LockFile& f, uint64_t off) {
  if (f.fd < 0 || !f.lock_id) return false;
  struct flock fl{};
  fl.l_type = F_WRLCK, fl.l_whence = SEEK_SET, fl.l_start = off_t(off), fl.l_len = 1;
  if (::fcntl(f.fd, F_OFD_GETLK, &fl) != 0) return true;  // cannot tell: never call it dead
  return fl.l_type != F_UNLCK;
}

bool beat(NodeSlot* slot, uint64_t expected, const Coherence& coh, std::atomic<bool>* fenced,
          std::atomic<uint64_t>* last_beat, uint64_t lapse_ns) {
  if (fenced->load(std::memory_order_acquire)) return false;
  if (last_beat && lapse_ns && mono_ns() - last_beat->load(std::memory_order_acquire) > lapse_ns) {
    fenced->store(true, std::memory_order_release);
    return false;
  }
  uint64_t w = coh.read(&slot->state);
  if (w != expected) {  // reclaimed while alive (paused past the lease, or a forced reap)
    fenced->store(true, std::memory_order_release);
    return false;
  }
  const uint64_t before = mono_ns();  // conservative: the beat becomes visible after this
  coh.invalidate(&slot->beat, sizeof(uint64_t) * 2);
  slot->beat_unix_ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count());
  coh.publish(&slot->beat, slot->beat + 1);
  coh.flush(&slot->beat_unix_ns, sizeof(uint64_t));
  if (last_beat) last_beat->store(before, std::memory_order_release);
  return true;
}

uint64_t start_heartbeat(NodeSlot* slot, uint64_t expected, uint64_t interval_ns, Coherence coh,
                         std::atomic<bool>* fenced, const std::function<bool()>* intact,
                         std::atomic<uint64_t>* last_beat, uint64_t lapse_ns,
                         const std::function<void()>* chores) {
  State& s = state();
  std::unique_lock<std::mutex> g(s.mu);
  uint64_t h = s.next_handle++;
  s.beats.push_back(Beat{h, slot, expected, interval_ns, mono_ns() + interval_ns, coh, fenced, intact,
                         last_beat, lapse_ns, chores});
  if (!s.thread_running) {
    s.thread_running = true;
    std::thread(heartbeat_loop).detach();
    // Fork-safe from here on (see State). Bounded: a thread that starts later than this only
    // reopens that window, it beats all the same.
    s.ready_cv.wait_for(g, std::chrono::seconds(10), [&] { return s.thread_ready; });
  } else {
    s.cv.notify_all();
  }
  return h;
}

void stop_heartbeat(uint64_t handle) {
  if (!handle) return;
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  for (size_t i = 0; i < s.beats.size(); ++i)
    if (s.beats[i].handle == handle) {
      s.beats.erase(s.beats.begin() + long(i));
      break;
    }
  s.cv.notify_all();
}

}  // namespace cxlkv::liveness
