#include "mapping.h"

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <vector>

#include "errors.h"
#include "huge_pages.h"

namespace cxlkv {

namespace {
constexpr uint64_t kDevdaxAlign = 2ull << 20;

[[noreturn]] void throw_os(int err, const std::string& what, const std::string& path) {
  throw OsError(err, what + " " + path + ": " + std::strerror(err));
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Maps `len` bytes of fd at an address aligned to `align`. shared = false: a private
// copy-on-write mapping without swap reservation (inspection; hugetlbfs would reserve it all).
char* map_aligned(int fd, uint64_t len, uint64_t align, uint64_t* map_len, const std::string& path,
                  bool populate = false, bool shared = true) {
  const int share = shared ? MAP_SHARED : MAP_PRIVATE | MAP_NORESERVE;
  if (align <= 4096) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, share | (populate ? MAP_POPULATE : 0), fd, 0);
    if (p == MAP_FAILED) throw_os(errno, "cannot map", path);
    *map_len = len;
    return static_cast<char*>(p);
  }
  void* r = ::mmap(nullptr, len + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) throw_os(errno, "cannot reserve address space for", path);
  uintptr_t a = (reinterpret_cast<uintptr_t>(r) + align - 1) & ~(align - 1);
  void* p = ::mmap(reinterpret_cast<void*>(a), len, PROT_READ | PROT_WRITE,
                   share | MAP_FIXED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::munmap(r, len + align);
    throw_os(e, "cannot map", path);
  }
  // Release the unused reservation on both sides of the aligned mapping.
  uintptr_t rb = reinterpret_cast<uintptr_t>(r);
  if (a > rb) ::munmap(r, a - rb);
  uintptr_t tail = a + len, rend = rb + len + align;
  if (rend > tail) ::munmap(reinterpret_cast<void*>(tail), rend - tail);
  *map_len = len;
  return static_cast<char*>(p);
}

// Where a file pool is mapped: at a huge-page boundary, so that the kernel can map whole huge
// pages of the file (a 2 MiB page is only PMD-mapped at an address that is a multiple of it).
uint64_t file_align(const DirPages& dp) { return std::max(thp_bytes(), dp.huge_bytes); }

[[noreturn]] void throw_map_error(const OsError& e, const DirPages& dp, uint64_t size,
                                  const std::string& path) {
  if (dp.hugetlbfs && e.err == ENOMEM)
    throw OsError(ENOMEM, "cannot map pool " + path + ": hugetlbfs has fewer than the " +
                              std::to_string(size / dp.huge_bytes) + " free huge pages of " +
                              std::to_string(dp.huge_bytes >> 10) +
                              " KiB it needs (HugePages_Free in /proc/meminfo; vm.nr_hugepages)");
  throw e;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
}  // namespace

PageInfo Mapping::page_info() const { return cxlkv::page_info(base_, map_len_); }

// ---------------------------------------------------------------------------------------------
// SIGBUS guard (F14). Shrinking a mapped file turns every access past its new end into SIGBUS,
// which would kill every attached process. A process-wide handler looks the fault address up in a
// fixed table of pool mappings (async-signal-safe: atomics only), maps anonymous zero pages over
// the rest of that mapping with MAP_FIXED and marks it truncated; the faulting access is restarted
// and reads zeros (EMPTY entries, FREE words, checksum mismatches: misses, never wrong bytes). The
// Pool turns the flag into PoolTruncatedError on its next operation. Faults outside pool mappings
// go to the handler that was installed before ours (or the default action: the process dies).
// Residual risk: an operation that was running when the file shrank completes on zero pages (a
// put may report success into memory that no other process sees); only the next call reports it.
namespace {
constexpr int kGuardSlots = 1024;
struct GuardSlot {
  std::atomic<uintptr_t> base{0};
  std::atomic<uintptr_t> len{0};
  std::atomic<int> truncated{0};
};
GuardSlot g_guard[kGuardSlots];
std::mutex g_guard_mu;  // registration only; never taken in the handler
struct sigaction g_prev_bus{};
uintptr_t g_page = 4096;

void on_sigbus(int sig, siginfo_t* si, void* uc) {
  uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
  if (si->si_code > 0) {  // a real fault (not kill/raise)
    for (auto& s : g_guard) {
      uintptr_t b = s.base.load(std::memory_order_acquire);
      if (!b) continue;
      uintptr_t l = s.len.load(std::memory_order_acquire);
      if (a < b || a >= b + l) continue;
      uintptr_t page = a & ~(g_page - 1);
      void* r = ::mmap(reinterpret_cast<void*>(page), b + l - page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (r == MAP_FAILED) break;
      s.truncated.store(1, std::memory_order_release);
      return;  // the faulting instruction is restarted on the zero page
    }
  }
  // Not ours. A fault: hand the signal back to the previous handler and let the access fault
  // again, now delivered to it directly (no nested call, so a handler that re-raises cannot loop
  // through us). A raised SIGBUS (si_code <= 0: kill/raise, e.g. a handler re-raising): default.
  if (si->si_code > 0) {
    ::sigaction(SIGBUS, &g_prev_bus, nullptr);
    return;
  }
  (void)uc;
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  ::raise(sig);
}

// Installs on_sigbus unless it is the current handler: again at every pool mapping, so that a
// handler installed later (e.g. Python's faulthandler) does not see pool faults first.
void install_sigbus_handler() {
  struct sigaction cur{};
  ::sigaction(SIGBUS, nullptr, &cur);
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  g_page = uintptr_t(::sysconf(_SC_PAGESIZE));
  g_prev_bus = cur;
  struct sigaction sa{};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}
}  // namespace

void Mapping::guard() {
  std::lock_guard<std::mutex> g(g_guard_mu);
  install_sigbus_handler();
  for (int i = 0; i < kGuardSlots; ++i) {
    if (g_guard[i].base.load(std::memory_order_relaxed)) continue;
    g_guard[i].truncated.store(0, std::memory_order_relaxed);
    g_guard[i].len.store(map_len_, std::memory_order_relaxed);
    g_guard[i].base.store(reinterpret_cast<uintptr_t>(base_), std::memory_order_release);
    guard_ = i;
    return;
  }
  // More than kGuardSlots pools mapped at once: this one goes unguarded (SIGBUS kills).
}

bool Mapping::truncated() const {
  return guard_ >= 0 && g_guard[guard_].truncated.load(std::memory_order_acquire) != 0;
}

void Mapping::release() {
  if (guard_ >= 0) {
    std::lock_guard<std::mutex> g(g_guard_mu);
    g_guard[guard_].base.store(0, std::memory_order_release);
    guard_ = -1;
  }
  if (base_) ::munmap(base_, map_len_);  // one call unmaps every stripe of a striped range
  base_ = nullptr;
  close_devices();
}

void Mapping::close_devices() {
  for (auto& d : devices_)
    if (d.fd >= 0) ::close(d.fd);
  devices_.clear();
  geo_ = StripeGeometry{};
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    release();
    base_ = o.base_, size_ = o.size_, map_len_ = o.map_len_, devdax_ = o.devdax_;
    dev_ = o.dev_, ino_ = o.ino_, guard_ = o.guard_;
    geo_ = o.geo_, devices_ = std::move(o.devices_);
    o.base_ = nullptr, o.size_ = o.map_len_ = 0, o.guard_ = -1;
    o.devices_.clear(), o.geo_ = StripeGeometry{};
  }
  return *this;
}

Mapping::~Mapping() { release(); }

bool Mapping::is_devdax_path(const std::string& path) { return path.rfind("/dev/dax", 0) == 0; }

uint64_t devdax_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    int e = errno;
    if (e == ENOENT) throw OsError(e, "devdax device " + path + " does not exist");
    throw_os(e, "cannot stat devdax device", path);
  }
  if (!S_ISCHR(st.st_mode)) throw OsError(ENODEV, path + " is not a devdax character device");
  std::string sys = "/sys/dev/char/" + std::to_string(major(st.st_rdev)) + ":" +
                    std::to_string(minor(st.st_rdev)) + "/size";
  std::ifstream f(sys);
  uint64_t size = 0;
  if (!(f >> size) || size == 0) throw OsError(ENODEV, "cannot read the size of " + path + " from " + sys);
  return size;
}

