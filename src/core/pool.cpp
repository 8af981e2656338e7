// Pool creation, opening an existing pool (its header is validated by Region::adopt), attachment.
#include "pool.h"

#include "pool_create.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace cxlkv {

using namespace format;

namespace {

void fill_stamp(PoolHeader& h) {
  h.stamp_cache_line = kCacheLine;
  h.stamp_header = sizeof(PoolHeader);
  h.stamp_node_slot = sizeof(NodeSlot);
  h.stamp_node_area_fixed = sizeof(NodeAreaFixed);
  h.stamp_namespace = sizeof(NamespaceEntry);
  h.stamp_index_entry = sizeof(IndexEntry);
}

}  // namespace

namespace {
std::atomic<uint64_t> g_fork_generation{0};
void note_fork_in_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
uint64_t fork_generation() {
  static const int registered = ::pthread_atfork(nullptr, nullptr, note_fork_in_child);
  (void)registered;
  return g_fork_generation.load(std::memory_order_relaxed);
}
}  // namespace

namespace {

OpenOptions open_options_of(const CreateOptions& c) {
  OpenOptions o;
  o.allow_foreign_owner = c.allow_foreign_owner;
  o.allow_group = c.allow_group;
  return o;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
std::unique_ptr<Pool> Pool::create(const std::string& path, const CreateOptions& opt, bool exist_ok) {
  PoolHeader h{};
  std::memcpy(h.magic, kMagic, 8);
  h.major = kFormatMajor;
  h.minor = pool_minor(false);
  h.header_bytes = sizeof(PoolHeader);
  h.compat = kCompatAdminMailbox;
  h.backend = uint32_t(opt.backend);
  if (opt.backend != Backend::coherent && opt.backend != Backend::flush && opt.backend != Backend::multihost)
    throw ArgumentError("unknown backend");
  if (::getrandom(h.uuid, sizeof h.uuid, 0) != sizeof h.uuid) throw OsError(errno, "getrandom failed");
  h.created_unix_ns = now_unix_ns();
  if (opt.lease_ms < kLeaseMsMin || opt.lease_ms > kLeaseMsMax)
    throw ArgumentError("lease_ms must be in " + std::to_string(kLeaseMsMin) + ".." +
                        std::to_string(kLeaseMsMax));
  h.lease_ms = opt.lease_ms;
  fill_stamp(h);
  if (is_device_list(path)) return create_striped(path, h, opt, exist_ok);  // striped_pool.cpp
  // Silently ignoring it would leave the caller believing the pool is striped.
  if (opt.stripe_bytes)
    throw ArgumentError("a stripe size is only meaningful for a pool of several devices (A,B,...); " + path +
                        " is one");

  bool devdax = Mapping::is_devdax_path(path);
  Mapping m;
  std::string tmp;
  if (devdax) {
    m = Mapping::open_devdax_for_create(path, opt.size);
    auto* existing = reinterpret_cast<const PoolHeader*>(m.base());
    auto* sw = reinterpret_cast<SharedWords*>(m.base() + kSharedWordsOff);
    if (std::memcmp(existing->magic, kMagic, 8) == 0 && sw->init.word == kInitReady) {
      if (!exist_ok) throw OsError(EEXIST, "devdax device " + path + " already holds a cxlkv pool");
      m = Mapping();
      return open(path, open_options_of(opt));
    }
    CreateOptions o = opt;
    o.size = m.size();
    plan_geometry(h, o);
    clear_device_metadata(m.base(), h, opt.backend);
  } else {
    if (::access(path.c_str(), F_OK) == 0) {
      if (exist_ok) return open(path, open_options_of(opt));
      throw OsError(EEXIST, "pool " + path + " already exists");
    }
    // Where huge pages may back the file, the pool is whole huge pages (huge_pages.h).
    CreateOptions fitted = opt;
    fitted.size = fit_huge_pages(path, opt.size);
    try {
      plan_geometry(h, fitted);
    } catch (const ArgumentError& e) {
      if (fitted.size == opt.size) throw;  // name the size the caller asked for, not only ours
      throw ArgumentError(std::string(e.what()) + " (the " + std::to_string(opt.size) +
                          " bytes asked for, rounded down to whole huge pages)");
    }
    tmp = init_names({path})[0];
    m = Mapping::create_file(tmp, fitted.size);  // zero-filled: every state word starts FREE/EMPTY
  }
  try {
    commit_new_pool(m, h, nullptr, opt.intent_permille,
                    devdax ? std::vector<std::string>{} : std::vector<std::string>{tmp}, {path});
  } catch (const OsError& e) {
    if (e.err != EEXIST || !exist_ok) throw;
    return open(path, open_options_of(opt));
  }
  std::unique_ptr<Pool> p(new Pool());
  p->path_ = path;
  p->map_ = std::move(m);
  p->validate_and_attach(true);
  return p;
}

std::unique_ptr<Pool> Pool::open(const std::string& path, bool populate, bool attach) {
  OpenOptions o;
  o.populate = populate;
  o.attach = attach;
  return open(path, o);
}

std::unique_ptr<Pool> Pool::open(const std::string& path, const OpenOptions& opt) {
  std::unique_ptr<Pool> p(new Pool());
  p->path_ = path;
  p->read_only_ = opt.read_only;
  p->want_slot_ = opt.host_slot;
  if (is_device_list(path))
    p->map_ = map_striped(path, opt);  // striped_pool.cpp: the one validator before a stripe is mapped
  else
    p->map_ = Mapping::open_existing(path, kSharedWordsOff + kMetaAlign, opt.populate, opt.read_only,
                                     opt.allow_foreign_owner || opt.read_only, opt.allow_group);
  p->validate_and_attach(false, opt.attach && !opt.read_only);
  return p;
}

std::unique_ptr<Pool> Pool::open_emulated(const EmulatedHost& host, bool attach) {
  if (!host.base || !host.model) throw ArgumentError("emulated host without memory or cache model");
  std::unique_ptr<Pool> p(new Pool());
  p->path_ = "emulated:host" + std::to_string(host.host_slot);
  p->emu_ = host;
  p->validate_and_attach(false, attach);
  return p;
}

namespace {
std::string describe_nodes(const std::vector<std::pair<uint32_t, uint32_t>>& nodes) {
  std::string s;
  for (auto [id, pid] : nodes)
    s += (s.empty() ? "" : ", ") + ("node " + std::to_string(id) + " (pid " + std::to_string(pid) + ")");
  return s;
}
}  // namespace

std::vector<std::pair<uint32_t, uint32_t>> Pool::attached_nodes() {
  reap_dead_nodes();
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    if (node_id_ == i + 1) continue;
    uint64_t w = coh_.read(&node_slot(i)->state);
    if (node_state(w) != kNodeFree) out.emplace_back(i + 1, uint32_t(coh_.read(&node_slot(i)->pid)));
  }
  return out;
}

std::unique_ptr<Pool> Pool::open_for_destroy(const std::string& spec, const DestroyOptions& opt) {
  // Refuse to wipe or delete something that is not a pool, and a pool that live processes use
  // (they would keep serving an unlinked pool while new ones use a new one: split brain, F15).
  std::unique_ptr<Pool> p;
  try {
    OpenOptions o;
    o.attach = false;
    o.allow_foreign_owner = true;  // deleting is governed by the directory's permissions
    p = open(spec, o);
  } catch (const Error& e) {
    // remove_invalid removes what does not hold a valid pool; a single path that cannot be opened
    // at all is still an error (a striped pool's devices may be gone or unreadable: what is left
    // of them is removed).
    const bool invalid = dynamic_cast<const NotReadyError*>(&e) || dynamic_cast<const FormatError*>(&e) ||
                         dynamic_cast<const VersionError*>(&e) || dynamic_cast<const TruncatedError*>(&e);
    if (!opt.remove_invalid || !(invalid || is_device_list(spec))) throw;
  }
  if (p && !opt.ignore_attached) {
    auto live = p->attached_nodes();
    if (!live.empty())
      throw PoolInUseError("pool " + spec + " is in use by " + std::to_string(live.size()) +
                           " attached process(es): " + describe_nodes(live) +
                           "; stop them first, or force it (CLI: --ignore-attached)");
  }
  return p;
}

void Pool::destroy(const std::string& path, const DestroyOptions& opt) {
  if (is_device_list(path)) return destroy_striped(path, opt);
  std::unique_ptr<Pool> p = open_for_destroy(path, opt);
  if (Mapping::is_devdax_path(path)) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0)
      throw OsError(errno, "cannot stat " + path + ": " + std::strerror(errno));
    if (!S_ISCHR(st.st_mode))
      throw FormatError(path +
                        " is not a devdax character device; not wiping it (remove a regular file with rm)");
    if (!p) throw FormatError(path + " does not hold a valid cxlkv pool; not wiping it");
    char* b = p->region_.base();
    p->region_.reset();  // no detach: never attached
    wipe_device_pool(b);
    return;
  }
  if (!p) {
    // remove_invalid: the file must at least be a regular file (never a device or a directory).
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0)
      throw OsError(errno, "cannot stat " + path + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw FormatError(path + " is not a regular file; not deleting it");
  }
  p.reset();
  if (::unlink(path.c_str()) != 0)
    throw OsError(errno, "cannot delete " + path + ": " + std::strerror(errno));
}

