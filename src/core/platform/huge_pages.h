// Huge pages for the pool (issue 16): what page size a directory's filesystem can give a new
// pool file, and what page size actually backs a mapping (the kernel may fall back to 4 KiB pages
// silently: fragmentation, a tmpfs mounted huge=never, shmem_enabled=deny), read back from
// /proc/self/smaps so that what is reported is what was obtained, not what was asked for.
#pragma once
#include <cstdint>
#include <string>

namespace cxlkv {

// What backs [addr, addr + len): the bytes of every mapping (VMA) that overlaps the range.
struct PageInfo {
  uint64_t page_bytes = 0;      // the page size of most resident bytes (4096 when none are huge)
  uint64_t huge_bytes = 0;      // resident bytes mapped with huge pages (PMD-mapped or hugetlb)
  uint64_t resident_bytes = 0;  // resident bytes (Rss, or the hugetlb pages of a hugetlb VMA)
};
PageInfo page_info(const void* addr, uint64_t len);

// The huge page size a pool file created in `dir` can be given: a hugetlbfs mount's page size;
// the THP size (2 MiB on x86-64) for a tmpfs mounted huge=always|within_size|advise (we madvise)
// or when shmem_enabled=force; else 0 (4 KiB pages only). hugetlbfs: pages come only from the
// hugetlb pool, so there is no 4 KiB fallback and a pool's size must be whole pages.
struct DirPages {
  uint64_t huge_bytes = 0;
  bool hugetlbfs = false;
};
DirPages dir_huge_pages(const std::string& dir);
// The size a new pool file at `file_path` gets: `size` rounded down to whole huge pages of its
// directory's filesystem (as a devdax pool is cut to its alignment), unchanged where there are
// none. ArgumentError when that leaves nothing (smaller than one huge page).
uint64_t fit_huge_pages(const std::string& file_path, uint64_t size);
// The huge page size of the filesystem of an open file (as dir_huge_pages).
DirPages fd_huge_pages(int fd);
// The THP (PMD) size: /sys/kernel/mm/transparent_hugepage/hpage_pmd_size, else 2 MiB.
uint64_t thp_bytes();
// madvise(MADV_HUGEPAGE): asks for THP where the mount allows it; ignored where not (hugetlb VMAs,
// kernels without THP): 4 KiB pages are the silent fallback.
void advise_huge(void* p, uint64_t len);

}  // namespace cxlkv
