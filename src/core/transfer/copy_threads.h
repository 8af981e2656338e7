// The copy engine (copy_engine.cpp): batches of blocks gathered into the pool and scattered back
// (Pool::store, Pool::load hand in the index's put and get), and the copy threads, one persistent
// pool shared by those batches and token-row gathers (token_rows.cpp); its size is
// set_copy_threads / CXLKV_COPY_THREADS (default: the hardware threads, at most 8).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "store_types.h"

namespace cxlkv {

// One block in or out of the pool: the index's put (key, its payload pieces, chain depth) -> key
// readable afterwards, and get (key, target pieces, *length) -> the whole payload was read.
using PutBlock = std::function<bool(const Key&, const Piece*, size_t, uint16_t)>;
using GetBlock = std::function<bool(const Key&, const Piece*, size_t, uint64_t*)>;
// Gathers, for key i, the fragments at block id block_ids[i] into one pool block (depth of key i in
// its chain = start_depth + i); returns the number of leading keys readable afterwards.
size_t store_blocks(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
                    const int64_t* block_ids, uint32_t start_depth, const PutBlock& put);
// Scatters blocks back; returns the number of leading keys loaded whole (ns.block_bytes each).
size_t load_blocks(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
                   const int64_t* block_ids, const GetBlock& get);

void set_copy_threads(unsigned n);
unsigned copy_thread_count();
// Runs fn(part) for each part in [0, parts) on up to `parts` threads, the caller included, and
// returns when all have returned. fn must not throw.
void run_on_copy_threads(unsigned parts, const std::function<void(unsigned)>& fn);

}  // namespace cxlkv
