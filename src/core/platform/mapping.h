// Mapping of the pool's backing store: a regular file (default under /dev/shm) or a CXL devdax
// character device (/dev/daxX.Y), mapped MAP_SHARED. Devdax needs its mapping address aligned to
// the device alignment (2 MiB by default), which mmap does not guarantee, so we over-reserve and
// place the mapping on an aligned address.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "huge_pages.h"
#include "striping.h"

struct stat;

namespace cxlkv {

// One device of a striped pool as mapped: its identity, the bytes it must keep, and a descriptor
// kept open to notice it shrinking (Pool::mapping_intact).
struct MappedDevice {
  std::string path;
  uint64_t dev = 0, ino = 0;
  bool devdax = false;
  uint64_t need_bytes = 0;
  int fd = -1;
};

class Mapping {
 public:
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept { *this = std::move(o); }
  Mapping& operator=(Mapping&& o) noexcept;
  ~Mapping();

  // Maps an existing pool store. Throws OsError (errno kept) or TruncatedError. populate: fault
  // the whole mapping in now (MAP_POPULATE) instead of page by page in the copy path.
  // Owner policy (F11): the file must be owned by the effective uid or root (or, with allow_group,
  // by one of our groups) and not writable by others, unless allow_foreign_owner. Never follows a
  // symlink (O_NOFOLLOW). read_only: O_RDONLY and a private mapping (writes stay in this process).
  // min_bytes: the smallest file or device that can hold what the caller maps (the pool format's
  // header pages: the mapper knows nothing of pools); anything smaller is TruncatedError.
  static Mapping open_existing(const std::string& path, uint64_t min_bytes, bool populate = false,
                               bool read_only = false, bool allow_foreign_owner = true,
                               bool allow_group = false);
  // Creates a new file of `size` bytes at `tmp_path`, mode 0600 (exclusive create). Its pages are
  // allocated and zeroed here (on tmpfs, zeroing otherwise happens at first touch, inside the
  // first store to each block: measured 4-30x slower stores on a fresh pool), as huge pages where
  // the filesystem gives them (huge_pages.h); on hugetlbfs `size` must be whole huge pages.
  // Every file mapping (here and in open_existing) starts on a huge-page boundary.
  static Mapping create_file(const std::string& tmp_path, uint64_t size);
  // Maps a devdax device for creation (its whole size, or `size` if smaller).
  static Mapping open_devdax_for_create(const std::string& path, uint64_t size);

  // Striped ranges (striped_mapping.cpp). The range is one contiguous mapping: stripe i is mapped
  // with MAP_FIXED from device i % N at its device offset, one mmap per stripe (neighbouring
  // stripes are on different devices, so no two merge): pool_bytes / stripe maps, checked against
  // vm.max_map_count first. The mapper only maps: what the devices say about the pool (header,
  // stripe table, labels) is validated by the caller (striped_pool.cpp) from read_device_head
  // before it hands a geometry to map_striped, and by Region::adopt after.
  //
  // Opens every device (open_existing's rules: no symbolic link, the owner policy; no file named
  // twice) and maps nothing yet.
  static Mapping open_devices(const std::vector<std::string>& paths, bool read_only, bool allow_foreign_owner,
                              bool allow_group);
  // Copies the first n bytes of device k (a short file reads as zeros past its end).
  void read_device_head(uint32_t k, void* out, size_t n) const;
  // Maps the opened devices as one range of pool_bytes striped by g; need[k]: the bytes device k
  // must have (TruncatedError when it has fewer; FormatError for a devdax device and stripes that
  // are not 2 MiB aligned). private_copy: MAP_PRIVATE (read-only inspection). Closes the devices
  // on failure.
  void map_striped(const StripeGeometry& g, uint64_t pool_bytes, const std::vector<uint64_t>& need,
                   bool populate, bool private_copy);
  // Creates (exclusively, mode 0600) and allocates one file per device at tmp_paths, need[k]
  // bytes each (a devdax path is opened instead and must have them), and maps the range
  // (zero-filled for files). Removes what it created on failure.
  static Mapping create_striped(const std::vector<std::string>& tmp_paths, const StripeGeometry& g,
                                const std::vector<uint64_t>& need, uint64_t pool_bytes);
  // Writes n bytes at offset 0 of device k, outside the mapped range (a device label), the first
  // zero_bytes cleared first on devdax (a new file is zero already).
  void write_device_head(uint32_t k, const void* bytes, size_t n, uint64_t zero_bytes);
  bool striped() const { return geo_.striped(); }
  const StripeGeometry& stripes() const { return geo_; }
  const std::vector<MappedDevice>& devices() const { return devices_; }
  // After the creator linked the device files to their final names (identity is unchanged).
  void set_device_paths(const std::vector<std::string>& paths) {
    for (size_t k = 0; k < devices_.size() && k < paths.size(); ++k) devices_[k].path = paths[k];
  }

  static bool is_devdax_path(const std::string& path);
  char* base() const { return base_; }
  uint64_t size() const { return size_; }
  bool devdax() const { return devdax_; }
  uint64_t file_dev() const { return dev_; }
  uint64_t file_ino() const { return ino_; }
  // F14: a SIGBUS inside a registered mapping (the file shrank under us) is answered by mapping
  // zero pages over the rest of the mapping and setting this flag; the access then reads zeros.
  bool truncated() const;
  // The page size actually backing the mapping, read back from the kernel (huge_pages.h).
  PageInfo page_info() const;

 private:
  char* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t map_len_ = 0;
  bool devdax_ = false;
  uint64_t dev_ = 0, ino_ = 0;
  int guard_ = -1;                     // slot in the process-wide SIGBUS registry, -1 if none
  StripeGeometry geo_{};               // devices == 1: a single-device mapping
  std::vector<MappedDevice> devices_;  // striped only, device 0 first
  void close_devices();
  void guard();    // registers [base_, base_ + map_len_) with the SIGBUS handler
  void release();  // unregisters and unmaps
};

// Size of a devdax device from sysfs (/sys/dev/char/MAJ:MIN/size). Throws OsError.
uint64_t devdax_size(const std::string& path);

namespace mapping_detail {
// F11 owner policy of open_existing, shared with open_striped: throws OsError(EPERM).
void check_owner(const struct stat& st, const std::string& path, bool allow_group);
}  // namespace mapping_detail

}  // namespace cxlkv
