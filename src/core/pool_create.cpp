// The one create sequence of a pool (pool_create.h), shared by plain and striped pools.
#include "pool_create.h"

#include <dirent.h>
#include <signal.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "coherence.h"
#include "copy_kernels.h"
#include "errors.h"
#include "header_checksum.h"

namespace cxlkv {

using namespace format;

void remove_stale_init_files(const std::string& path) {
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, slash ? slash : 1);
  std::string prefix = (slash == std::string::npos ? path : path.substr(slash + 1)) + ".init-";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid <= 0 || (::kill(pid_t(pid), 0) == 0 || errno != ESRCH)) continue;
    ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

std::vector<std::string> init_names(const std::vector<std::string>& paths) {
  for (auto& p : paths) remove_stale_init_files(p);
  uint8_t r[4];
  (void)::getrandom(r, sizeof r, 0);
  char suffix[64];
  std::snprintf(suffix, sizeof suffix, ".init-%d-%02x%02x%02x%02x", int(::getpid()), r[0], r[1], r[2], r[3]);
  std::vector<std::string> tmp = paths;
  for (auto& p : tmp) p += suffix;
  return tmp;
}

void clear_device_metadata(char* base, const PoolHeader& h, Backend backend) {
  Coherence c(backend);
  auto* sw = reinterpret_cast<SharedWords*>(base + kSharedWordsOff);
  c.publish(&sw->init.word, kInitBusy);
  std::memset(base, 0, kSharedWordsOff);
  std::memset(base + kSharedWordsOff + kCacheLine, 0, h.arena_off - kSharedWordsOff - kCacheLine);
}

void commit_new_pool(Mapping& m, PoolHeader& h, const StripeTable* t, uint32_t intent_permille,
                     const std::vector<std::string>& tmp, const std::vector<std::string>& paths) {
  auto undo = [&](const std::vector<std::string>& linked) {
    for (auto& p : linked) ::unlink(p.c_str());
    for (auto& p : tmp) ::unlink(p.c_str());
  };
  try {
    h.checksum = header_checksum(h);
    std::memcpy(m.base(), &h, sizeof h);
    if (t) std::memcpy(m.base() + kStripeTableOff, t, sizeof *t);
    auto* sw = reinterpret_cast<SharedWords*>(m.base() + kSharedWordsOff);
    sw->init.pad[kInitIntentCap] = intent_cap_of(h.index_slots, intent_permille);  // flushed below
    Coherence c(Backend(h.backend));
    c.flush(m.base(), h.arena_off);
    c.publish(&sw->init.word, kInitReady);  // commit word, written last
  } catch (...) {
    undo({});
    throw;
  }
  if (tmp.empty()) return;
  std::vector<std::string> linked;
  for (size_t i = 0; i < paths.size(); ++i) {
    size_t k = (i + 1) % paths.size();
    if (::link(tmp[k].c_str(), paths[k].c_str()) != 0) {
      int e = errno;
      undo(linked);
      if (e == EEXIST && k == 0) throw OsError(e, "pool " + paths[0] + " already exists");
      throw OsError(e, std::string("cannot create pool ") + (paths.size() > 1 ? "device " : "") + paths[k] +
                           ": " + std::strerror(e));
    }
    linked.push_back(paths[k]);
  }
  for (auto& p : tmp) ::unlink(p.c_str());
  m.set_device_paths(paths);
}

void wipe_device_pool(char* base) {
  Coherence c;
  auto* sw = reinterpret_cast<SharedWords*>(base + kSharedWordsOff);
  c.publish(&sw->init.word, 0);
  std::memset(base, 0, kHeaderBytes);
  kernels::writeback_lines(base, kHeaderBytes);
}

}  // namespace cxlkv
