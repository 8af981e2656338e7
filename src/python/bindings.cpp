// nanobind module cxlkv._core: a thin layer over the C++ core. It converts Python buffers and
// arrays (buffer protocol, DLPack: numpy, torch...) into raw pieces/fragments, releases the GIL
// around every pool operation, and maps core errors to Python exceptions. No torch import.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <shared_mutex>

#include "bench.h"
#include "cpu_features.h"
#include "pool.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace cxlkv;

namespace {

// Keeps a Pool alive and serializes close() against operations running without the GIL.
struct PyPool {
  std::unique_ptr<Pool> pool;
  std::shared_mutex mu;
  Pool& get() {
    if (!pool) throw Error("pool is closed");
    pool->ensure_usable();
    return *pool;
  }
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
};

struct PyLease {
  PyPool* owner;
  std::vector<PinRef> pins;
  std::vector<nb::bytes> keys;
  ~PyLease() { release(); }
  void release() {
    if (pins.empty()) return;
    std::shared_lock<std::shared_mutex> g(owner->mu);
    if (owner->pool && !owner->pool->closed()) owner->pool->release(pins);
    pins.clear();
  }
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
  ~Buffer() { if (held) PyBuffer_Release(&view); }
  char* data() const { return static_cast<char*>(view.buf); }
  uint64_t size() const { return uint64_t(view.len); }
};

Key to_key(nb::handle obj) {
  Buffer b(obj, false);
  if (b.size() != 32)
    throw ArgumentError("keys must be exactly 32 bytes (vLLM block hashes are 32-byte digests), got " + std::to_string(b.size()));
  Key k;
  std::memcpy(k.data(), b.data(), 32);
  return k;
}

std::vector<Key> to_keys(nb::handle seq) {
  std::vector<Key> out;
  for (nb::handle h : seq) out.push_back(to_key(h));
  return out;
}

std::vector<int64_t> to_ids(nb::handle seq) {
  std::vector<int64_t> out;
  for (nb::handle h : seq) out.push_back(nb::cast<int64_t>(h));
  return out;
}

using AnyArray = nb::ndarray<nb::device::cpu>;      // writable (scatter targets)
using RoArray = nb::ndarray<nb::ro, nb::device::cpu>;  // read-only allowed (gather sources)

// Expands one array with a block dimension into fragments: every index combination of the dims
// before block_dim (C order) is one fragment; the dims after block_dim must be contiguous.
template <class Array>
void add_fragments(const Array& a, int block_dim, std::vector<Fragment>& out, int64_t* num_blocks) {
  int nd = int(a.ndim());
  if (block_dim < 0) block_dim += nd;
  if (block_dim < 0 || block_dim >= nd) throw ArgumentError("block_dim out of range for an array of " + std::to_string(nd) + " dims");
  int64_t item = int64_t(a.itemsize());
  int64_t inner = item;
  for (int d = nd - 1; d > block_dim; --d) {
    if (a.shape(d) > 1 && a.stride(d) * item != inner)
      throw ArgumentError("the dims after block_dim must be contiguous (C order)");
    inner *= int64_t(a.shape(d));
  }
  *num_blocks = std::min<int64_t>(*num_blocks, int64_t(a.shape(block_dim)));
  int64_t outer = 1;
  for (int d = 0; d < block_dim; ++d) outer *= int64_t(a.shape(d));
  std::vector<int64_t> idx(size_t(block_dim), 0);
  char* base = static_cast<char*>(const_cast<void*>(a.data()));
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off = 0;
    for (int d = 0; d < block_dim; ++d) off += idx[size_t(d)] * a.stride(d) * item;
    out.push_back(Fragment{reinterpret_cast<uintptr_t>(base + off), a.stride(block_dim) * item, uint64_t(inner)});
    for (int d = block_dim - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < int64_t(a.shape(d))) break;
      idx[size_t(d)] = 0;
    }
  }
}

