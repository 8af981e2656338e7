// Python bindings of the platform layer beyond the pool: the page-size read-back (huge_pages.h;
// `bench copy` reports what backs its memcpy baselines' buffers with the code that reports the
// pool's pages) and the hashes, so that tests can hold them against the `xxhash` PyPI package.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "checksum.h"

#include "huge_pages.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_platform(nb::module_& m) {
  m.def(
      "page_info",
      [](uintptr_t addr, uint64_t nbytes) {
        const cxlkv::PageInfo p = cxlkv::page_info(reinterpret_cast<const void*>(addr), nbytes);
        nb::dict d;
        d["page_bytes"] = p.page_bytes;
        d["huge_page_resident_bytes"] = p.huge_bytes;
        d["resident_bytes"] = p.resident_bytes;
        return d;
      },
      "addr"_a, "nbytes"_a,
      "The page size backing the mappings that overlap [addr, addr + nbytes), as the kernel "
      "reports it (/proc/self/smaps): page_bytes of most resident bytes, and the byte counts.");
  m.def(
      "dir_huge_page_bytes", [](const std::string& dir) { return cxlkv::dir_huge_pages(dir).huge_bytes; },
      "dir"_a, "The huge page size a pool file created in dir can get (0: 4 KiB pages only).");
  m.def(
      "xxh3_64_seeded", [](nb::bytes b, uint64_t seed) { return cxlkv::xxh3(b.c_str(), b.size(), seed); },
      "data"_a, "seed"_a, "XXH3-64 with a seed (index keys, liveness tokens): the vendored xxHash.");
  m.def(
      "block_checksum",
      [](nb::bytes b, size_t piece, bool copy) {
        // The on-pool block checksum: the streaming Checksum fed in pieces of `piece` bytes, with
        // update_copy (the copy kernels' path) or update.
        cxlkv::Checksum c;
        std::vector<char> dst(b.size() + 64);
        const char* s = b.c_str();
        for (size_t off = 0, n = b.size(); off < n;) {
          size_t k = std::min(piece ? piece : n, n - off);
          if (copy)
            c.update_copy(dst.data() + 1 + off, s + off, k);  // +1: a misaligned destination
          else
            c.update(s + off, k);
          off += k;
        }
        return c.digest();
      },
      "data"_a, "piece"_a = 0, "copy"_a = true,
      "XXH3-64 of data by the pool's streaming block checksum (bit-identical with XXH3_64bits).");
}
