// What bindings_tokens.cpp (the token store's row gathers) needs of a Python Namespace object:
// its pool, held usable for the call (close() waits on the lock), and its handle.
#pragma once
#include <nanobind/nanobind.h>

#include <shared_mutex>

#include "pool.h"

struct NsAccess {
  std::shared_lock<std::shared_mutex> lock;
  cxlkv::Pool* pool;
  cxlkv::NsHandle ns;
};
using NsAccessFn = NsAccess (*)(nanobind::handle ns);

void bind_tokens(nanobind::module_& m, NsAccessFn access);
