#include "mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "errors.h"
#include "format.h"

namespace cxlkv {

namespace {
constexpr uint64_t kDevdaxAlign = 2ull << 20;

[[noreturn]] void throw_os(int err, const std::string& what, const std::string& path) {
  throw OsError(err, what + " " + path + ": " + std::strerror(err));
}

struct Fd {
  int fd = -1;
  ~Fd() { if (fd >= 0) ::close(fd); }
};

// Maps `len` bytes of fd at an address aligned to `align`.
char* map_aligned(int fd, uint64_t len, uint64_t align, uint64_t* map_len, const std::string& path,
                  bool populate = false) {
  if (align <= 4096) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    if (p == MAP_FAILED) throw_os(errno, "cannot map", path);
    *map_len = len;
    return static_cast<char*>(p);
  }
  void* r = ::mmap(nullptr, len + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) throw_os(errno, "cannot reserve address space for", path);
  uintptr_t a = (reinterpret_cast<uintptr_t>(r) + align - 1) & ~(align - 1);
  void* p = ::mmap(reinterpret_cast<void*>(a), len, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), fd, 0);
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
}  // namespace

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, map_len_);
    base_ = o.base_, size_ = o.size_, map_len_ = o.map_len_, devdax_ = o.devdax_;
    o.base_ = nullptr, o.size_ = o.map_len_ = 0;
  }
  return *this;
}

Mapping::~Mapping() {
  if (base_) ::munmap(base_, map_len_);
}

bool Mapping::is_devdax_path(const std::string& path) {
  return path.rfind("/dev/dax", 0) == 0;
}

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

Mapping Mapping::open_existing(const std::string& path, bool populate) {
  Mapping m;
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd.fd < 0) {
    int e = errno;
    if (e == ENOENT && is_devdax_path(path)) throw OsError(e, "devdax device " + path + " does not exist");
    if (e == ENOENT) throw OsError(e, "pool " + path + " does not exist");
    if (e == EISDIR) throw OsError(e, path + " is a directory, not a pool");
    throw_os(e, "cannot open pool", path);
  }
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) throw_os(errno, "cannot stat", path);
  if (S_ISDIR(st.st_mode)) throw OsError(EISDIR, path + " is a directory, not a pool");
  uint64_t size;
  if (S_ISCHR(st.st_mode)) {
    size = devdax_size(path);
    m.devdax_ = true;
  } else if (S_ISREG(st.st_mode)) {
    size = uint64_t(st.st_size);
  } else {
    throw FormatError(path + " is neither a regular file nor a devdax device");
  }
  if (size < format::kSharedWordsOff + 4096)
    throw TruncatedError("pool " + path + " is truncated: " + std::to_string(size) +
                         " bytes, smaller than a pool header");
  m.base_ = map_aligned(fd.fd, size, m.devdax_ ? kDevdaxAlign : 0, &m.map_len_, path, populate);
  m.size_ = size;
  return m;
}

Mapping Mapping::create_file(const std::string& tmp_path, uint64_t size) {
  Mapping m;
  Fd fd;
  fd.fd = ::open(tmp_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd.fd < 0) throw_os(errno, "cannot create pool file", tmp_path);
  // posix_fallocate reserves tmpfs pages now, so a full /dev/shm fails here with a clear error
  // instead of a SIGBUS on first touch.
  int e = ::posix_fallocate(fd.fd, 0, off_t(size));
  if (e != 0) {
    ::unlink(tmp_path.c_str());
    throw_os(e, "cannot allocate " + std::to_string(size) + " bytes for", tmp_path);
  }
  m.base_ = map_aligned(fd.fd, size, 0, &m.map_len_, tmp_path, true);
  m.size_ = size;
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
  m.base_ = map_aligned(fd.fd, size, kDevdaxAlign, &m.map_len_, path);
  m.size_ = size;
  m.devdax_ = true;
  return m;
}

}  // namespace cxlkv
