// What the binding files (bindings.cpp, bindings_<topic>.cpp) share: the Python-side pool and
// namespace objects and the conversion of keys. One definition, included by each.
#pragma once
#include <nanobind/nanobind.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "pool.h"

namespace cxlkv::bindings {

namespace nb = nanobind;

// Views of the pool bytes handed to a device path (bindings_transfer.cpp) keep the mapping alive
// past close(): close() moves it here, and the last view's release unmaps it.
struct MappingAnchor {
  Mapping mapping;
};

// Keeps a Pool alive and serializes close() against operations running without the GIL.
// Lock order with the GIL: `mu` is taken exclusively only with the GIL released (close,
// transfer_view), and no exclusive holder takes the GIL. A shared holder (OpGuard) may wait for
// the GIL at the end of its call (its gil_scoped_release ends inside the guard's scope), so a
// thread that held the GIL while waiting for `mu` exclusively would deadlock with it.
struct PyPool {
  std::unique_ptr<Pool> pool;
  std::shared_mutex mu;
  std::weak_ptr<MappingAnchor> views;  // set while views of the pool bytes exist
  Pool& get() {
    if (!pool) throw ClosedError("pool is closed");
    pool->ensure_usable();
    return *pool;
  }
  // Closes the pool; while views of its bytes exist, their anchor keeps the mapping (caller
  // holds mu exclusively, or is the destructor).
  void close_pool() {
    if (!pool) return;
    if (auto a = views.lock())
      a->mapping = pool->take_mapping_on_close();
    else
      pool->close();
  }
  ~PyPool() { close_pool(); }
};

struct OpGuard {
  std::shared_lock<std::shared_mutex> lock;
  Pool* p;
  explicit OpGuard(PyPool& pp) : lock(pp.mu), p(&pp.get()) {}
};

struct PyNamespace {
  PyPool* owner;
  NsHandle h;
  Layout layout;
  std::string tenant;  // quota label (NsHandle::tenant_row is its row); empty = none
};

// A contiguous Python buffer (bytes, bytearray, memoryview, numpy array...).
struct Buffer {
  Py_buffer view{};
  bool held = false;
  Buffer(nb::handle obj, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw nb::python_error();
    held = true;
  }
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
  char* data() const { return static_cast<char*>(view.buf); }
  uint64_t size() const { return uint64_t(view.len); }
};

inline Key to_key(nb::handle obj) {
  Buffer b(obj, false);
  if (b.size() != 32)
    throw ArgumentError("keys must be exactly 32 bytes (vLLM block hashes are 32-byte digests), got " +
                        std::to_string(b.size()));
  Key k;
  std::memcpy(k.data(), b.data(), 32);
  return k;
}

inline std::vector<Key> to_keys(nb::handle seq) {
  std::vector<Key> out;
  for (nb::handle h : seq) out.push_back(to_key(h));
  return out;
}

}  // namespace cxlkv::bindings