bool Pool::file_replaced() const {
  if (map_.striped()) return devices_replaced();
  struct stat st;
  if (::lstat(path_.c_str(), &st) != 0) return errno == ENOENT || errno == ENOTDIR;
  return uint64_t(st.st_dev) != map_.file_dev() || uint64_t(st.st_ino) != map_.file_ino();
}

void Pool::check_truncated() const {
  if (!map_.truncated()) return;
  if (map_.striped())
    throw TruncatedError("pool " + path_ +
                         ": a device shrank while mapped; close it and re-open or re-create the pool");
  struct stat st;
  std::string now =
      ::stat(path_.c_str(), &st) == 0 ? std::to_string(uint64_t(st.st_size)) + " bytes" : "missing";
  throw TruncatedError("pool " + path_ + " was truncated while mapped (now " + now + ", mapped " +
                       std::to_string(map_.size()) + " bytes); close it and re-open or re-create the pool");
}

void Pool::validate_and_attach(bool fresh, bool attach) {
  (void)fresh;
  char* b = emu_.base ? emu_.base : map_.base();
  const uint64_t mapped = emu_.base ? emu_.size : map_.size();
  // The stripe table is checked inside the header validation, before the size check: one
  // device of a striped pool is smaller than the pool (striped_pool.cpp).
  region_.adopt(b, mapped, path_, read_only_, emu_.model,
                [&](const PoolHeader& hh) { validate_striping(hh, b); });
  const PoolHeader& h = *hdr_;
  pid_ = uint32_t(::getpid());
  fork_generation_ = fork_generation();
  // Liveness identity (nodes.cpp, liveness.h): this kernel, and the lock descriptor by which the
  // nodes of this kernel judge each other. An observer (attach=false) judges but takes no slot; a
  // read-only inspection judges for display only and reclaims nothing.
  host_id_ = emu_.base ? emu_.host_id : liveness::host_id();
  if (!emu_.base)
    lock_ = liveness::open_lock_file(map_.striped() ? map_.devices()[0].path : path_, map_.file_dev(),
                                     map_.file_ino());
  domain_ = liveness::domain_tag(host_id_, lock_.lock_id);
  node_table_.reset_watches(h.max_nodes);
  attachment_.set_identity({pid_, emu_.base != nullptr, emu_.model, emu_.host_slot, want_slot_});
  if (read_only_) return;
  if (!emu_.base) fault_trap::arm_from_env();  // tests only: CXLKV_TEST_FAULT (fault_trap.h)
  // The row (multihost; none yet for an observer), a reap of the dead, the node slot: nodes.cpp.
  attachment_.open(attach);
  check_truncated();
}