namespace {
bool in_my_groups(gid_t g) {
  if (g == ::getegid()) return true;
  int n = ::getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> gs(static_cast<size_t>(n));
  n = ::getgroups(n, gs.data());
  for (int i = 0; i < n; ++i)
    if (gs[size_t(i)] == g) return true;
  return false;
}

}  // namespace

// F11: a pool that another user owns or may write can be read and corrupted by that user.
void mapping_detail::check_owner(const struct stat& st, const std::string& path, bool allow_group) {
  uid_t me = ::geteuid();
  bool group_ok = allow_group && in_my_groups(st.st_gid);
  const std::string hint = "; pass allow_foreign_owner=True (CLI: --allow-foreign-owner) if this is intended";
  if (st.st_uid != me && st.st_uid != 0 && !group_ok)
    throw OsError(EPERM, "pool " + path + " is owned by uid " + std::to_string(st.st_uid) +
                             ", not by this user (uid " + std::to_string(me) +
                             "): that user can read and corrupt its KV; refusing it" + hint);
  if (st.st_mode & S_IWOTH) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    throw OsError(EPERM,
                  "pool " + path + " is writable by every user (mode " + mode + "); refusing it" + hint);
  }
  if ((st.st_mode & S_IWGRP) && st.st_uid != me && !group_ok)
    throw OsError(EPERM, "pool " + path + " is writable by group " + std::to_string(st.st_gid) +
                             ", which is not one of ours; refusing it" + hint);
}

