// A pool interleaved over several devices, mapped as one contiguous range (format.h "Striped
// pools"; docs/ARCHITECTURE.md "Device interleaving"). Everything a device says about itself is
// untrusted: the header page of device 0 and the label of every other device are copied out,
// checksummed and checked against each other before a single stripe is mapped.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>

#include "checksum.h"
#include "errors.h"
#include "header_checksum.h"
#include "mapping.h"

namespace cxlkv {

using namespace format;

namespace {
constexpr uint64_t kDevdaxAlign = 2ull << 20;

[[noreturn]] void throw_os(int err, const std::string& what) {
  throw OsError(err, what + ": " + std::strerror(err));
}

bool pow2(uint64_t v) { return v && !(v & (v - 1)); }

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

std::string uuid_text(const uint8_t* u) {
  char b[40];
  std::snprintf(b, sizeof b, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
                u[15]);
  return b;
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

std::vector<std::string> split_device_list(const std::string& spec) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t comma = spec.find(',', start);
    std::string p = spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (p.empty()) throw ArgumentError("empty device in pool path list '" + spec + "'");
    out.push_back(p);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (out.size() > kMaxDevices)
    throw ArgumentError("a pool spans at most " + std::to_string(kMaxDevices) + " devices, " +
                        std::to_string(out.size()) + " given");
  std::set<std::string> seen;
  for (auto& p : out)
    if (!seen.insert(p).second) throw ArgumentError("device " + p + " is listed twice in '" + spec + "'");
  return out;
}

std::string map_budget_problem(uint64_t need, uint64_t used, uint64_t limit, const std::string& what) {
  if (used + need + 256 <= limit) return "";  // 256: room for the libraries' own maps
  return what + " needs " + std::to_string(need) + " memory maps (one per stripe) and this process has " +
         std::to_string(limit > used ? limit - used : 0) + " of vm.max_map_count " + std::to_string(limit) +
         " left; raise vm.max_map_count (sysctl) or use a larger stripe size";
}

uint64_t stripe_table_checksum(const StripeTable& t) { return xxh3(&t, offsetof(StripeTable, checksum)); }
uint64_t device_label_checksum(const DeviceLabel& l) { return xxh3(&l, offsetof(DeviceLabel, checksum)); }

StripeGeometry stripe_geometry(const StripeTable& t) {
  StripeGeometry g;
  g.devices = t.device_count;
  g.stripe = t.stripe_bytes;
  g.label = t.label_bytes;
  return g;
}

void plan_stripes(StripeTable& t, uint64_t pool_bytes, uint32_t devices, uint64_t stripe, bool devdax) {
  if (devices < 2 || devices > kMaxDevices)
    throw ArgumentError("a striped pool has 2.." + std::to_string(kMaxDevices) + " devices");
  if (stripe == 0) stripe = kStripeBytesDefault;
  if (!pow2(stripe) || stripe < kStripeBytesMin || stripe > kStripeBytesMax)
    throw ArgumentError("stripe size must be a power of two in " + std::to_string(kStripeBytesMin) + ".." +
                        std::to_string(kStripeBytesMax) + " bytes");
  if (devdax && stripe % kDevdaxAlign)
    throw ArgumentError("a pool striped over devdax devices needs a stripe size that is a multiple of 2 MiB");
  if (pool_bytes % stripe || pool_bytes < uint64_t(devices) * stripe)
    throw ArgumentError("a striped pool's size must be a multiple of the stripe size (" +
                        std::to_string(stripe) + ") holding at least one stripe per device");
  std::memset(&t, 0, sizeof t);
  std::memcpy(t.magic, kStripeMagic, 8);
  t.device_count = devices;
  t.table_bytes = sizeof(StripeTable);
  t.stripe_bytes = stripe;
  t.label_bytes = label_bytes_for(stripe);
  StripeGeometry g = stripe_geometry(t);
  for (uint32_t d = 0; d < devices; ++d) t.device_bytes[d] = device_need_bytes(g, pool_bytes, d);
  t.checksum = stripe_table_checksum(t);
}

std::string stripe_table_problem(const StripeTable& t, uint64_t pool_bytes) {
  if (std::memcmp(t.magic, kStripeMagic, 8) != 0) return "stripe table magic";
  if (t.checksum != stripe_table_checksum(t)) return "stripe table checksum";
  if (t.table_bytes != sizeof(StripeTable)) return "stripe table size";
  if (t.device_count < 2 || t.device_count > kMaxDevices) return "device count";
  if (!pow2(t.stripe_bytes) || t.stripe_bytes < kStripeBytesMin || t.stripe_bytes > kStripeBytesMax)
    return "stripe size";
  if (t.label_bytes != label_bytes_for(t.stripe_bytes)) return "label size";
  if (pool_bytes % t.stripe_bytes || pool_bytes / t.stripe_bytes < t.device_count)
    return "pool size vs stripes";
  StripeGeometry g = stripe_geometry(t);
  for (uint32_t d = 0; d < kMaxDevices; ++d)
    if (t.device_bytes[d] != (d < t.device_count ? device_need_bytes(g, pool_bytes, d) : 0))
      return "device sizes";
  return "";
}

Mapping Mapping::open_striped(const std::vector<std::string>& paths, bool populate, bool read_only,
                              bool allow_foreign_owner, bool allow_group) {
  const std::string P = join(paths);
  Mapping m;
  uint64_t pool_bytes = 0;
  try {
    for (auto& p : paths) m.devices_.push_back(open_device(p, read_only, allow_foreign_owner, allow_group));
    std::set<std::pair<uint64_t, uint64_t>> ids;
    for (auto& d : m.devices_)
      if (!ids.insert({d.dev, d.ino}).second)
        throw ArgumentError("device " + d.path + " of pool " + P + " names a file listed before it");
    // Device 0: the pool header and the stripe table (a private copy: validated once, used after).
    char page[kHeaderBytes];
    read_head(m.devices_[0].fd, m.devices_[0].devdax, page, sizeof page, paths[0]);
    PoolHeader h;
    std::memcpy(&h, page, sizeof h);
    if (std::memcmp(h.magic, kMagic, 8) != 0) {
      DeviceLabel l;
      std::memcpy(&l, page, sizeof l);
      if (std::memcmp(l.magic, kLabelMagic, 8) == 0 && l.checksum == device_label_checksum(l))
        throw FormatError("pool " + P + ": " + paths[0] + " is device " + std::to_string(l.device_index) +
                          " of a striped pool (uuid " + uuid_text(l.pool_uuid) +
                          "), not its first device; list the devices in order, first device first");
      throw FormatError(P + " is not a cxlkv pool: its first device " + paths[0] + " has no pool header");
    }
    if (h.checksum != header_checksum(h))
      throw FormatError("pool " + P + " header checksum mismatch: the header is corrupt");
    if (!(h.incompat & kIncompatStriped))
      throw FormatError("pool " + P + ": " + paths[0] +
                        " holds a single-device pool; open it by that path alone");
    StripeTable t;
    std::memcpy(&t, page + kStripeTableOff, sizeof t);
    std::string bad = stripe_table_problem(t, h.pool_bytes);
    if (!bad.empty()) throw FormatError("pool " + P + " has an impossible stripe table (" + bad + ")");
    if (t.device_count != paths.size())
      throw FormatError("pool " + P + " is striped over " + std::to_string(t.device_count) + " devices, " +
                        std::to_string(paths.size()) + " given; name every device, in order");
    const StripeGeometry g = stripe_geometry(t);
    for (uint32_t k = 0; k < t.device_count; ++k) {
      MappedDevice& d = m.devices_[k];
      if (d.devdax && (t.stripe_bytes % kDevdaxAlign || t.label_bytes % kDevdaxAlign))
        throw FormatError("pool " + P + ": device " + d.path +
                          " is devdax but the stripes are not 2 MiB aligned");
      if (k > 0) {
        DeviceLabel l;
        read_head(d.fd, d.devdax, &l, sizeof l, d.path);
        if (std::memcmp(l.magic, kLabelMagic, 8) != 0 || l.checksum != device_label_checksum(l)) {
          if (std::memcmp(l.magic, kMagic, 8) == 0)
            throw FormatError("pool " + P + ": " + d.path +
                              " holds a pool header, so it is a first device, " + "not device " +
                              std::to_string(k) + "; list the devices in order");
          throw FormatError("pool " + P + ": " + d.path +
                            " is not a device of a striped cxlkv pool (no valid label)");
        }
        if (std::memcmp(l.pool_uuid, h.uuid, 16) != 0)
          throw FormatError("pool " + P + ": device " + d.path + " belongs to another pool (uuid " +
                            uuid_text(l.pool_uuid) + ", not " + uuid_text(h.uuid) + ")");
        if (l.device_index != k)
          throw FormatError("pool " + P + ": " + d.path + " is device " + std::to_string(l.device_index) +
                            " of this pool, given as device " + std::to_string(k) +
                            "; list the devices in order");
        if (l.device_count != t.device_count || l.stripe_bytes != t.stripe_bytes ||
            l.pool_bytes != h.pool_bytes || l.label_bytes != t.label_bytes)
          throw FormatError("pool " + P + ": the label of " + d.path +
                            " disagrees with the pool's stripe table");
      }
      if (d.need_bytes < t.device_bytes[k])
        throw TruncatedError("pool " + P + " is truncated: device " + d.path + " has " +
                             std::to_string(d.need_bytes) + " bytes, the pool needs " +
                             std::to_string(t.device_bytes[k]));
      d.need_bytes = t.device_bytes[k];
    }
    m.geo_ = g;
    pool_bytes = h.pool_bytes;
    m.base_ = map_stripes(g, pool_bytes, m.devices_, populate, read_only, "pool " + P);
  } catch (...) {
    m.close_devices();
    throw;
  }
  m.size_ = m.map_len_ = pool_bytes;
  m.dev_ = m.devices_[0].dev, m.ino_ = m.devices_[0].ino;
  m.guard();
  return m;
}

Mapping Mapping::create_striped(const std::vector<std::string>& tmp_paths, const StripeTable& t,
                                const uint8_t uuid[16], uint64_t pool_bytes) {
  const std::string P = join(tmp_paths);
  Mapping m;
  std::vector<std::string> created;  // removed again if anything fails
  try {
    for (uint32_t k = 0; k < t.device_count; ++k) {
      const std::string& path = tmp_paths[k];
      MappedDevice d;
      if (is_devdax_path(path)) {
        d = open_device(path, false, true, false);
        if (d.need_bytes < t.device_bytes[k])
          throw ArgumentError("devdax device " + path + " has " + std::to_string(d.need_bytes) +
                              " bytes, device " + std::to_string(k) + " of this pool needs " +
                              std::to_string(t.device_bytes[k]));
      } else {
        d.path = path;
        d.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (d.fd < 0) throw_os(errno, "cannot create pool device file " + path);
        created.push_back(path);
        // Pages reserved now: a full /dev/shm fails here, not with a SIGBUS at first touch.
        int e = ::posix_fallocate(d.fd, 0, off_t(t.device_bytes[k]));
        if (e != 0) {
          ::close(d.fd);
          throw_os(e, "cannot allocate " + std::to_string(t.device_bytes[k]) + " bytes for " + path);
        }
        struct stat st;
        if (::fstat(d.fd, &st) == 0) d.dev = uint64_t(st.st_dev), d.ino = uint64_t(st.st_ino);
      }
      d.need_bytes = t.device_bytes[k];
      m.devices_.push_back(d);
    }
    for (uint32_t k = 1; k < t.device_count; ++k) {
      DeviceLabel l{};
      std::memcpy(l.magic, kLabelMagic, 8);
      std::memcpy(l.pool_uuid, uuid, 16);
      l.device_index = k;
      l.device_count = t.device_count;
      l.stripe_bytes = t.stripe_bytes;
      l.pool_bytes = pool_bytes;
      l.label_bytes = t.label_bytes;
      l.checksum = device_label_checksum(l);
      const MappedDevice& d = m.devices_[k];
      if (d.devdax) {
        void* p = ::mmap(nullptr, kDevdaxAlign, PROT_READ | PROT_WRITE, MAP_SHARED, d.fd, 0);
        if (p == MAP_FAILED) throw_os(errno, "cannot map " + d.path);
        std::memset(p, 0, t.label_bytes);
        std::memcpy(p, &l, sizeof l);
        ::munmap(p, kDevdaxAlign);
      } else if (::pwrite(d.fd, &l, sizeof l, 0) != ssize_t(sizeof l)) {
        throw_os(errno, "cannot write the label of " + d.path);
      }
    }
    m.geo_ = stripe_geometry(t);
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

}  // namespace cxlkv