Pool::~Pool() {
  try {
    close();
  } catch (...) {
  }
}

void Pool::ensure_usable() const {
  if (!region_.base()) throw ClosedError("pool " + path_ + " is closed");
  if (fenced_.load(std::memory_order_acquire))
    throw fenced_error("pool " + path_ + ": node " + std::to_string(node_id_));
  if (fork_generation_ != fork_generation())
    throw ForkedError(
        "pool " + path_ +
        ": this attachment was inherited through fork(); open the pool again in the child process");
  check_truncated();
}

void Pool::abandon() {
  // The mailbox responder thread reads this Pool (its fence flag, the mapping): it ends before
  // either goes. close() stops it in detach_node, which abandon skips (no store into the pool).
  // A forked child's copy only forgets it: the thread is the parent's.
  if (fork_generation_ == fork_generation())
    admin_.stop();
  else
    admin_.forget();
  attachment_.abandon();  // fenced, its heartbeat stopped, no node
  if (fork_generation_ == fork_generation()) liveness::close_lock_file(lock_);
  lock_ = liveness::LockFile{};
  region_.reset();
  map_ = Mapping();
}

bool Pool::mapping_intact() const {
  if (emu_.base) return region_.base() != nullptr;
  if (!region_.base() || map_.truncated()) return false;
  if (map_.striped()) return devices_intact();
  if (map_.devdax() || lock_.fd < 0) return true;  // a device does not shrink; no fd to ask
  struct stat st;  // lock_.fd names the mapped inode (checked when it was opened)
  return ::fstat(lock_.fd, &st) != 0 || uint64_t(st.st_size) >= map_.size();
}

void Pool::close() { Mapping unmapped_here = take_mapping_on_close(); }