Mapping Mapping::open_existing(const std::string& path, uint64_t min_bytes, bool populate, bool read_only,
                               bool allow_foreign_owner, bool allow_group) {
  Mapping m;
  Fd fd;
  fd.fd = ::open(path.c_str(), (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NOFOLLOW);
  if (fd.fd < 0) {
    int e = errno;
    if (e == ENOENT && is_devdax_path(path)) throw OsError(e, "devdax device " + path + " does not exist");
    if (e == ENOENT) throw OsError(e, "pool " + path + " does not exist");
    if (e == EISDIR) throw OsError(e, path + " is a directory, not a pool");
    if (e == ELOOP)
      throw OsError(e, "pool " + path + " is a symbolic link; refusing to follow it (open its target)");
    throw_os(e, "cannot open pool", path);
  }
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) throw_os(errno, "cannot stat", path);
  if (S_ISDIR(st.st_mode)) throw OsError(EISDIR, path + " is a directory, not a pool");
  if (!allow_foreign_owner) mapping_detail::check_owner(st, path, allow_group);
  m.dev_ = uint64_t(st.st_dev);
  m.ino_ = uint64_t(st.st_ino);
  uint64_t size;
  if (S_ISCHR(st.st_mode)) {
    size = devdax_size(path);
    m.devdax_ = true;
  } else if (S_ISREG(st.st_mode)) {
    size = uint64_t(st.st_size);
  } else {
    throw FormatError(path + " is neither a regular file nor a devdax device");
  }
  if (size < min_bytes)
    throw TruncatedError("pool " + path + " is truncated: " + std::to_string(size) +
                         " bytes, smaller than a pool header");
  // A sparse pool file (e.g. `cp --sparse`) faults its holes in at first touch, and a full tmpfs
  // answers that with SIGBUS. Allocate the holes now, so a full filesystem is a clear error here.
  if (!m.devdax_ && !read_only && uint64_t(st.st_blocks) * 512 < size) {
    int e = ::posix_fallocate(fd.fd, 0, off_t(size));
    if (e != 0)
      throw OsError(e, "pool " + path + " is a sparse file (" + std::to_string(uint64_t(st.st_blocks) * 512) +
                           " of " + std::to_string(size) +
                           " bytes allocated) and its holes cannot be allocated: " + std::strerror(e));
  }
  const DirPages dp = m.devdax_ ? DirPages{} : fd_huge_pages(fd.fd);
  if (dp.hugetlbfs && size % dp.huge_bytes)  // only a hugetlbfs can hold it, and only whole pages
    throw TruncatedError("pool " + path + " on hugetlbfs is " + std::to_string(size) +
                         " bytes, not a whole number of its " + std::to_string(dp.huge_bytes) +
                         "-byte pages");
  const uint64_t align = m.devdax_ ? kDevdaxAlign : file_align(dp);
  try {
    // read_only: private copy-on-write, so an inspecting process never writes the pool.
    m.base_ = map_aligned(fd.fd, size, align, &m.map_len_, path, populate && !read_only, !read_only);
  } catch (const OsError& e) {
    throw_map_error(e, dp, size, path);
  }
  if (!m.devdax_) advise_huge(m.base_, size);
  m.size_ = size;
  m.guard();
  return m;
}

