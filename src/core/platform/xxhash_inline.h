// The one way the core includes xxHash: the vendored, unmodified header (third_party/xxhash,
// v0.8.2) compiled inline into each user, so that no system libxxhash or xxhash.h is needed.
// XXH_STATIC_LINKING_ONLY exposes XXH3_generateSecret_fromSeed (checksum_kernels.cpp).
#pragma once
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#ifndef XXH_STATIC_LINKING_ONLY
#define XXH_STATIC_LINKING_ONLY
#endif
#include "../../../third_party/xxhash/xxhash.h"  // by path: never a system copy