std::vector<Fragment> fragments_of(nb::handle sources, int block_dim, const std::vector<int64_t>& ids, bool writable) {
  std::vector<Fragment> frags;
  int64_t nblocks = INT64_MAX;
  for (nb::handle s : sources) {
    if (writable) {
      AnyArray a;
      if (!nb::try_cast(s, a))
        throw ArgumentError("load targets must be writable CPU arrays (buffer protocol or DLPack), got " +
                            std::string(nb::str(nb::type_name(s.type())).c_str()));
      add_fragments(a, block_dim, frags, &nblocks);
    } else {
      RoArray a;
      if (!nb::try_cast(s, a))
        throw ArgumentError("store sources must be CPU arrays (buffer protocol or DLPack), got " +
                            std::string(nb::str(nb::type_name(s.type())).c_str()));
      add_fragments(a, block_dim, frags, &nblocks);
    }
  }
  if (frags.empty()) throw ArgumentError("no source arrays given");
  for (int64_t id : ids)
    if (id < 0 || id >= nblocks) throw ArgumentError("block id " + std::to_string(id) + " out of range (arrays hold " + std::to_string(nblocks) + " blocks)");
  return frags;
}

const char* backend_name(Backend b) { return b == Backend::flush ? "flush" : "coherent"; }

nb::dict info_dict(Pool& p) {
  const auto& h = p.header();
  nb::dict d;
  char uuid[40];
  std::snprintf(uuid, sizeof uuid, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                h.uuid[0], h.uuid[1], h.uuid[2], h.uuid[3], h.uuid[4], h.uuid[5], h.uuid[6], h.uuid[7],
                h.uuid[8], h.uuid[9], h.uuid[10], h.uuid[11], h.uuid[12], h.uuid[13], h.uuid[14], h.uuid[15]);
  d["path"] = p.path();
  d["uuid"] = std::string(uuid);
  d["format_version"] = std::to_string(h.major) + "." + std::to_string(h.minor);
  d["compat"] = h.compat;
  d["incompat"] = h.incompat;
  d["ro_compat"] = h.ro_compat;
  d["created_unix_ns"] = h.created_unix_ns;
  d["pool_bytes"] = h.pool_bytes;
  d["backend"] = backend_name(Backend(h.backend));
  d["max_nodes"] = h.max_nodes;
  d["pin_slots"] = h.pin_slots;
  d["max_namespaces"] = h.max_namespaces;
  d["index_slots"] = h.index_slots;
  d["chunk_bytes"] = h.chunk_bytes;
  d["chunk_count"] = h.chunk_count;
  d["node_table_off"] = h.node_table_off;
  d["node_area_off"] = h.node_area_off;
  d["node_area_bytes"] = h.node_area_bytes;
  d["ns_table_off"] = h.ns_table_off;
  d["index_off"] = h.index_off;
  d["access_off"] = h.access_off;
  d["chunk_map_off"] = h.chunk_map_off;
  d["arena_off"] = h.arena_off;
  d["header_checksum_off"] = uint64_t(offsetof(format::PoolHeader, checksum));
  d["node_id"] = p.node_id();
  d["file_dev"] = p.file_dev();  // identity of the mapped file (fstat of the mapped fd)
  d["file_ino"] = p.file_ino();
  d["read_only"] = p.read_only();
  d["nt_copy_kernel"] = nt_copy_kernel_name();
  return d;
}

const char* kCounterNames[] = {"hits", "misses", "puts", "puts_present", "puts_failed", "evictions",
                               "checksum_failures", "bytes_stored", "bytes_loaded", "deletes",
                               "reclaimed_nodes", "evict_skipped_pinned", "corrupt_entries", "condemned",
                               "pins_exhausted", "puts_in_flight"};
static_assert(sizeof(kCounterNames) / sizeof(kCounterNames[0]) == format::kCounterCount);

// Strings read from the pool are untrusted bytes: decode them without ever failing.
nb::object pool_str(const std::string& s) {
  return nb::steal(PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "replace"));
}

