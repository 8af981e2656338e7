// The coherence backend a pool was created for: a format fact (PoolHeader::backend stores its
// code, names.cpp names it), so it lives here, below the primitives (coherence.h) that act on it.
// The meaning of each backend: coherence.h, "Backends".
#pragma once
#include <cstdint>

namespace cxlkv {

enum class Backend : uint32_t { coherent = 1, flush = 2, multihost = 3 };

}  // namespace cxlkv
