// The pool header's checksum: the one formula for every writer (Pool::create, the striped create)
// and every validator (Region::adopt, the striped mapper). It covers the header up to, not
// including, the checksum field (format.h: PoolHeader).
#pragma once
#include <cstddef>
#include <cstdint>

#include "checksum.h"
#include "format.h"

namespace cxlkv::format {

inline uint64_t header_checksum(const PoolHeader& h) { return xxh3(&h, offsetof(PoolHeader, checksum)); }

}  // namespace cxlkv::format
