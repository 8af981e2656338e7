// A range interleaved over several devices, mapped as one contiguous range (docs/ARCHITECTURE.md
// "Device interleaving"). The mapper only maps: it opens the devices, copies out their first bytes
// for the caller, and maps the stripes of a geometry the caller has validated. What the bytes of a
// pool mean (header, stripe table, labels) is checked above it, by the one validator of a striped
// pool (striped_pool.cpp) before a single stripe is mapped, and by Region::adopt after.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>

#include "errors.h"
#include "mapping.h"

namespace cxlkv {

namespace {
constexpr uint64_t kDevdaxAlign = 2ull << 20;

[[noreturn]] void throw_os(int err, const std::string& what) {
  throw OsError(err, what + ": " + std::strerror(err));
}

// Copies the first n bytes of a device: pread for a file, a transient mapping for devdax (which
// has no read()). A short file reads as zeros past its end.
void read_head(int fd, bool devdax, void* out, size_t n, const std::string& path) {
  std::memset(out, 0, n);
  if (!devdax) {
    ssize_t r = ::pread(fd, out, n, 0);
    if (r < 0) throw_os(errno, "cannot read " + path);
    return;
  }
  void* p = ::mmap(nullptr, kDevdaxAlign, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_os(errno, "cannot map " + path);
  std::memcpy(out, p, n);
  ::munmap(p, kDevdaxAlign);
}

// One mmap per stripe: stripes next to each other in the pool are on different devices.
uint64_t stripe_count(const StripeGeometry& g, uint64_t pool_bytes) { return pool_bytes / g.stripe; }

// A process may hold vm.max_map_count mappings (65530 by default); a 64 GiB pool at 2 MiB stripes
// takes 32768 of them, whatever the device count. Refuse before half-mapping a pool.
void check_map_budget(uint64_t need, const std::string& what) {
  uint64_t limit = 0;
  std::ifstream lim("/proc/sys/vm/max_map_count");
  if (!(lim >> limit) || limit == 0) return;  // unknown: let mmap answer
  uint64_t used = 0;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) ++used;
  std::string problem = map_budget_problem(need, used, limit, what);
  if (!problem.empty()) throw OsError(ENOMEM, problem);
}

// Reserves an aligned range and maps every stripe into it. Throws (and unmaps) on failure.
char* map_stripes(const StripeGeometry& g, uint64_t pool_bytes, const std::vector<MappedDevice>& devs,
                  bool populate, bool private_copy, const std::string& what) {
  check_map_budget(stripe_count(g, pool_bytes), what);
  const uint64_t align = std::min<uint64_t>(g.stripe, kDevdaxAlign);
  void* r =
      ::mmap(nullptr, pool_bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) throw_os(errno, "cannot reserve address space for " + what);
  uintptr_t rb = reinterpret_cast<uintptr_t>(r);
  uintptr_t a = (rb + align - 1) & ~(align - 1);
  if (a > rb) ::munmap(r, a - rb);
  if (rb + align > a) ::munmap(reinterpret_cast<void*>(a + pool_bytes), rb + align - a);
  char* base = reinterpret_cast<char*>(a);
  const int flags = (private_copy ? MAP_PRIVATE : MAP_SHARED) | MAP_FIXED | (populate ? MAP_POPULATE : 0);
  for (uint64_t i = 0, n = stripe_count(g, pool_bytes); i < n; ++i) {
    uint64_t off = i * g.stripe;
    const MappedDevice& d = devs[stripe_device(g, off)];
    void* p = ::mmap(base + off, g.stripe, PROT_READ | PROT_WRITE, flags, d.fd, off_t(device_offset(g, off)));
    if (p == MAP_FAILED) {
      int e = errno;
      ::munmap(base, pool_bytes);
      throw_os(e, "cannot map stripe " + std::to_string(i) + " of " + what + " from " + d.path);
    }
  }
  return base;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

// Opens one device of a striped pool, applying open_existing's rules (no symlink, owner policy).
MappedDevice open_device(const std::string& path, bool read_only, bool allow_foreign_owner,
                         bool allow_group) {
  MappedDevice d;
  d.path = path;
  d.fd = ::open(path.c_str(), (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NOFOLLOW);
  if (d.fd < 0) {
    int e = errno;
    if (e == ENOENT) throw OsError(e, "device " + path + " of the pool does not exist");
    if (e == ELOOP) throw OsError(e, "device " + path + " is a symbolic link; refusing to follow it");
    throw_os(e, "cannot open device " + path);
  }
  struct stat st;
  if (::fstat(d.fd, &st) != 0) {
    int e = errno;
    ::close(d.fd);
    throw_os(e, "cannot stat " + path);
  }
  try {
    if (!allow_foreign_owner) mapping_detail::check_owner(st, path, allow_group);
    if (S_ISCHR(st.st_mode)) {
      d.devdax = true;
      d.need_bytes = devdax_size(path);  // the size it has, until checked against what it needs
    } else if (S_ISREG(st.st_mode)) {
      d.need_bytes = uint64_t(st.st_size);
    } else {
      throw FormatError(path + " is neither a regular file nor a devdax device");
    }
  } catch (...) {
    ::close(d.fd);
    throw;
  }
  d.dev = uint64_t(st.st_dev), d.ino = uint64_t(st.st_ino);
  return d;
}

}  // namespace

std::string map_budget_problem(uint64_t need, uint64_t used, uint64_t limit, const std::string& what) {
  if (used + need + 256 <= limit) return "";  // 256: room for the libraries' own maps
  return what + " needs " + std::to_string(need) + " memory maps (one per stripe) and this process has " +
         std::to_string(limit > used ? limit - used : 0) + " of vm.max_map_count " + std::to_string(limit) +
         " left; raise vm.max_map_count (sysctl) or use a larger stripe size";
}

Mapping Mapping::open_devices(const std::vector<std::string>& paths, bool read_only, bool allow_foreign_owner,
                              bool allow_group) {
  const std::string P = join(paths);
  Mapping m;
  try {
    for (auto& p : paths) m.devices_.push_back(open_device(p, read_only, allow_foreign_owner, allow_group));
    std::set<std::pair<uint64_t, uint64_t>> ids;
    for (auto& d : m.devices_)
      if (!ids.insert({d.dev, d.ino}).second)
        throw ArgumentError("device " + d.path + " of pool " + P + " names a file listed before it");
  } catch (...) {
    m.close_devices();
    throw;
  }
  m.dev_ = m.devices_[0].dev, m.ino_ = m.devices_[0].ino;
  return m;
}

void Mapping::read_device_head(uint32_t k, void* out, size_t n) const {
  const MappedDevice& d = devices_.at(k);
  read_head(d.fd, d.devdax, out, n, d.path);
}

void Mapping::map_striped(const StripeGeometry& g, uint64_t pool_bytes, const std::vector<uint64_t>& need,
                          bool populate, bool private_copy) {
  std::vector<std::string> paths;
  for (auto& d : devices_) paths.push_back(d.path);
  const std::string P = join(paths);
  if (need.size() != devices_.size() || g.devices != devices_.size())
    throw ArgumentError("pool " + P + ": " + std::to_string(devices_.size()) + " devices given for " +
                        std::to_string(g.devices) + " stripes");
  try {
    for (size_t k = 0; k < devices_.size(); ++k) {
      MappedDevice& d = devices_[k];
      if (d.devdax && (g.stripe % kDevdaxAlign || g.label % kDevdaxAlign))
        throw FormatError("pool " + P + ": device " + d.path +
                          " is devdax but the stripes are not 2 MiB aligned");
      if (d.need_bytes < need[k])
        throw TruncatedError("pool " + P + " is truncated: device " + d.path + " has " +
                             std::to_string(d.need_bytes) + " bytes, the pool needs " +
                             std::to_string(need[k]));
      d.need_bytes = need[k];
    }
    geo_ = g;
    base_ = map_stripes(g, pool_bytes, devices_, populate, private_copy, "pool " + P);
  } catch (...) {
    close_devices();
    throw;
  }
  size_ = map_len_ = pool_bytes;
  guard();
}

Mapping Mapping::create_striped(const std::vector<std::string>& tmp_paths, const StripeGeometry& g,
                                const std::vector<uint64_t>& need, uint64_t pool_bytes) {
  const std::string P = join(tmp_paths);
  Mapping m;
  std::vector<std::string> created;  // removed again if anything fails
  try {
    for (uint32_t k = 0; k < g.devices; ++k) {
      const std::string& path = tmp_paths.at(k);
      MappedDevice d;
      if (is_devdax_path(path)) {
        d = open_device(path, false, true, false);
        if (d.need_bytes < need.at(k))
          throw ArgumentError("devdax device " + path + " has " + std::to_string(d.need_bytes) +
                              " bytes, device " + std::to_string(k) + " of this pool needs " +
                              std::to_string(need[k]));
      } else {
        d.path = path;
        d.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (d.fd < 0) throw_os(errno, "cannot create pool device file " + path);
        created.push_back(path);
        // Pages reserved now: a full /dev/shm fails here, not with a SIGBUS at first touch.
        int e = ::posix_fallocate(d.fd, 0, off_t(need.at(k)));
        if (e != 0) {
          ::close(d.fd);
          throw_os(e, "cannot allocate " + std::to_string(need[k]) + " bytes for " + path);
        }
        struct stat st;
        if (::fstat(d.fd, &st) == 0) d.dev = uint64_t(st.st_dev), d.ino = uint64_t(st.st_ino);
      }
      d.need_bytes = need[k];
      m.devices_.push_back(d);
    }
    m.geo_ = g;
    m.base_ = map_stripes(m.geo_, pool_bytes, m.devices_, true, false, "pool " + P);
  } catch (...) {
    m.close_devices();
    for (auto& p : created) ::unlink(p.c_str());  // F22: no temporary file left behind
    throw;
  }
  m.size_ = m.map_len_ = pool_bytes;
  m.dev_ = m.devices_[0].dev, m.ino_ = m.devices_[0].ino;
  m.guard();
  return m;
}

void Mapping::write_device_head(uint32_t k, const void* bytes, size_t n, uint64_t zero_bytes) {
  const MappedDevice& d = devices_.at(k);
  if (d.devdax) {  // a device keeps old bytes: the whole head area is cleared first
    void* p = ::mmap(nullptr, kDevdaxAlign, PROT_READ | PROT_WRITE, MAP_SHARED, d.fd, 0);
    if (p == MAP_FAILED) throw_os(errno, "cannot map " + d.path);
    std::memset(p, 0, std::min<uint64_t>(zero_bytes, kDevdaxAlign));
    std::memcpy(p, bytes, n);
    ::munmap(p, kDevdaxAlign);
  } else if (::pwrite(d.fd, bytes, n, 0) != ssize_t(n)) {  // a new file is zero already
    throw_os(errno, "cannot write the head of " + d.path);
  }
}

}  // namespace cxlkv
