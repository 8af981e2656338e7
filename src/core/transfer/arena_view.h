// ArenaView: the pool's arena as three plain values, for loops that turn offsets a caller kept into
// pool bytes once per row (token_rows.cpp's gather). A copy of the bounds, taken once per call
// (Pool::arena_view), so the hot loop pays two compares per row and no call; the Pool must stay
// open while it is used (the bindings' operation guard holds close() off, as for every call).
#pragma once
#include <cstdint>

namespace cxlkv {

struct ArenaView {
  const char* base = nullptr;   // the mapped pool (null: closed; every lookup fails)
  uint64_t start = 0, end = 0;  // the arena: [arena_off, arena_off + chunk_count * chunk_stride)

  // The pool bytes [offset, offset + length) if they lie wholly inside the arena, else null (the
  // offsets are a caller's, the bytes payload: unvalidated).
  const char* bytes(uint64_t offset, uint64_t length) const {
    if (offset < start || offset > end || length > end - offset) return nullptr;
    return base + offset;
  }
};

}  // namespace cxlkv
