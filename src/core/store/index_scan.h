// Index scan: the READY entries of a range of index slots, each read as a seqlock snapshot
// (index_scan.cpp). Read-only over the region: it never claims, pins or touches an entry.
#pragma once
#include <cstdint>
#include <vector>

#include "region.h"
#include "store_types.h"

namespace cxlkv {

// The READY entries of slots [first, first + count) (clamped to the table). Entries that stay in
// flight across a few re-reads go to `unstable` (their slot), so a caller diffing two scans keeps
// what it knew of them instead of reading them as gone.
std::vector<IndexRecord> scan_index(const Region& region, uint64_t first, uint64_t count,
                                    std::vector<uint64_t>* unstable);

}  // namespace cxlkv
