#include "huge_pages.h"

#include <linux/magic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "errors.h"

namespace cxlkv {

uint64_t thp_bytes() {
  static const uint64_t v = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    uint64_t b = 0;
    return (f >> b) && b > 4096 && (b & (b - 1)) == 0 ? b : uint64_t(2) << 20;
  }();
  return v;
}

void advise_huge(void* p, uint64_t len) {
#ifdef MADV_HUGEPAGE
  (void)::madvise(p, len, MADV_HUGEPAGE);  // EINVAL on hugetlb VMAs or without THP: nothing to do
#else
  (void)p, (void)len;
#endif
}

namespace {
std::string read_word(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

// The selected value of a sysfs list such as "always within_size advise [never] deny force".
std::string selected(const std::string& line) {
  size_t a = line.find('['), b = line.find(']');
  return a == std::string::npos || b == std::string::npos || b < a ? line : line.substr(a + 1, b - a - 1);
}

// The huge= option of the tmpfs mount that holds `real` (a resolved path): the mount whose mount
// point is the longest prefix of it in /proc/self/mountinfo ("never" when absent).
std::string tmpfs_huge_option(const std::string& real) {
  std::ifstream f("/proc/self/mountinfo");
  std::string line, best_opt = "never";
  size_t best_len = 0;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string id, parent, devno, root, point, opts, tok;
    if (!(in >> id >> parent >> devno >> root >> point >> opts)) continue;
    while (in >> tok && tok != "-") {
    }
    std::string fstype, source, super;
    if (!(in >> fstype >> source >> super)) continue;
    bool under = real == point || point == "/" ||
                 (real.compare(0, point.size(), point) == 0 && real.size() > point.size() &&
                  real[point.size()] == '/');
    if (!under || point.size() < best_len) continue;
    best_len = point.size();
    best_opt = "never";
    if (fstype != "tmpfs") continue;
    std::istringstream so(super);
    std::string o;
    while (std::getline(so, o, ','))
      if (o.rfind("huge=", 0) == 0) best_opt = o.substr(5);
  }
  return best_opt;
}

DirPages from_statfs(const struct statfs& st, const std::string& real) {
  DirPages d;
  if (st.f_type == HUGETLBFS_MAGIC) {
    d.hugetlbfs = true;
    d.huge_bytes = uint64_t(st.f_bsize);
    return d;
  }
  if (st.f_type != TMPFS_MAGIC) return d;
  const std::string global = selected(read_word("/sys/kernel/mm/transparent_hugepage/shmem_enabled"));
  if (global == "deny") return d;
  if (global == "force") {
    d.huge_bytes = thp_bytes();
    return d;
  }
  if (real.empty()) return d;
  const std::string h = tmpfs_huge_option(real);
  if (h == "always" || h == "within_size" || h == "advise") d.huge_bytes = thp_bytes();
  return d;
}
}  // namespace

DirPages dir_huge_pages(const std::string& dir) {
  struct statfs st;
  if (::statfs(dir.c_str(), &st) != 0) return {};
  char* r = ::realpath(dir.c_str(), nullptr);
  std::string real = r ? r : "";
  ::free(r);
  return from_statfs(st, real);
}

uint64_t fit_huge_pages(const std::string& file_path, uint64_t size) {
  size_t slash = file_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : file_path.substr(0, slash);
  const DirPages dp = dir_huge_pages(dir);
  if (!dp.huge_bytes) return size;
  if (size < dp.huge_bytes)
    throw ArgumentError("pool size " + std::to_string(size) + " is smaller than one " +
                        std::to_string(dp.huge_bytes >> 10) + " KiB huge page of " +
                        (dp.hugetlbfs ? "the hugetlbfs " : "the tmpfs ") + dir);
  return size / dp.huge_bytes * dp.huge_bytes;
}

DirPages fd_huge_pages(int fd) {
  struct statfs st;
  if (::fstatfs(fd, &st) != 0) return {};
  char link[64], buf[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = ::readlink(link, buf, sizeof buf - 1);
  std::string real = n > 0 ? std::string(buf, size_t(n)) : "";
  if (auto slash = real.rfind('/'); slash != std::string::npos) real.resize(slash ? slash : 1);
  return from_statfs(st, real);
}

namespace {
// "start-end ..." (hex addresses) versus "Key: value kB".
bool is_vma_header(const std::string& line) {
  size_t sp = line.find(' ');
  if (sp == std::string::npos || sp == 0) return false;
  bool dash = false;
  for (size_t i = 0; i < sp; ++i) {
    char c = line[i];
    if (c == '-')
      dash = true;
    else if (!std::isxdigit(static_cast<unsigned char>(c)))
      return false;
  }
  return dash;
}
}  // namespace

// /proc/self/smaps: a header line "start-end perms offset dev inode [path]" per VMA, then
// "Key: value kB" lines. The range's VMAs are summed (a VMA partly in the range counts whole).
PageInfo page_info(const void* addr, uint64_t len) {
  const uint64_t base_page = uint64_t(::sysconf(_SC_PAGESIZE));
  PageInfo r;
  r.page_bytes = base_page;
  if (!addr || !len) return r;
  const uint64_t lo = reinterpret_cast<uintptr_t>(addr), hi = lo + len;
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool in = false;
  uint64_t kernel_page = 0, rss = 0, pmd = 0, hugetlb = 0, max_big_page = 0;
  auto close_vma = [&] {
    if (!in) return;
    if (kernel_page > base_page) {  // hugetlbfs (or devdax): every page of the VMA is that size
      r.resident_bytes += hugetlb ? hugetlb : rss;
      r.huge_bytes += hugetlb ? hugetlb : rss;
      max_big_page = std::max(max_big_page, kernel_page);
    } else {
      r.resident_bytes += rss;
      r.huge_bytes += pmd;
    }
  };
  while (std::getline(f, line)) {
    if (is_vma_header(line)) {
      close_vma();
      uint64_t a = 0, b = 0;
      char dash = 0;
      std::istringstream hs(line);
      hs >> std::hex >> a >> dash >> b;
      in = hs && dash == '-' && a < hi && b > lo;
      kernel_page = rss = pmd = hugetlb = 0;
      continue;
    }
    if (!in) continue;
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    uint64_t kb = std::strtoull(line.c_str() + colon + 1, nullptr, 10);
    if (key == "KernelPageSize")
      kernel_page = kb * 1024;
    else if (key == "Rss")
      rss = kb * 1024;
    else if (key == "AnonHugePages" || key == "ShmemPmdMapped" || key == "FilePmdMapped")
      pmd += kb * 1024;
    else if (key == "Shared_Hugetlb" || key == "Private_Hugetlb")
      hugetlb += kb * 1024;
  }
  close_vma();
  if (max_big_page)
    r.page_bytes = max_big_page;
  else if (r.huge_bytes && 2 * r.huge_bytes >= r.resident_bytes)
    r.page_bytes = thp_bytes();
  return r;
}

}  // namespace cxlkv
