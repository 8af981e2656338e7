// A pool striped over several devices (format.h "Striped pools"): creation (the one create
// sequence of pool_create.h, after the labels), destruction (destroy's one refusal), and the one
// validator of what the devices say before a stripe is mapped (map_striped: device 0's header and
// stripe table, every other device's label), with the open-time check that the mapped geometry is
// the one the adopted header records (validate_striping). The mapper
// (platform/striped_mapping.cpp) only opens and maps; placement.cpp places blocks by device.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "pool.h"
#include "pool_create.h"
#include "stripe_table.h"

namespace cxlkv {

using namespace format;

std::unique_ptr<Pool> Pool::create_striped(const std::string& spec, PoolHeader h, const CreateOptions& opt,
                                           bool exist_ok) {
  const std::vector<std::string> paths = split_device_list(spec);
  bool devdax = false;
  for (auto& p : paths) devdax |= Mapping::is_devdax_path(p);
  if (devdax) {
    // A device cannot be created or renamed: an existing pool on it is found by opening it.
    try {
      OpenOptions o;
      o.allow_foreign_owner = opt.allow_foreign_owner, o.allow_group = opt.allow_group;
      auto p = open(spec, o);
      if (exist_ok) return p;
      throw OsError(EEXIST, "devices " + spec + " already hold a cxlkv pool");
    } catch (const OsError& e) {
      if (e.err == EEXIST) throw;
    } catch (const Error&) {
    }
  } else if (::access(paths[0].c_str(), F_OK) == 0) {
    if (exist_ok) {
      OpenOptions o;
      o.allow_foreign_owner = opt.allow_foreign_owner, o.allow_group = opt.allow_group;
      return open(spec, o);
    }
    throw OsError(EEXIST, "pool " + paths[0] + " already exists");
  }
  for (size_t k = 1; k < paths.size(); ++k)
    if (!devdax && ::access(paths[k].c_str(), F_OK) == 0)
      throw OsError(EEXIST, "device " + paths[k] +
                                " of the new pool already exists (left by another pool?); " +
                                "remove it first");
  h.minor = pool_minor(true);
  h.incompat |= kIncompatStriped;
  StripeTable t;
  plan_striped_geometry(h, t, opt, uint32_t(paths.size()), devdax);

  const std::vector<std::string> tmp = devdax ? paths : init_names(paths);
  Mapping m = Mapping::create_striped(tmp, stripe_geometry(t), device_bytes(t), h.pool_bytes);
  try {
    for (uint32_t k = 1; k < t.device_count; ++k) {  // outside the range: labels are written directly
      const DeviceLabel l = device_label(t, h.uuid, k, h.pool_bytes);
      m.write_device_head(k, &l, sizeof l, t.label_bytes);
    }
    if (devdax) clear_device_metadata(m.base(), h, opt.backend);
  } catch (...) {
    if (!devdax)
      for (auto& p : tmp) ::unlink(p.c_str());
    throw;
  }
  commit_new_pool(m, h, &t, opt.intent_permille, devdax ? std::vector<std::string>{} : tmp, paths);
  std::unique_ptr<Pool> p(new Pool());
  p->path_ = spec;
  p->map_ = std::move(m);
  p->validate_and_attach(true);
  return p;
}

namespace {

std::string uuid_text(const uint8_t* u) {
  char b[40];
  std::snprintf(b, sizeof b, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
                u[15]);
  return b;
}

}  // namespace

// Everything a device says about itself is untrusted: the header page of device 0 and the label of
// every other device are copied out, checksummed and checked against each other before a single
// stripe is mapped; a wrong order, a missing or extra device, a device of another pool or a short
// device is refused with a one-line error. Region::adopt validates the whole header after.
Mapping Pool::map_striped(const std::string& spec, const OpenOptions& opt) {
  const std::vector<std::string> paths = split_device_list(spec);
  const std::string& P = spec;
  Mapping m =
      Mapping::open_devices(paths, opt.read_only, opt.allow_foreign_owner || opt.read_only, opt.allow_group);
  char page[kHeaderBytes];
  m.read_device_head(0, page, sizeof page);
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
  Region::check_header(h, P);
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
  for (uint32_t k = 1; k < t.device_count; ++k) {
    const std::string& d = paths[k];
    DeviceLabel l;
    m.read_device_head(k, &l, sizeof l);
    if (std::memcmp(l.magic, kLabelMagic, 8) != 0 || l.checksum != device_label_checksum(l)) {
      if (std::memcmp(l.magic, kMagic, 8) == 0)
        throw FormatError("pool " + P + ": " + d + " holds a pool header, so it is a first device, " +
                          "not device " + std::to_string(k) + "; list the devices in order");
      throw FormatError("pool " + P + ": " + d + " is not a device of a striped cxlkv pool (no valid label)");
    }
    if (std::memcmp(l.pool_uuid, h.uuid, 16) != 0)
      throw FormatError("pool " + P + ": device " + d + " belongs to another pool (uuid " +
                        uuid_text(l.pool_uuid) + ", not " + uuid_text(h.uuid) + ")");
    if (l.device_index != k)
      throw FormatError("pool " + P + ": " + d + " is device " + std::to_string(l.device_index) +
                        " of this pool, given as device " + std::to_string(k) +
                        "; list the devices in order");
    if (l.device_count != t.device_count || l.stripe_bytes != t.stripe_bytes ||
        l.pool_bytes != h.pool_bytes || l.label_bytes != t.label_bytes)
      throw FormatError("pool " + P + ": the label of " + d + " disagrees with the pool's stripe table");
  }
  m.map_striped(stripe_geometry(t), h.pool_bytes, device_bytes(t), opt.populate, opt.read_only);
  return m;
}

void Pool::destroy_striped(const std::string& spec, const DestroyOptions& opt) {
  const std::vector<std::string> paths = split_device_list(spec);
  std::unique_ptr<Pool> p = open_for_destroy(spec, opt);
  if (p) {
    // Devices are wiped (init word, header, labels are not reachable through the range: the
    // header is enough to make the devdax set unusable); files are removed.
    bool any_devdax = false;
    for (auto& d : p->map_.devices()) any_devdax |= d.devdax;
    if (any_devdax) wipe_device_pool(p->region_.base());
    p->region_.reset();  // no detach: never attached
    p.reset();
  }
  for (auto& path : paths) {
    if (Mapping::is_devdax_path(path)) continue;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT && !p) continue;  // remove_invalid: a device already gone
      throw OsError(errno, "cannot stat " + path + ": " + std::strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) throw FormatError(path + " is not a regular file; not deleting it");
    if (::unlink(path.c_str()) != 0)
      throw OsError(errno, "cannot delete " + path + ": " + std::strerror(errno));
  }
}

