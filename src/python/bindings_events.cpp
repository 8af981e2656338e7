// Python binding of the index scan (`cxlkv events`, `cxlkv query`): Pool.scan_index.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "pool.h"

namespace nb = nanobind;

// Packed records, little-endian, kScanRecordBytes each: slot u64 | gen u32 | ns_id u32 |
// depth u16 | 6 zero bytes | key 32 bytes. One bytes object instead of a tuple per entry: an index
// holds millions of slots, and the caller parses it with one numpy view.
constexpr size_t kScanRecordBytes = 56;

nb::tuple scan_index_py(cxlkv::Pool& pool, uint64_t first, uint64_t count) {
  std::vector<cxlkv::IndexRecord> recs;
  std::vector<uint64_t> unstable;
  {
    nb::gil_scoped_release nogil;
    recs = pool.scan_index(first, count, &unstable);
  }
  std::string buf(recs.size() * kScanRecordBytes, '\0');
  char* p = buf.data();
  for (const auto& r : recs) {
    std::memcpy(p, &r.slot, 8);
    std::memcpy(p + 8, &r.gen, 4);
    std::memcpy(p + 12, &r.ns_id, 4);
    std::memcpy(p + 16, &r.depth, 2);
    std::memcpy(p + 24, r.key, 32);
    p += kScanRecordBytes;
  }
  return nb::make_tuple(nb::bytes(buf.data(), buf.size()), unstable);
}
