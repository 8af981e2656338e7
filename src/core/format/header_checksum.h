// The pool header's checksum: the one formula, for its one writer (commit_new_pool, pool_create.cpp:
// plain and striped pools) and its one validator (Region::check_header: adopt, and the striped
// opener before it maps a stripe). It covers the header up to, not
// including, the checksum field (format.h: PoolHeader).
#pragma once
#include <cstddef>
#include <cstdint>

#include "checksum.h"
#include "format.h"

namespace cxlkv::format {

inline uint64_t header_checksum(const PoolHeader& h) { return xxh3(&h, offsetof(PoolHeader, checksum)); }

}  // namespace cxlkv::format