void Pool::validate_striping(const PoolHeader& h, const char* base) {
  const bool striped = h.incompat & kIncompatStriped;
  allocator_.set_stripes(StripeGeometry{});
  if (!striped) {
    if (map_.striped())
      throw FormatError("pool " + path_ + ": " + map_.devices()[0].path +
                        " holds a single-device pool; open it by that path alone");
    return;
  }
  StripeTable t;
  std::memcpy(&t, base + kStripeTableOff, sizeof t);  // private copy (F1)
  std::string bad = stripe_table_problem(t, h.pool_bytes);
  if (!bad.empty()) throw FormatError("pool " + path_ + " has an impossible stripe table (" + bad + ")");
  StripeGeometry g = stripe_geometry(t);
  if (!emu_.base) {
    if (!map_.striped())
      throw FormatError("pool " + path_ + " is striped over " + std::to_string(t.device_count) +
                        " devices; name every device, in order, comma-separated (" + path_ + ",...)");
    const StripeGeometry& m = map_.stripes();
    if (m.devices != g.devices || m.stripe != g.stripe || m.label != g.label || map_.size() != h.pool_bytes)
      throw FormatError("pool " + path_ + ": its stripe table changed while it was being mapped");
  }
  allocator_.set_stripes(g);
}

bool Pool::devices_replaced() const {
  for (auto& d : map_.devices()) {
    struct stat st;
    if (::lstat(d.path.c_str(), &st) != 0) return errno == ENOENT || errno == ENOTDIR;
    if (uint64_t(st.st_dev) != d.dev || uint64_t(st.st_ino) != d.ino) return true;
  }
  return false;
}

bool Pool::devices_intact() const {
  for (auto& d : map_.devices()) {
    struct stat st;
    if (d.devdax || d.fd < 0) continue;  // a device does not shrink
    if (::fstat(d.fd, &st) == 0 && uint64_t(st.st_size) < d.need_bytes) return false;
  }
  return true;
}

}  // namespace cxlkv
