// A pool striped over several devices (format.h "Striped pools"): creation, destruction and the
// open-time check that the mapped stripe geometry is the one the header records. The mapping and
// the identity checks of every device are in platform/striped_mapping.cpp; placement.cpp places
// blocks by device.
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "copy_kernels.h"
#include "pool.h"

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

  std::vector<std::string> tmp = paths;
  if (!devdax) {
    for (auto& p : paths) remove_stale_init_files(p);
    uint8_t r[4];
    (void)::getrandom(r, sizeof r, 0);
    char suffix[64];
    std::snprintf(suffix, sizeof suffix, ".init-%d-%02x%02x%02x%02x", int(::getpid()), r[0], r[1], r[2],
                  r[3]);
    for (auto& p : tmp) p += suffix;
  }
  Mapping m = Mapping::create_striped(tmp, t, h.uuid, h.pool_bytes);
  Coherence c(opt.backend);
  auto* sw = reinterpret_cast<SharedWords*>(m.base() + kSharedWordsOff);
  if (devdax) {  // a device keeps old bytes: BUSY first, then zero the metadata (the arena's descs
                 // are reset when a chunk is carved)
    c.publish(&sw->init.word, kInitBusy);
    std::memset(m.base(), 0, kSharedWordsOff);
    std::memset(m.base() + kSharedWordsOff + kCacheLine, 0, h.arena_off - kSharedWordsOff - kCacheLine);
  }
  h.checksum = header_checksum(h);
  std::memcpy(m.base(), &h, sizeof h);
  std::memcpy(m.base() + kStripeTableOff, &t, sizeof t);
  sw->init.pad[kInitIntentCap] = intent_cap_of(h.index_slots, opt.intent_permille);  // flushed below
  c.flush(m.base(), h.arena_off);
  c.publish(&sw->init.word, kInitReady);  // commit word, written last
  if (!devdax) {
    // Devices 1.. first, the first device (which makes the pool exist) last; link() fails if
    // someone else won a race for a name, and everything of ours is removed again.
    std::vector<std::string> linked;
    auto undo = [&] {
      for (auto& p : linked) ::unlink(p.c_str());
      for (auto& p : tmp) ::unlink(p.c_str());
    };
    for (size_t i = 0; i < paths.size(); ++i) {
      size_t k = (i + 1) % paths.size();
      if (::link(tmp[k].c_str(), paths[k].c_str()) != 0) {
        int e = errno;
        undo();
        throw OsError(e, "cannot create pool device " + paths[k] + ": " + std::strerror(e));
      }
      linked.push_back(paths[k]);
    }
    for (auto& p : tmp) ::unlink(p.c_str());
    m.set_device_paths(paths);
  }
  std::unique_ptr<Pool> p(new Pool());
  p->path_ = spec;
  p->map_ = std::move(m);
  p->validate_and_attach(true);
  return p;
}

void Pool::destroy_striped(const std::string& spec, const DestroyOptions& opt) {
  const std::vector<std::string> paths = split_device_list(spec);
  std::unique_ptr<Pool> p;
  try {
    OpenOptions o;
    o.attach = false;
    o.allow_foreign_owner = true;  // deleting is governed by the directory's permissions
    p = open(spec, o);
  } catch (const Error&) {
    if (!opt.remove_invalid) throw;
  }
  if (p && !opt.ignore_attached) p->refuse_destroy_if_attached(spec);
  if (p) {
    // Devices are wiped (init word, header, labels are not reachable through the range: the
    // header is enough to make the devdax set unusable); files are removed.
    bool any_devdax = false;
    for (auto& d : p->map_.devices()) any_devdax |= d.devdax;
    if (any_devdax) {
      Coherence c;
      c.publish(&p->shared()->init.word, 0);
      std::memset(p->region_.base(), 0, kHeaderBytes);
      kernels::writeback_lines(p->region_.base(), kHeaderBytes);
    }
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