nb::dict layout_dict(const NsHandle& h, const Layout& l) {
  nb::dict d;
  d["id"] = h.id;
  d["name"] = pool_str(l.name);
  d["model_id"] = pool_str(l.model_id);
  d["dtype"] = pool_str(l.dtype);
  d["kind"] = l.kind == format::kLayoutMla ? "mla" : l.kind == format::kLayoutOpaque ? "opaque" : "dense";
  d["num_layers"] = l.num_layers;
  d["num_kv_heads"] = l.num_kv_heads;
  d["head_size"] = l.head_size;
  d["tokens_per_block"] = l.tokens_per_block;
  d["tp_rank"] = l.tp_rank;
  d["tp_size"] = l.tp_size;
  d["block_bytes"] = l.block_bytes;
  d["blocks_per_chunk"] = h.geo.blocks;
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "cxlkv core: a KV-cache block store in a shared-memory (CXL) pool";

  static nb::object base_error = nb::borrow(PyErr_NewException("cxlkv.CxlkvError", PyExc_Exception, nullptr));
  m.attr("CxlkvError") = base_error;
  auto make = [&](const char* name, const char* qual, nb::handle base) {
    nb::object e = nb::steal(PyErr_NewException(qual, base.ptr(), nullptr));
    m.attr(name) = e;
    return e;
  };
  static nb::object format_error = make("PoolFormatError", "cxlkv.PoolFormatError", base_error);
  static nb::object version_error = make("PoolVersionError", "cxlkv.PoolVersionError", base_error);
  static nb::object truncated_error = make("PoolTruncatedError", "cxlkv.PoolTruncatedError", base_error);
  static nb::object notready_error = make("PoolNotReadyError", "cxlkv.PoolNotReadyError", base_error);
  static nb::object corrupt_error = make("PoolCorruptError", "cxlkv.PoolCorruptError", base_error);
  static nb::object layout_error = make("LayoutMismatchError", "cxlkv.LayoutMismatchError", base_error);
  static nb::object nodefull_error = make("NodeTableFullError", "cxlkv.NodeTableFullError", base_error);
  static nb::object nsfull_error = make("NamespaceTableFullError", "cxlkv.NamespaceTableFullError", base_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    auto raise = [](const nb::object& type, const char* what) { PyErr_SetString(type.ptr(), what); };
    try {
      std::rethrow_exception(p);
    } catch (const FormatError& e) { raise(format_error, e.what());
    } catch (const VersionError& e) { raise(version_error, e.what());
    } catch (const TruncatedError& e) { raise(truncated_error, e.what());
    } catch (const NotReadyError& e) { raise(notready_error, e.what());
    } catch (const CorruptError& e) { raise(corrupt_error, e.what());
    } catch (const LayoutMismatchError& e) { raise(layout_error, e.what());
    } catch (const NodeTableFullError& e) { raise(nodefull_error, e.what());
    } catch (const NamespaceTableFullError& e) { raise(nsfull_error, e.what());
    } catch (const ArgumentError& e) { PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const OsError& e) {
      // OSError(errno, msg) becomes FileNotFoundError, PermissionError... by errno.
      PyObject* args = Py_BuildValue("(is)", e.err, e.what());
      PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
    } catch (const Error& e) { raise(base_error, e.what());
    }
  });

  nb::class_<PyPool>(m, "Pool")
      .def_static(
          "create",
          [](const std::string& path, uint64_t size, uint64_t chunk_bytes, uint64_t index_slots, uint32_t max_nodes,
             uint32_t pin_slots, uint32_t max_namespaces, const std::string& backend, bool exist_ok,
             bool allow_foreign_owner, bool allow_group) {
            CreateOptions o;
            o.allow_foreign_owner = allow_foreign_owner, o.allow_group = allow_group;
            o.size = size, o.chunk_bytes = chunk_bytes, o.index_slots = index_slots;
            o.max_nodes = max_nodes, o.pin_slots = pin_slots, o.max_namespaces = max_namespaces;
            if (backend == "coherent") o.backend = Backend::coherent;
            else if (backend == "flush") o.backend = Backend::flush;
            else throw ArgumentError("backend must be 'coherent' or 'flush'");
            auto* pp = new PyPool();
            try {
              nb::gil_scoped_release nogil;
              pp->pool = Pool::create(path, o, exist_ok);
            } catch (...) {
              delete pp;
              throw;
            }
            return pp;
          },
          "path"_a, "size"_a, "chunk_bytes"_a = 0, "index_slots"_a = 0, "max_nodes"_a = 64, "pin_slots"_a = 256,
          "max_namespaces"_a = 64, "backend"_a = "coherent", "exist_ok"_a = false, "allow_foreign_owner"_a = false,
          "allow_group"_a = false, nb::rv_policy::take_ownership)
      .def_static(
          "open",
          [](const std::string& path, bool populate, bool read_only, bool allow_foreign_owner, bool allow_group) {
            OpenOptions o;
            o.populate = populate, o.read_only = read_only;
            o.allow_foreign_owner = allow_foreign_owner, o.allow_group = allow_group;
            auto* pp = new PyPool();
            try {
              nb::gil_scoped_release nogil;
              pp->pool = Pool::open(path, o);
            } catch (...) {
              delete pp;
              throw;
            }
            return pp;
          },
          "path"_a, "populate"_a = false, "read_only"_a = false, "allow_foreign_owner"_a = false,
          "allow_group"_a = false, nb::rv_policy::take_ownership)
      .def_static("destroy", [](const std::string& path, bool ignore_attached, bool remove_invalid) {
            DestroyOptions o;
            o.ignore_attached = ignore_attached, o.remove_invalid = remove_invalid;
            Pool::destroy(path, o);
          }, "path"_a, "ignore_attached"_a = false, "remove_invalid"_a = false)
      .def("file_replaced", [](PyPool& pp) {  // usable on a truncated pool too: no ensure_usable
        std::shared_lock<std::shared_mutex> g(pp.mu);
        if (!pp.pool || pp.pool->closed()) throw Error("pool is closed");
        return pp.pool->file_replaced();
      })
      .def("close", [](PyPool& pp) {
        nb::gil_scoped_release nogil;
        std::unique_lock<std::shared_mutex> g(pp.mu);
        if (pp.pool) pp.pool->close();
      })
      .def_prop_ro("closed", [](PyPool& pp) { return !pp.pool || pp.pool->closed(); })
      .def_prop_ro("path", [](PyPool& pp) { return pp.get().path(); })
      .def_prop_ro("size", [](PyPool& pp) { return pp.get().size(); })
      .def_prop_ro("node_id", [](PyPool& pp) { return pp.get().node_id(); })
      .def_prop_ro("backend", [](PyPool& pp) { return std::string(backend_name(pp.get().backend())); })
      .def("info", [](PyPool& pp) { OpGuard g(pp); return info_dict(*g.p); })
      .def("counters", [](PyPool& pp) {
        OpGuard g(pp);
        std::vector<uint64_t> c;
        Pool::Occupancy o;
        {
          nb::gil_scoped_release nogil;
          c = g.p->counters();
          o = g.p->occupancy();
        }
        nb::dict d;
        for (uint32_t i = 0; i < format::kCounterCount; ++i) d[kCounterNames[i]] = c[i];
        d["capacity_blocks"] = o.capacity;
        d["free_blocks"] = o.free;
        d["used_blocks"] = o.used;
        d["free_chunks"] = o.free_chunks;
        d["active_chunks"] = o.active_chunks;
        return d;
      })
      .def("check", [](PyPool& pp) {
        OpGuard g(pp);
        CheckReport r;
        {
          nb::gil_scoped_release nogil;
          r = g.p->check();
        }
        nb::dict d, blocks;
        d["ok"] = r.ok;
        d["errors"] = r.errors;
        d["warnings"] = r.warnings;
        d["reclaimed_nodes"] = r.reclaimed_nodes;
        blocks["capacity"] = r.capacity_blocks;
        blocks["free"] = r.free_blocks;
        blocks["ready"] = r.ready_blocks;
        blocks["in_flight"] = r.inflight_blocks;
        blocks["leaked"] = r.leaked_blocks;
        blocks["condemned"] = r.condemned_blocks;
        d["blocks"] = blocks;
        d["stuck_entries"] = r.stuck_entries;
        d["orphan_pins"] = r.orphan_pins;
        d["duplicate_keys"] = r.duplicate_keys;
        d["free_chunks"] = r.free_chunks;
        d["active_chunks"] = r.active_chunks;
        return d;
      })
      .def("reap_dead_nodes", [](PyPool& pp) { OpGuard g(pp); nb::gil_scoped_release nogil; return g.p->reap_dead_nodes(); })
      .def(
          "open_namespace",
          [](PyPool& pp, const std::string& name, const std::string& model_id, const std::string& dtype, uint32_t dtype_bytes,
             const std::string& kind, uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_size, uint32_t tokens_per_block,
             uint32_t tp_rank, uint32_t tp_size, uint64_t block_bytes) {
            OpGuard g(pp);
            Layout l;
            l.name = name, l.model_id = model_id, l.dtype = dtype, l.dtype_bytes = dtype_bytes;
            l.kind = kind == "mla" ? format::kLayoutMla : kind == "opaque" ? format::kLayoutOpaque : format::kLayoutDense;
            if (kind != "dense" && kind != "mla" && kind != "opaque") throw ArgumentError("layout kind must be 'dense', 'mla' or 'opaque'");
            l.num_layers = num_layers, l.num_kv_heads = num_kv_heads, l.head_size = head_size;
            l.tokens_per_block = tokens_per_block, l.tp_rank = tp_rank, l.tp_size = tp_size, l.block_bytes = block_bytes;
            auto* ns = new PyNamespace{&pp, {}, l};
            try {
              nb::gil_scoped_release nogil;
              ns->h = g.p->open_namespace(l);
            } catch (...) {
              delete ns;
              throw;
            }
            return ns;
          },
          "name"_a, "model_id"_a, "dtype"_a, "dtype_bytes"_a, "kind"_a, "num_layers"_a, "num_kv_heads"_a, "head_size"_a,
          "tokens_per_block"_a, "tp_rank"_a, "tp_size"_a, "block_bytes"_a, nb::keep_alive<0, 1>(), nb::rv_policy::take_ownership)
      .def("namespaces", [](PyPool& pp) {
        OpGuard g(pp);
        nb::list out;
        for (auto& [h, l] : g.p->list_namespaces()) out.append(layout_dict(h, l));
        return out;
      });

  nb::class_<PyNamespace>(m, "Namespace")
      .def_prop_ro("id", [](PyNamespace& n) { return n.h.id; })
      .def_prop_ro("name", [](PyNamespace& n) { return pool_str(n.h.name); })
      .def_prop_ro("block_bytes", [](PyNamespace& n) { return n.h.block_bytes; })
      .def_prop_ro("blocks_per_chunk", [](PyNamespace& n) { return n.h.geo.blocks; })
      .def("put", [](PyNamespace& n, nb::handle key, nb::handle data, uint32_t depth) {
        Key k = to_key(key);
        Buffer b(data, false);
        OpGuard g(*n.owner);
        Piece p{b.data(), b.size()};
        nb::gil_scoped_release nogil;
        return g.p->put(n.h, k, &p, 1, uint16_t(std::min<uint32_t>(depth, 0xFFFF)));
      }, "key"_a, "data"_a, "depth"_a = 0)
      .def("get", [](PyNamespace& n, nb::handle key, nb::handle out) {
        Key k = to_key(key);
        Buffer b(out, true);
        OpGuard g(*n.owner);
        Piece p{b.data(), b.size()};
        nb::gil_scoped_release nogil;
        return g.p->get(n.h, k, &p, 1, nullptr);
      }, "key"_a, "out"_a)
      .def("get_bytes", [](PyNamespace& n, nb::handle key) -> nb::object {
        Key k = to_key(key);
        std::string buf(n.h.block_bytes, '\0');
        uint64_t len = 0;
        bool ok;
        {
          OpGuard g(*n.owner);
          Piece p{buf.data(), buf.size()};
          nb::gil_scoped_release nogil;
          ok = g.p->get(n.h, k, &p, 1, &len);
        }
        if (!ok) return nb::none();
        return nb::bytes(buf.data(), len);
      }, "key"_a)
      .def("contains", [](PyNamespace& n, nb::handle key) {
        Key k = to_key(key);
        OpGuard g(*n.owner);
        nb::gil_scoped_release nogil;
        return g.p->contains(n.h, k);
      }, "key"_a)
      .def("match_prefix", [](PyNamespace& n, nb::handle keys) {
        auto ks = to_keys(keys);
        OpGuard g(*n.owner);
        nb::gil_scoped_release nogil;
        return g.p->match_prefix(n.h, ks.data(), ks.size());
      }, "keys"_a)
      .def("delete", [](PyNamespace& n, nb::handle key) {
        Key k = to_key(key);
        OpGuard g(*n.owner);
        nb::gil_scoped_release nogil;
        return g.p->remove(n.h, k);
      }, "key"_a)
      .def("store", [](PyNamespace& n, nb::handle keys, nb::handle sources, nb::handle block_ids, int block_dim, uint32_t start_depth) {
        auto ks = to_keys(keys);
        auto ids = to_ids(block_ids);
        if (ids.size() != ks.size()) throw ArgumentError("keys and block_ids differ in length");
        auto frags = fragments_of(sources, block_dim, ids, false);
        OpGuard g(*n.owner);
        nb::gil_scoped_release nogil;
        return g.p->store(n.h, ks.data(), ks.size(), frags, ids.data(), start_depth);
      }, "keys"_a, "sources"_a, "block_ids"_a, "block_dim"_a = 0, "start_depth"_a = 0)
      .def("load", [](PyNamespace& n, nb::handle keys, nb::handle sources, nb::handle block_ids, int block_dim) {
        auto ks = to_keys(keys);
        auto ids = to_ids(block_ids);
        if (ids.size() != ks.size()) throw ArgumentError("keys and block_ids differ in length");
        auto frags = fragments_of(sources, block_dim, ids, true);
        OpGuard g(*n.owner);
        nb::gil_scoped_release nogil;
        return g.p->load(n.h, ks.data(), ks.size(), frags, ids.data());
      }, "keys"_a, "sources"_a, "block_ids"_a, "block_dim"_a = 0)
      .def("acquire", [](PyNamespace& n, nb::handle keys) {
        auto ks = to_keys(keys);
        auto* lease = new PyLease{n.owner, {}, {}};
        {
          OpGuard g(*n.owner);
          nb::gil_scoped_release nogil;
          lease->pins = g.p->acquire(n.h, ks.data(), ks.size());
        }
        size_t i = 0;
        for (nb::handle h : keys) {
          if (i++ >= lease->pins.size()) break;
          lease->keys.push_back(nb::borrow<nb::bytes>(nb::bytes(Buffer(h, false).data(), 32)));
        }
        return lease;
      }, "keys"_a, nb::keep_alive<0, 1>(), nb::rv_policy::take_ownership)
      .def("bench_index", [](PyNamespace& n, uint64_t inserts, uint64_t lookups, uint64_t payload_bytes, uint64_t seed, double seconds) {
        OpGuard g(*n.owner);
        IndexBenchResult r;
        {
          nb::gil_scoped_release nogil;
          r = bench_index(*g.p, n.h, inserts, lookups, payload_bytes, seed, seconds);
        }
        nb::dict d;
        d["inserts"] = r.inserts;
        d["lookups"] = r.lookups;
        d["lookup_p50_ns"] = r.lookup_p50_ns;
        d["lookup_p99_ns"] = r.lookup_p99_ns;
        d["lookup_mean_ns"] = r.lookup_mean_ns;
        d["insert_p50_ns"] = r.insert_p50_ns;
        d["insert_p99_ns"] = r.insert_p99_ns;
        d["lookups_per_s"] = r.lookups_per_s;
        d["inserts_per_s"] = r.inserts_per_s;
        return d;
      }, "inserts"_a, "lookups"_a, "payload_bytes"_a = 64, "seed"_a = 1, "seconds"_a = 1.0,
      "Core-side index benchmark (timed in C++): inserts fresh keys, then looks them up.");

  nb::class_<PyLease>(m, "Lease")
      .def("release", &PyLease::release)
      .def("__len__", [](PyLease& l) { return l.pins.size(); })
      .def_prop_ro("keys", [](PyLease& l) { return l.keys; })
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyLease& l, nb::args) { l.release(); });

  m.def("nt_copy_kernel", [] { return std::string(nt_copy_kernel_name()); });
  m.def("set_copy_threads", [](unsigned n) { Pool::set_copy_threads(n); }, "n"_a);
  m.def("xxh3_64", [](nb::bytes b) { return xxh3(b.c_str(), b.size(), 0); });
}