Mapping Mapping::create_file(const std::string& tmp_path, uint64_t size) {
  Mapping m;
  Fd fd;
  fd.fd = ::open(tmp_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd.fd < 0) throw_os(errno, "cannot create pool file", tmp_path);
  struct Unlink {  // F22: no temporary file left behind when creation fails
    const std::string& path;
    bool armed = true;
    ~Unlink() {
      if (armed) ::unlink(path.c_str());
    }
  } unlink_on_error{tmp_path};
  const DirPages dp = fd_huge_pages(fd.fd);
  if (dp.hugetlbfs && size % dp.huge_bytes)
    throw ArgumentError("pool size " + std::to_string(size) + " is not a whole number of the " +
                        std::to_string(dp.huge_bytes) + "-byte pages of the hugetlbfs holding " + tmp_path);
  if (::ftruncate(fd.fd, off_t(size)) != 0) throw_os(errno, "cannot size pool file", tmp_path);
  try {
    m.base_ = map_aligned(fd.fd, size, file_align(dp), &m.map_len_, tmp_path);
  } catch (const OsError& e) {
    throw_map_error(e, dp, size, tmp_path);
  }
  m.size_ = size;
  // Allocate and zero every page now: on tmpfs zeroing otherwise happens at first touch, inside
  // the first store to each block (measured 4-30x slower stores on a fresh pool). Faulting the
  // pages in through the advised mapping (not posix_fallocate, which has no mapping to take the
  // advice from) lets a tmpfs mounted huge=advise give huge pages; 4 KiB ones are the fallback.
  advise_huge(m.base_, size);
  if (::madvise(m.base_, size, MADV_POPULATE_WRITE) != 0) {
    const int pe = errno;
    // Full filesystem (EFAULT/ENOMEM here): posix_fallocate names the cause (ENOSPC) now,
    // instead of a SIGBUS on first touch.
    int e = ::posix_fallocate(fd.fd, 0, off_t(size));
    if (e != 0) throw_os(e, "cannot allocate " + std::to_string(size) + " bytes for", tmp_path);
    if (pe != EINVAL) throw_os(pe, "cannot allocate the pages of", tmp_path);
    // A kernel without MADV_POPULATE_WRITE (< 5.14): map the same range again, populated.
    if (::mmap(m.base_, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd.fd, 0) ==
        MAP_FAILED)
      throw_os(errno, "cannot map", tmp_path);
  }
  struct stat st;
  if (::fstat(fd.fd, &st) == 0) m.dev_ = uint64_t(st.st_dev), m.ino_ = uint64_t(st.st_ino);
  m.guard();
  unlink_on_error.armed = false;
  return m;
}

Mapping Mapping::open_devdax_for_create(const std::string& path, uint64_t size) {
  uint64_t dev = devdax_size(path);
  if (size == 0 || size > dev) size = dev;
  size &= ~(kDevdaxAlign - 1);
  Mapping m;
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd.fd < 0) throw_os(errno, "cannot open devdax device", path);
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) throw_os(errno, "cannot stat", path);
  if (!S_ISCHR(st.st_mode)) throw OsError(ENODEV, path + " is not a devdax character device");
  m.dev_ = uint64_t(st.st_dev), m.ino_ = uint64_t(st.st_ino);
  m.base_ = map_aligned(fd.fd, size, kDevdaxAlign, &m.map_len_, path);
  m.size_ = size;
  m.devdax_ = true;
  return m;
}

}  // namespace cxlkv
