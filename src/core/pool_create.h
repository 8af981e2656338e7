// The one create sequence of a pool, plain or striped (Pool::create in pool.cpp, create_striped in
// striped_pool.cpp), and the one wipe of a destroyed device's pool: every new pool appears the same
// way, so a reader never meets a half-made one (format.h "Creation": the init word is published
// last, the pool's name appears only after it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"
#include "format.h"
#include "mapping.h"

namespace cxlkv {

// Removes `<path>.init-<pid>-<rand>` files whose creator process is gone: what a creator killed
// mid-way left behind, for a single-file pool and for each device of a striped one.
void remove_stale_init_files(const std::string& path);

// The temporary names a new pool is built under: each path with one `.init-<pid>-<rand>` suffix,
// after removing the stale ones of dead creators.
std::vector<std::string> init_names(const std::vector<std::string>& paths);

// A devdax device keeps the bytes of an earlier pool: the init word is set BUSY first (a reader
// that still maps it refuses it), then the metadata below the arena is zeroed (the arena's block
// descriptors are reset when a chunk is carved). A new file is zero already.
void clear_device_metadata(char* base, const format::PoolHeader& h, Backend backend);

// Commits a new pool mapped at m: seals the header with header_checksum (its one writer), writes
// it, the stripe table (t, striped only) and the intent cap, flushes the metadata, publishes
// kInitReady (the commit word, written last), then links tmp[k] to paths[k], devices 1.. first
// and device 0 (which makes the pool exist) last. link() fails if someone else won a race for a
// name: everything of ours is removed again and OsError(errno) is thrown (EEXIST: the pool
// exists). Empty tmp: devices, nothing to link.
void commit_new_pool(Mapping& m, format::PoolHeader& h, const format::StripeTable* t,
                     uint32_t intent_permille, const std::vector<std::string>& tmp,
                     const std::vector<std::string>& paths);

// Destroying a pool on a device (which cannot be deleted): the init word cleared, the header
// zeroed and written back, so the device no longer holds a pool.
void wipe_device_pool(char* base);

}  // namespace cxlkv