Mapping Pool::take_mapping_on_close() {
  if (!region_.base()) return Mapping();
  // A forked child unmaps only: the node slot and its lock belong to the parent (the child's
  // copy of the lock descriptor was closed at fork; the number may name another file now).
  if (fork_generation_ == fork_generation()) {
    attachment_.detach_node();
    liveness::close_lock_file(lock_);
  }
  lock_ = liveness::LockFile{};
  attachment_.forget_heartbeat();
  admin_.forget();  // a forked child's copy: its thread is not in this process (never joined)
  region_.reset();
  return std::move(map_);
}

std::vector<DeviceUse> Pool::device_usage() {
  ensure_usable();
  std::vector<std::string> paths;
  for (uint32_t d = 0; d < stripes().devices; ++d)
    paths.push_back(map_.striped() ? map_.devices()[d].path : path_);
  return allocator_.device_usage(paths);
}

void Pool::count(Counter c, uint64_t v) { region_.count(node_id_, c, v); }

// False while the last owner of FREE node slot `node` may still have the pool open: a node of
// this kernel keeps its slot's lock until it closes (L1), fenced or not (attach_node skips such a
// slot too). A node of another kernel cannot be asked: its FREE slot is all the evidence.
bool Pool::owner_closed(uint8_t node) {
  const NodeSlot* s = node_slot(node - 1);
  if (!lock_.lock_id || coh_.read(&s->host_id) != host_id_ || coh_.read(&s->lock_id) != lock_.lock_id)
    return true;
  if (!liveness::try_lock(lock_, lock_offset(node - 1))) return false;
  liveness::unlock(lock_, lock_offset(node - 1));
  return true;
}

// A reclaim's steps 2-4 (nodes.cpp, Attachment::reclaim_node): what dead node `node` held in the
// store, each released by its owner.
void Pool::release_of_node(uint8_t node) {
  // Index entries it was writing or evicting, and what no reclaim of a node would visit
  // (index_evict.cpp).
  index_.release_of_node(node);
  // Chunks it was carving or draining; block descs it claimed that no entry points back to
  // (allocator.cpp).
  allocator_.release_of_node(node);
  // Namespace-table lock and half-created namespaces (namespaces.cpp).
  namespaces_.release_of_node(node);
}

std::vector<uint64_t> Pool::counters() {
  std::vector<uint64_t> sum(kCounterCount, 0);
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {  // every slot: counters outlive attachments
    auto* f = node_fixed(i);
    if (i + 1 != node_id_) coh_.invalidate(f->counters, sizeof f->counters);  // others' lines only
    for (uint32_t c = 0; c < kCounterCount; ++c) sum[c] += coh_.read_hint(&f->counters[c]);
  }
  return sum;
}

}  // namespace cxlkv

namespace cxlkv {

// `pool check` of the lock area (nodes/lock_check.h; Checker::Peers): LockCheck judges, the
// façade hands it our view of the lock and our node table's row use; Checker merges the report.
// Only a multihost attachment has a lock area (a row, or a row-less observer's reading view).
bool Pool::check_lock_area(LockReport& l) {
  if (!bakery_ && !row_less_) return false;
  LockCheck(region_, attachment_.lock_view(), bakery_ ? int64_t(attachment_.host_slot()) : -1, node_id_ != 0,
            [this] { return attachment_.row_use(); })
      .run(l);
  return true;
}

// --- device transfers: the protocol is DeviceTransfers' (transfer/transfer.cpp) ---------------
void Pool::reserve(const NsHandle& ns, const Key& key, uint16_t depth, Reservation* r, bool with_block) {
  transfers_.reserve(ns, key, depth, r, with_block);
}
bool Pool::commit(const NsHandle& ns, Reservation* r) { return transfers_.commit(ns, r); }
void Pool::abort(const NsHandle& ns, Reservation* r) { transfers_.abort(ns, r); }
size_t Pool::pin_verified(const NsHandle& ns, const Key* keys, size_t n, std::vector<VerifiedBlock>* out) {
  return transfers_.pin_verified(ns, keys, n, out);
}
size_t Pool::recheck(const std::vector<VerifiedBlock>& blocks) { return transfers_.recheck(blocks); }
void Pool::unpin_verified(std::vector<VerifiedBlock>* blocks) { transfers_.unpin_verified(blocks); }
std::vector<std::pair<uint64_t, uint64_t>> Pool::transfer_ranges(uint64_t max_bytes, uint64_t page) const {
  return transfers_.transfer_ranges(max_bytes, page);
}

}  // namespace cxlkv
