// The copy threads (copy_engine.cpp): one persistent pool shared by block batches (Pool::store,
// Pool::load) and token-row gathers (token_rows.cpp); its size is Pool::set_copy_threads /
// CXLKV_COPY_THREADS (default: the hardware threads, at most 8).
#pragma once
#include <functional>

namespace cxlkv {

unsigned copy_thread_count();
// Runs fn(part) for each part in [0, parts) on up to `parts` threads, the caller included, and
// returns when all have returned. fn must not throw.
void run_on_copy_threads(unsigned parts, const std::function<void(unsigned)>& fn);

}  // namespace cxlkv
