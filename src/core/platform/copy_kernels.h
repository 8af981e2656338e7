// Copy and cache-line kernels behind the coherence layer. Each has several implementations picked
// at run time from cpu_features(); all of them are correct for any alignment and length.
#pragma once
#include <cstddef>

namespace cxlkv::kernels {

// Copy with streaming (non-temporal) stores: the destination lines do not stay in this CPU's
// cache, which on CXL both saves a write-back and makes the payload visible to other hosts once
// store_fence() returns. No fence inside: batch many copies, then call store_fence() once.
void stream_copy(void* dst, const void* src, size_t n);
// Orders all earlier streaming stores before later stores (sfence on x86).
void store_fence();
// Full fence: orders earlier stores before later loads (mfence on x86).
void full_fence();
// Write back the cache lines covering [p, p+n) (clwb > clflushopt > clflush). Ends with a fence.
void writeback_lines(const void* p, size_t n);
// The same without the fence: a batch of write-backs, then one store_fence() (RPC, rpc.h).
void writeback_lines_nofence(const void* p, size_t n);
// Write back and drop the lines covering [p, p+n), so the next load reads memory (clflushopt >
// clflush). Ends with a fence.
void evict_lines(const void* p, size_t n);
// Write back and drop with clflush, which completes the eviction before it retires, then mfence.
// The multihost backend's choice for metadata (TraCT §3.4: clflushopt + mfence let another host
// read an old value after a lock release).
void flush_lines_sync(const void* p, size_t n);

}  // namespace cxlkv::kernels
