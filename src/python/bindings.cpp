// nanobind module cxlkv._core: a thin layer over the C++ core. It converts Python buffers and
// arrays (buffer protocol, DLPack: numpy, torch...) into raw pieces/fragments, releases the GIL
// around every pool operation, and maps core errors to Python exceptions. No torch import.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <shared_mutex>

#include "bench.h"
#include "bindings_tokens.h"
#include "bindings_types.h"
#include "checksum.h"
#include "copy_threads.h"
#include "cpu_features.h"
#include "dtype.h"
#include "layout.h"
#include "names.h"
#include "pool.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace cxlkv;
using namespace cxlkv::bindings;

namespace {

// Pool creation's defaults: the core's CreateOptions, the one place they are written.
const CreateOptions kCreateDefaults{};

// A node id from Python: any int. One that does not even fit the core's type is out of the
// pool's range like any other (ValueError naming the range), not an overflow TypeError.
uint32_t node_arg(const nb::int_& node, const Pool& p) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(node.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow || v < 1 || v > int64_t(p.header().max_nodes))
    throw ArgumentError("node " + std::string(nb::str(node).c_str()) + " out of range 1.." +
                        std::to_string(p.header().max_nodes));
  return uint32_t(v);
}

struct PyLease {
  PyPool* owner;
  std::vector<PinRef> pins;
  std::vector<nb::bytes> keys;
  ~PyLease() { release(); }
  // Drops the pins, in the process that took them only: a child that inherited this lease through
  // fork() shares the parent's node area, and unpinning there would free the parent's blocks
  // (whether the child calls release() or its interpreter finalizes the lease on exit).
  void release() {
    if (pins.empty()) return;
    std::shared_lock<std::shared_mutex> g(owner->mu);
    if (owner->pool && usable_here(*owner->pool)) owner->pool->release(pins);
    pins.clear();
  }
  static bool usable_here(const Pool& p) {
    try {
      p.ensure_usable();  // throws when closed or inherited through fork()
      return true;
    } catch (const Error&) {
      return false;
    }
  }
};

std::string py_type_name(nb::handle h) { return nb::str(nb::type_name(h.type())).c_str(); }

// str(obj) as UTF-8, embedded NULs included (a NUL must fail a name lookup, not cut the name).
std::string str_of(nb::handle obj) {
  nb::str s = nb::str(obj);
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
  if (!p) throw nb::python_error();
  return std::string(p, size_t(n));
}

// An exact integer: a Python int or an object with __index__ (numpy integers); never a bool, a
// float, None or a str (TypeError naming `what`).
nb::object exact_int(nb::handle h, const std::string& what) {
  if (PyBool_Check(h.ptr())) throw nb::type_error((what + " must be an integer, not bool").c_str());
  PyObject* r = PyNumber_Index(h.ptr());
  if (!r) {
    PyErr_Clear();
    throw nb::type_error((what + " must be an integer, not " + py_type_name(h)).c_str());
  }
  return nb::steal(r);
}

// block_ids, read once: integers in int64 range (the range against the arrays is checked later).
std::vector<int64_t> to_ids(nb::handle seq) {
  std::vector<int64_t> out;
  size_t i = 0;
  for (nb::handle h : seq) {
    nb::object v = exact_int(h, "block_ids[" + std::to_string(i) + "]");
    int overflow = 0;
    long long id = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow)
      throw ArgumentError("block id " + std::string(nb::str(v).c_str()) + " at position " +
                          std::to_string(i) + " out of range");
    out.push_back(int64_t(id));
    ++i;
  }
  return out;
}

using AnyArray = nb::ndarray<nb::device::cpu>;         // writable (scatter targets)
using RoArray = nb::ndarray<nb::ro, nb::device::cpu>;  // read-only allowed (gather sources)

// A block holds at most this many fragments (one per index combination of the dims before
// block_dim, summed over the arrays): real KV layouts need layers x 2 x heads at most.
constexpr uint64_t kMaxFragmentsPerBlock = 1u << 20;

// The caller's arrays of one store/load and their fragments. The arrays stay referenced here, so
// their buffers (DLPack capsule or buffer-protocol export) outlive the GIL-free copy: another
// thread cannot free, close or unmap them meanwhile (mmap.close() gets BufferError).
template <class Array>
struct ArraySet {
  std::vector<Array> arrays;
  std::vector<Fragment> frags;
};

uint64_t mul_or_throw(uint64_t a, uint64_t b, const char* what) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw ArgumentError(std::string(what) + " overflows 64 bits");
  return r;
}

// Geometry of one array with a block dimension: every index combination of the dims before
// block_dim (C order) is one fragment of `inner` bytes; the dims after block_dim are contiguous.
struct ArrayGeometry {
  int block_dim;
  uint64_t outer;  // fragments contributed (0 if the array holds no bytes per block)
  uint64_t inner;  // bytes per fragment
  int64_t blocks;  // extent of the block dimension
};

template <class Array>
ArrayGeometry geometry_of(const Array& a, int block_dim) {
  int nd = int(a.ndim());
  if (block_dim < 0) block_dim += nd;
  if (block_dim < 0 || block_dim >= nd)
    throw ArgumentError("block_dim out of range for an array of " + std::to_string(nd) + " dims");
  uint64_t item = uint64_t(a.itemsize());
  uint64_t inner = item;
  for (int d = nd - 1; d > block_dim; --d) {
    uint64_t stride_bytes;
    if (a.shape(d) > 1 &&
        (a.stride(d) < 0 || __builtin_mul_overflow(uint64_t(a.stride(d)), item, &stride_bytes) ||
         stride_bytes != inner))
      throw ArgumentError("the dims after block_dim must be contiguous (C order)");
    inner = mul_or_throw(inner, uint64_t(a.shape(d)), "the bytes per fragment");
  }
  uint64_t outer = 1;
  for (int d = 0; d < block_dim; ++d) outer = mul_or_throw(outer, uint64_t(a.shape(d)), "the fragment count");
  if (inner == 0) outer = 0;
  return {block_dim, outer, inner, int64_t(a.shape(block_dim))};
}

template <class Array>
void add_fragments(const Array& a, const ArrayGeometry& g, std::vector<Fragment>& out) {
  int64_t item = int64_t(a.itemsize());
  std::vector<int64_t> idx(size_t(g.block_dim), 0);
  char* base = static_cast<char*>(const_cast<void*>(a.data()));
  for (uint64_t o = 0; o < g.outer; ++o) {
    int64_t off = 0;
    for (int d = 0; d < g.block_dim; ++d) off += idx[size_t(d)] * a.stride(d) * item;
    out.push_back(Fragment{reinterpret_cast<uintptr_t>(base + off), a.stride(g.block_dim) * item, g.inner});
    for (int d = g.block_dim - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < int64_t(a.shape(d))) break;
      idx[size_t(d)] = 0;
    }
  }
}

// Reads the sources once, checks the sizes (overflow-safe) against the namespace's block size
// BEFORE any per-row fragment exists, then builds the fragments and checks the block ids.
template <class Array>
ArraySet<Array> fragments_of(nb::handle sources, int block_dim, const std::vector<int64_t>& ids,
                             const NsHandle& ns, const char* role) {
  ArraySet<Array> set;
  for (nb::handle s : sources) {
    Array a;
    if (!nb::try_cast(s, a))
      throw ArgumentError(std::string(role) + " must be " +
                          (std::is_same_v<Array, AnyArray> ? "writable " : "") +
                          "CPU arrays (buffer protocol or DLPack), got " + py_type_name(s));
    set.arrays.push_back(std::move(a));
  }
  if (set.arrays.empty()) throw ArgumentError("no source arrays given");
  std::vector<ArrayGeometry> geo;
  uint64_t total = 0, count = 0;
  int64_t nblocks = INT64_MAX;
  for (const auto& a : set.arrays) {
    geo.push_back(geometry_of(a, block_dim));
    const auto& g = geo.back();
    nblocks = std::min(nblocks, g.blocks);
    if (__builtin_add_overflow(total, mul_or_throw(g.outer, g.inner, "the bytes per block"), &total) ||
        __builtin_add_overflow(count, g.outer, &count))
      throw ArgumentError("the arrays' bytes per block overflow 64 bits");
  }
  if (total != ns.block_bytes)
    throw ArgumentError("fragments add up to " + std::to_string(total) + " bytes per block, the namespace '" +
                        ns.name + "' stores blocks of " + std::to_string(ns.block_bytes) + " bytes");
  if (count > kMaxFragmentsPerBlock)
    throw ArgumentError("the arrays split a block into " + std::to_string(count) + " fragments; at most " +
                        std::to_string(kMaxFragmentsPerBlock) +
                        " are supported (make the dims after block_dim larger)");
  set.frags.reserve(size_t(count));
  for (size_t i = 0; i < set.arrays.size(); ++i) add_fragments(set.arrays[i], geo[i], set.frags);
  for (int64_t id : ids)
    if (id < 0 || id >= nblocks)
      throw ArgumentError("block id " + std::to_string(id) + " out of range (arrays hold " +
                          std::to_string(nblocks) + " blocks)");
  return set;
}

// Reads a namespace identity from any object with KVLayout's attributes: model_id, source and
// every field of the core's layout field list (format.h). An attribute the object lacks takes the
// field's default; block_bytes None is the layout's natural size.
Layout layout_from(nb::handle obj) {
  Layout l;
  auto text = [&](const char* attr, bool required) -> std::string {
    if (!required && !nb::hasattr(obj, attr)) return "";
    nb::object v = nb::getattr(obj, attr);
    if (!nb::isinstance<nb::str>(v))
      throw nb::type_error((std::string(attr) + " must be a str, not " + py_type_name(v)).c_str());
    return nb::cast<std::string>(v);
  };
  l.model_id = text("model_id", true);
  l.source = text("source", false);
  bool natural_size = false;
  for (const auto& f : layout_field_table()) {
    if (!nb::hasattr(obj, f.name)) continue;
    nb::object v = nb::getattr(obj, f.name);
    if (f.codec != FieldCodec::number) {
      // a name, or an object whose str() is one (torch.bfloat16 -> "torch.bfloat16")
      set_layout_field(l, f, f.parse(str_of(v)));
      continue;
    }
    if (v.is_none() && std::string_view(f.name) == "block_bytes") {  // KVLayout(block_bytes=None)
      natural_size = true;
      continue;
    }
    nb::object n = exact_int(v, f.name);
    unsigned long long x = PyLong_AsUnsignedLongLong(n.ptr());
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {  // negative, or beyond 64 bits
      PyErr_Clear();
      throw_out_of_range(f, str_of(n));
    }
    set_layout_field(l, f, x);
  }
  if (natural_size) l.block_bytes = natural_block_bytes(l);
  check_layout(l);
  return l;
}

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
  d["lease_ms"] = h.lease_ms;
  d["lock_hosts"] = h.lock_hosts;  // multihost: rows of the lock area (0 otherwise)
  d["host_slot"] = h.lock_hosts && p.holds_row() ? int64_t(p.host_slot()) : int64_t(-1);  // -1: none
  d["intent_cap"] = p.intent_cap();  // block-less intents one node may hold at once
  d["intents"] = p.intents_held();   // ... and how many this attachment holds now
  d["nt_copy_kernel"] = nt_copy_kernel_name();
  // The page size this process's mapping got (not the one asked for): huge_pages.h.
  const PageInfo pg = p.page_info();
  d["page_bytes"] = pg.page_bytes;
  d["huge_page_resident_bytes"] = pg.huge_bytes;
  d["resident_bytes"] = pg.resident_bytes;
  // Device interleaving: 0 and one device for a single-device pool.
  d["stripe_bytes"] = p.stripes().striped() ? p.stripes().stripe : 0;
  nb::list devs;
  const auto& files = p.device_files();
  for (uint32_t k = 0; k < p.stripes().devices; ++k) {
    nb::dict dv;
    dv["index"] = k;
    dv["path"] = files.empty() ? p.path() : files[k].path;
    dv["pool_bytes"] = p.stripes().striped()
                           ? device_stripes(p.stripes(), h.pool_bytes, k) * p.stripes().stripe
                           : h.pool_bytes;
    dv["device_bytes"] = device_need_bytes(p.stripes(), h.pool_bytes, k);
    dv["file_dev"] = files.empty() ? p.file_dev() : files[k].dev;
    dv["file_ino"] = files.empty() ? p.file_ino() : files[k].ino;
    devs.append(dv);
  }
  d["devices"] = devs;
  return d;
}

// One judged node slot (liveness evidence for `pool info` / `pool reap`).
nb::dict node_dict(const NodeInfo& n) {
  static const char* states[] = {"free", "claimed", "alive", "reclaiming"};
  static const char* verdicts[] = {"free", "alive", "dead", "undecided"};
  nb::dict d;
  d["node"] = n.id;
  d["state"] = n.state < 4 ? states[n.state] : "invalid";
  d["verdict"] = verdicts[n.verdict];
  d["evidence"] = n.evidence;
  d["judged_by"] = n.self ? "self" : n.same_kernel ? "lock" : "lease";
  d["self"] = n.self;
  d["pid"] = n.pid;
  d["pid_ns"] = n.pid_ns;
  d["epoch"] = n.epoch;
  d["heartbeat"] = n.beat;
  d["silent_ms"] = n.silent_ms;
  d["lease_ms"] = n.lease_ms;
  d["last_beat_unix_ns"] = n.beat_unix_ns;
  d["attach_unix_ns"] = n.attach_unix_ns;
  d["host_slot"] = n.host_slot1 ? int64_t(n.host_slot1) - 1 : int64_t(-1);  // multihost row, -1: none
  d["observer"] = n.observer;
  d["intents"] = n.intents;  // block-less intents it holds (capped at the pool's intent_cap)
  return d;
}

const char* kCounterNames[] = {
#define CXLKV_COUNTER_NAME(id, name, what) #name,
    CXLKV_COUNTERS(CXLKV_COUNTER_NAME)
#undef CXLKV_COUNTER_NAME
};
const char* kCounterMeanings[] = {
#define CXLKV_COUNTER_MEANING(id, name, what) what,
    CXLKV_COUNTERS(CXLKV_COUNTER_MEANING)
#undef CXLKV_COUNTER_MEANING
};

// Strings read from the pool are untrusted bytes: decode them without ever failing.
nb::object pool_str(const std::string& s) {
  return nb::steal(PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "replace"));
}

// A field's value as Python shows it: a name for the dtype and kind codecs, else an int.
nb::object field_value(const LayoutFieldDesc& f, uint64_t v) {
  if (f.codec == FieldCodec::number) return nb::int_(v);
  return nb::str(f.print(v).c_str());
}

nb::dict layout_dict(const NsHandle& h, const Layout& l) {
  nb::dict d;
  d["id"] = h.id;
  d["name"] = pool_str(l.name);
  d["model_id"] = pool_str(l.model_id);
  for (const auto& f : layout_field_table()) d[f.name] = field_value(f, f.get(l));
  d["source"] = pool_str(l.source);
  d["blocks_per_chunk"] = h.geo.blocks;
  return d;
}

nb::dict dtype_dict(const DTypeInfo& d) {
  nb::dict out;
  out["name"] = d.name();
  out["code"] = uint32_t(d.code);
  out["bytes"] = d.bytes;
  nb::list aliases;
  for (size_t i = 1; i < d.names.size(); ++i) aliases.append(d.names[i]);
  out["aliases"] = aliases;
  return out;
}

nb::list names_of(std::span<const NamedCode> table) {
  nb::list out;
  for (const auto& row : table) out.append(row.name);
  return out;
}

}  // namespace

void bind_rpc(nb::module_& m);       // bindings_rpc.cpp
void bind_platform(nb::module_& m);  // bindings_platform.cpp
// bindings_tokens.cpp (the token store) reaches a Namespace object's pool through this.
NsAccess token_ns_access(nb::handle o) {
  PyNamespace& n = nb::cast<PyNamespace&>(o);
  OpGuard g(*n.owner);
  return NsAccess{std::move(g.lock), g.p, n.h};
}
nb::tuple scan_index_py(Pool& pool, uint64_t first, uint64_t count);  // bindings_events.cpp
void bind_transfer(nb::module_& m);                                   // bindings_transfer.cpp

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
  static nb::object nsfull_error =
      make("NamespaceTableFullError", "cxlkv.NamespaceTableFullError", base_error);
  static nb::object quotafull_error = make("QuotaTableFullError", "cxlkv.QuotaTableFullError", base_error);
  static nb::object fenced_error = make("FencedError", "cxlkv.FencedError", base_error);
  static nb::object slot_busy_error = make("HostSlotBusyError", "cxlkv.HostSlotBusyError", base_error);
  static nb::object lock_timeout_error = make("LockTimeoutError", "cxlkv.LockTimeoutError", base_error);
  // Used after close(): one type for the pool and for every Python object of cxlkv (sessions,
  // backends), also a RuntimeError, as Python's own use-after-close errors are.
  static nb::object closed_error = [&] {
    nb::object bases = nb::make_tuple(base_error, nb::handle(PyExc_RuntimeError));
    nb::object e = nb::steal(PyErr_NewExceptionWithDoc(
        "cxlkv.ClosedError",
        "A cxlkv object (a pool, an integration's backend, a pool session) used after its close(): "
        "the caller's bug or a shutdown race, never a cache miss. close() itself may be called any "
        "number of times.",
        bases.ptr(), nullptr));
    m.attr("ClosedError") = e;
    return e;
  }();
  static nb::object in_use_error = make("PoolInUseError", "cxlkv.PoolInUseError", base_error);
  static nb::object read_only_error = make("ReadOnlyError", "cxlkv.ReadOnlyError", base_error);
  static nb::object forked_error = make("ForkedError", "cxlkv.ForkedError", base_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    // Messages may quote bytes read from the pool (names, model ids): decode them without failing,
    // so a corrupt pool gives its own error, never a UnicodeDecodeError.
    auto text = [](const char* what) {
      return PyUnicode_DecodeUTF8(what, Py_ssize_t(std::strlen(what)), "backslashreplace");
    };
    auto raise = [&](PyObject* type, const char* what) {
      PyObject* msg = text(what);
      if (msg) PyErr_SetObject(type, msg);
      Py_XDECREF(msg);
    };
    try {
      std::rethrow_exception(p);
    } catch (const FormatError& e) {
      raise(format_error.ptr(), e.what());
    } catch (const VersionError& e) {
      raise(version_error.ptr(), e.what());
    } catch (const TruncatedError& e) {
      raise(truncated_error.ptr(), e.what());
    } catch (const NotReadyError& e) {
      raise(notready_error.ptr(), e.what());
    } catch (const CorruptError& e) {
      raise(corrupt_error.ptr(), e.what());
    } catch (const LayoutMismatchError& e) {
      raise(layout_error.ptr(), e.what());
    } catch (const NodeTableFullError& e) {
      raise(nodefull_error.ptr(), e.what());
    } catch (const NamespaceTableFullError& e) {
      raise(nsfull_error.ptr(), e.what());
    } catch (const QuotaTableFullError& e) {
      raise(quotafull_error.ptr(), e.what());
    } catch (const FencedError& e) {
      raise(fenced_error.ptr(), e.what());
    } catch (const HostSlotBusyError& e) {
      raise(slot_busy_error.ptr(), e.what());
    } catch (const LockTimeoutError& e) {
      raise(lock_timeout_error.ptr(), e.what());
    } catch (const ClosedError& e) {
      raise(closed_error.ptr(), e.what());
    } catch (const PoolInUseError& e) {
      raise(in_use_error.ptr(), e.what());
    } catch (const ReadOnlyError& e) {
      raise(read_only_error.ptr(), e.what());
    } catch (const ForkedError& e) {
      raise(forked_error.ptr(), e.what());
    } catch (const ArgumentError& e) {
      raise(PyExc_ValueError, e.what());
    } catch (const OsError& e) {
      // OSError(errno, msg) becomes FileNotFoundError, PermissionError... by errno.
      PyObject* msg = text(e.what());
      PyObject* args = msg ? Py_BuildValue("(iN)", e.err, msg) : nullptr;
      if (args) PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
    } catch (const Error& e) {
      raise(base_error.ptr(), e.what());
    }
  });

  nb::class_<PyPool>(m, "Pool")
      .def_static(
          "create",
          [](const std::string& path, uint64_t size, uint64_t chunk_bytes, uint64_t index_slots,
             uint32_t max_nodes, uint32_t pin_slots, uint32_t max_namespaces, const std::string& backend,
             bool exist_ok, uint32_t lease_ms, bool allow_foreign_owner, bool allow_group,
             std::optional<uint32_t> lock_hosts, std::optional<uint64_t> stripe_bytes,
             uint32_t intent_permille) {
            // None: the default (the core's 0); an explicit 0 is a mistake, never "the default".
            if (stripe_bytes == 0u)
              throw ArgumentError("a stripe size of 0 is not a size (leave it out for the default)");
            if (lock_hosts == 0u)
              throw ArgumentError("lock_hosts 0 is not a host count (leave it out for the default)");
            CreateOptions o;
            o.stripe_bytes = stripe_bytes.value_or(0);
            o.lease_ms = lease_ms;
            o.lock_hosts = lock_hosts.value_or(0);
            o.intent_permille = intent_permille;
            o.allow_foreign_owner = allow_foreign_owner, o.allow_group = allow_group;
            o.size = size, o.chunk_bytes = chunk_bytes, o.index_slots = index_slots;
            o.max_nodes = max_nodes, o.pin_slots = pin_slots, o.max_namespaces = max_namespaces;
            o.backend = parse_backend(backend);
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
          "path"_a, "size"_a, "chunk_bytes"_a = kCreateDefaults.chunk_bytes,
          "index_slots"_a = kCreateDefaults.index_slots, "max_nodes"_a = kCreateDefaults.max_nodes,
          "pin_slots"_a = kCreateDefaults.pin_slots, "max_namespaces"_a = kCreateDefaults.max_namespaces,
          "backend"_a = backend_name(kCreateDefaults.backend), "exist_ok"_a = false,
          "lease_ms"_a = kCreateDefaults.lease_ms, "allow_foreign_owner"_a = false, "allow_group"_a = false,
          "lock_hosts"_a = nb::none(), "stripe_bytes"_a = nb::none(),
          "intent_permille"_a = kCreateDefaults.intent_permille, nb::rv_policy::take_ownership)
      .def_static(
          "open",
          [](const std::string& path, bool populate, bool read_only, bool attach, bool allow_foreign_owner,
             bool allow_group, int host_slot) {
            OpenOptions o;
            o.host_slot = host_slot;
            o.populate = populate, o.read_only = read_only, o.attach = attach;
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
          "path"_a, "populate"_a = false, "read_only"_a = false, "attach"_a = true,
          "allow_foreign_owner"_a = false, "allow_group"_a = false, "host_slot"_a = -1,
          nb::rv_policy::take_ownership)
      .def_static(
          "destroy",
          [](const std::string& path, bool ignore_attached, bool remove_invalid) {
            DestroyOptions o;
            o.ignore_attached = ignore_attached, o.remove_invalid = remove_invalid;
            Pool::destroy(path, o);
          },
          "path"_a, "ignore_attached"_a = false, "remove_invalid"_a = false)
      .def("file_replaced",
           [](PyPool& pp) {  // usable on a truncated pool too: no ensure_usable
             std::shared_lock<std::shared_mutex> g(pp.mu);
             if (!pp.pool || pp.pool->closed()) throw ClosedError("pool is closed");
             return pp.pool->file_replaced();
           })
      .def("close",
           [](PyPool& pp) {
             nb::gil_scoped_release nogil;
             std::unique_lock<std::shared_mutex> g(pp.mu);
             pp.close_pool();
           })
      .def_prop_ro("closed", [](PyPool& pp) { return !pp.pool || pp.pool->closed(); })
      .def_prop_ro("path", [](PyPool& pp) { return pp.get().path(); })
      .def_prop_ro("size", [](PyPool& pp) { return pp.get().size(); })
      .def_prop_ro("node_id", [](PyPool& pp) { return pp.get().node_id(); })
      .def_prop_ro("backend", [](PyPool& pp) { return backend_name(pp.get().backend()); })
      .def("info",
           [](PyPool& pp) {
             OpGuard g(pp);
             return info_dict(*g.p);
           })
      .def("device_usage",
           [](PyPool& pp) {
             OpGuard g(pp);
             std::vector<DeviceUse> use;
             {
               nb::gil_scoped_release nogil;
               use = g.p->device_usage();
             }
             nb::list out;
             for (size_t k = 0; k < use.size(); ++k) {
               nb::dict d;
               d["index"] = k;
               d["path"] = use[k].path;
               d["pool_bytes"] = use[k].pool_bytes;
               d["device_bytes"] = use[k].device_bytes;
               d["capacity_bytes"] = use[k].capacity_bytes;
               d["used_bytes"] = use[k].used_bytes;
               out.append(d);
             }
             return out;
           })
      .def(
          "scan_index",
          [](PyPool& pp, uint64_t first, uint64_t count) {
            OpGuard g(pp);
            return scan_index_py(*g.p, first, count);
          },
          "first"_a = 0, "count"_a = UINT64_MAX,
          "READY index entries of slots [first, first+count): (packed records, unstable slots); "
          "see bindings_events.cpp for the record layout")
      .def("namespace_usage",
           [](PyPool& pp) {
             OpGuard g(pp);
             std::vector<NamespaceUse> use;
             {
               nb::gil_scoped_release nogil;
               use = g.p->namespace_usage();
             }
             nb::list out;
             for (const NamespaceUse& u : use) {
               nb::dict d;
               d["id"] = u.id;
               d["chunks"] = u.chunks;
               d["capacity_blocks"] = u.capacity_blocks;
               d["used_blocks"] = u.used_blocks;
               out.append(d);
             }
             return out;
           })
      .def("counters",
           [](PyPool& pp) {
             OpGuard g(pp);
             std::vector<uint64_t> c;
             Occupancy o;
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
      .def(
          "check",
          [](PyPool& pp, bool repair, int64_t watch_ms) {
            OpGuard g(pp);
            CheckReport r;
            {
              nb::gil_scoped_release nogil;
              r = g.p->check(repair, watch_ms);
            }
            nb::dict d, blocks;
            d["ok"] = r.ok;
            d["errors"] = r.errors;
            d["warnings"] = r.warnings;
            d["repaired"] = r.repaired;
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
            d["undecided_nodes"] = r.undecided_nodes;
            nb::dict intents;
            intents["held"] = r.intents;
            intents["cap"] = r.intent_cap;
            intents["nodes_at_cap"] = r.nodes_at_intent_cap;
            d["intents"] = intents;
            if (g.p->backend() == Backend::multihost) {
              nb::dict lock;
              lock["foreign"] = r.lock.tickets_foreign;
              lock["stale"] = r.lock.tickets_stale;
              lock["stuck"] = r.lock.tickets_stuck;
              lock["reset"] = r.lock.rows_reset;
              lock["words_foreign"] = r.lock.words_foreign;
              lock["words_stale"] = r.lock.words_stale;
              lock["words_held"] = r.lock.words_held;
              lock["words_reset"] = r.lock.words_reset;
              d["lock_area"] = lock;
            }
            return d;
          },
          "repair"_a = false, "watch_ms"_a = 0)
      .def(
          "ping",
          [](PyPool& pp, const nb::int_& node_id, uint64_t timeout_ms) {
            OpGuard g(pp);
            const uint32_t node = node_arg(node_id, *g.p);
            PingResult r;
            {
              nb::gil_scoped_release nogil;
              r = g.p->ping(node, timeout_ms);
            }
            static const char* outcomes[] = {"answered", "not_attached", "timeout", "bad_reply"};
            nb::dict d;
            d["outcome"] = outcomes[r.outcome], d["node"] = r.node, d["rtt_ns"] = r.rtt_ns,
            d["epoch"] = r.epoch;
            d["pid"] = r.pid, d["host_id"] = r.host_id, d["detail"] = r.detail;
            return d;
          },
          "node"_a, "timeout_ms"_a = 1000,
          "One round trip through node `node`'s admin mailbox (shared-memory RPC).")
      .def("reap_dead_nodes",
           [](PyPool& pp) {
             OpGuard g(pp);
             nb::gil_scoped_release nogil;
             return g.p->reap_dead_nodes();
           })
      .def("nodes",
           [](PyPool& pp) {
             OpGuard g(pp);
             std::vector<NodeInfo> v;
             {
               nb::gil_scoped_release nogil;
               v = g.p->nodes();
             }
             nb::list out;
             for (const auto& n : v) out.append(node_dict(n));
             return out;
           })
      .def(
          "reap_node",
          [](PyPool& pp, const nb::int_& node_id, bool force, uint64_t wait_ms) {
            OpGuard g(pp);
            const uint32_t node = node_arg(node_id, *g.p);
            NodeInfo n;
            bool reclaimed = false;
            {
              nb::gil_scoped_release nogil;
              n = g.p->reap_node(node, force, &reclaimed, wait_ms);
            }
            nb::dict d = node_dict(n);
            d["reclaimed"] = reclaimed;
            return d;
          },
          "node"_a, "force"_a = false, "wait_ms"_a = 0)
      .def(
          "open_namespace",
          [](PyPool& pp, const std::string& name, nb::handle layout, int device, const std::string& tenant) {
            OpGuard g(pp);
            Layout l = layout_from(layout);
            l.name = name;
            auto* ns = new PyNamespace{&pp, {}, l};
            try {
              nb::gil_scoped_release nogil;
              ns->h = g.p->bind_device(g.p->open_namespace(l), device);
              if (!tenant.empty()) ns->h.tenant_row = g.p->tenant_row(tenant);
              ns->tenant = tenant;
            } catch (...) {
              delete ns;
              throw;
            }
            return ns;
          },
          "name"_a, "layout"_a, "device"_a = -1, "tenant"_a = "", nb::keep_alive<0, 1>(),
          nb::rv_policy::take_ownership,
          "Creates or opens the namespace `name` of `layout` (an object with KVLayout's attributes); "
          "device >= 0: this handle places its blocks on that device of a striped pool only; tenant: the "
          "quota label its puts are charged to (\"\": none).")
      .def(
          "set_quota",
          [](PyPool& pp, uint32_t ns_id, const std::string& tenant, uint64_t max_bytes, uint32_t max_ppm) {
            OpGuard g(pp);
            nb::gil_scoped_release nogil;
            return g.p->set_quota(ns_id, tenant, max_bytes, max_ppm);
          },
          "ns_id"_a = 0, "tenant"_a = "", "max_bytes"_a = 0, "max_ppm"_a = 0,
          "Sets the quota of a namespace (ns_id) or a tenant: max_bytes and/or max_ppm (millionths of the "
          "arena); 0 = no limit (both 0 clear it). Returns the quota row.")
      .def("quotas",
           [](PyPool& pp) {
             OpGuard g(pp);
             std::vector<QuotaInfo> rows;
             {
               nb::gil_scoped_release nogil;
               rows = g.p->quotas();
             }
             nb::list out;
             for (const QuotaInfo& q : rows) {
               nb::dict d;
               d["row"] = q.row;
               d["readable"] = q.readable;
               d["kind"] = q.kind == format::kQuotaTenant      ? "tenant"
                           : q.kind == format::kQuotaNamespace ? "namespace"
                                                               : "unknown";
               d["ns_id"] = q.ns_id;
               d["tenant"] = q.tenant;
               d["max_bytes"] = q.max_bytes;
               d["max_fraction"] = double(q.max_ppm) / format::kPpmOne;
               d["limit_bytes"] = q.limit_bytes;
               d["usage_bytes"] = q.usage_bytes;
               out.append(d);
             }
             return out;
           })
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
      .def_prop_ro("device", [](PyNamespace& n) { return n.h.device; })
      .def_prop_ro("tenant",
                   [](PyNamespace& n) -> nb::object {
                     if (n.tenant.empty()) return nb::none();
                     return nb::str(n.tenant.c_str());
                   })
      .def(
          "locate",
          [](PyNamespace& n, nb::handle key) -> nb::object {
            Key k = to_key(key);
            OpGuard g(*n.owner);
            uint64_t off = 0, len = 0;
            bool found;
            {
              nb::gil_scoped_release nogil;
              found = g.p->locate(n.h, k, &off, &len);
            }
            if (!found) return nb::none();
            const StripeGeometry& sg = g.p->stripes();
            uint64_t stride = n.h.geo.block_stride;
            nb::dict d;
            d["offset"] = off;
            d["length"] = len;
            d["device"] = range_device(sg, off, stride);  // -1: the block crosses a stripe boundary
            d["device_offset"] = device_offset(sg, off);
            return d;
          },
          "key"_a)
      .def(
          "put",
          [](PyNamespace& n, nb::handle key, nb::handle data, uint32_t depth) {
            Key k = to_key(key);
            Buffer b(data, false);
            OpGuard g(*n.owner);
            Piece p{b.data(), b.size()};
            nb::gil_scoped_release nogil;
            return g.p->put(n.h, k, &p, 1, uint16_t(std::min<uint32_t>(depth, 0xFFFF)));
          },
          "key"_a, "data"_a, "depth"_a = 0)
      .def(
          "get",
          [](PyNamespace& n, nb::handle key, nb::handle out, bool whole) {
            Key k = to_key(key);
            Buffer b(out, true);
            OpGuard g(*n.owner);
            Piece p{b.data(), b.size()};
            nb::gil_scoped_release nogil;
            // whole: the caller's buffer is one block; an entry shorter than it (a put of fewer
            // bytes) would fill only its front, so it is a miss.
            uint64_t len = 0;
            return g.p->get(n.h, k, &p, 1, &len) && (!whole || len == b.size());
          },
          "key"_a, "out"_a, "whole"_a = false)
      .def(
          "get_bytes",
          [](PyNamespace& n, nb::handle key) -> nb::object {
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
          },
          "key"_a)
      .def(
          "contains",
          [](PyNamespace& n, nb::handle key) {
            Key k = to_key(key);
            OpGuard g(*n.owner);
            nb::gil_scoped_release nogil;
            return g.p->contains(n.h, k);
          },
          "key"_a)
      .def(
          "match_prefix",
          [](PyNamespace& n, nb::handle keys) {
            auto ks = to_keys(keys);
            OpGuard g(*n.owner);
            nb::gil_scoped_release nogil;
            return g.p->match_prefix(n.h, ks.data(), ks.size());
          },
          "keys"_a)
      .def(
          "delete",
          [](PyNamespace& n, nb::handle key) {
            Key k = to_key(key);
            OpGuard g(*n.owner);
            nb::gil_scoped_release nogil;
            return g.p->remove(n.h, k);
          },
          "key"_a)
      .def(
          "store",
          [](PyNamespace& n, nb::handle keys, nb::handle sources, nb::handle block_ids, int block_dim,
             uint32_t start_depth) {
            auto ks = to_keys(keys);
            auto ids = to_ids(block_ids);
            if (ids.size() != ks.size()) throw ArgumentError("keys and block_ids differ in length");
            auto src = fragments_of<RoArray>(sources, block_dim, ids, n.h, "store sources");
            OpGuard g(*n.owner);
            nb::gil_scoped_release nogil;  // `src` holds the arrays until the copy returns
            return g.p->store(n.h, ks.data(), ks.size(), src.frags, ids.data(), start_depth);
          },
          "keys"_a, "sources"_a, "block_ids"_a, "block_dim"_a = 0, "start_depth"_a = 0)
      .def(
          "load",
          [](PyNamespace& n, nb::handle keys, nb::handle sources, nb::handle block_ids, int block_dim) {
            auto ks = to_keys(keys);
            auto ids = to_ids(block_ids);
            if (ids.size() != ks.size()) throw ArgumentError("keys and block_ids differ in length");
            auto dst = fragments_of<AnyArray>(sources, block_dim, ids, n.h, "load targets");
            OpGuard g(*n.owner);
            nb::gil_scoped_release nogil;  // `dst` holds the arrays until the copy returns
            return g.p->load(n.h, ks.data(), ks.size(), dst.frags, ids.data());
          },
          "keys"_a, "sources"_a, "block_ids"_a, "block_dim"_a = 0)
      .def(
          "acquire",
          [](PyNamespace& n, nb::handle keys) {
            auto ks = to_keys(keys);
            auto* lease = new PyLease{n.owner, {}, {}};
            {
              OpGuard g(*n.owner);
              nb::gil_scoped_release nogil;
              lease->pins = g.p->acquire(n.h, ks.data(), ks.size());
            }
            // The keys as read and checked above: the iterable is not read a second time.
            for (size_t i = 0; i < lease->pins.size() && i < ks.size(); ++i)
              lease->keys.push_back(nb::bytes(reinterpret_cast<const char*>(ks[i].data()), ks[i].size()));
            return lease;
          },
          "keys"_a, nb::keep_alive<0, 1>(), nb::rv_policy::take_ownership)
      .def(
          "bench_index",
          [](PyNamespace& n, uint64_t inserts, uint64_t lookups, uint64_t payload_bytes, uint64_t seed,
             double seconds) {
            OpGuard g(*n.owner);
            IndexBenchResult r;
            {
              nb::gil_scoped_release nogil;
              r = bench_index(*g.p, n.h, inserts, lookups, payload_bytes, seed, seconds);
            }
            nb::dict d;
            for (const auto& [k, v] : r.fields()) d[k] = v;
            d["inserts"] = r.inserts, d["lookups"] = r.lookups;  // counts stay ints
            return d;
          },
          "inserts"_a, "lookups"_a, "payload_bytes"_a = 64, "seed"_a = 1, "seconds"_a = 1.0,
          "Core-side index benchmark (timed in C++): inserts fresh keys, then looks them up.");

  nb::class_<PyLease>(m, "Lease")
      .def("release", &PyLease::release)
      .def("__len__", [](PyLease& l) { return l.pins.size(); })
      .def_prop_ro("keys", [](PyLease& l) { return l.keys; })
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyLease& l, nb::args) { l.release(); });

  // The core's name tables (dtype.h, names.h, format.h's layout field list): the Python package
  // and the CLI read them from here and write none of their own.
  m.def(
      "dtypes",
      [] {
        nb::list out;
        for (const auto& d : dtype_table()) out.append(dtype_dict(d));
        return out;
      },
      "Every KV dtype: canonical name, code, bytes per element, aliases.");
  m.def(
      "dtype_info", [](nb::handle dtype) { return dtype_dict(parse_dtype(str_of(dtype))); }, "dtype"_a,
      "The dtype named `dtype` (any alias, or an object whose str() is one, e.g. torch.bfloat16); ValueError "
      "otherwise.");
  m.def("backends", [] { return names_of(backend_names()); });
  m.def(
      "counter_info",
      [] {
        nb::list out;
        for (uint32_t i = 0; i < format::kCounterCount; ++i)
          out.append(nb::make_tuple(kCounterNames[i], kCounterMeanings[i]));
        return out;
      },
      "The pool's counters (format.h's one list), in order: (name as Pool.stats() keys it, meaning).");
  bind_rpc(m);
  bind_platform(m);
  bind_tokens(m, token_ns_access);
  bind_transfer(m);
  m.def("layout_kinds", [] { return names_of(layout_kind_names()); });
  m.def(
      "layout_fields",
      [] {
        nb::list out;
        for (const auto& f : layout_field_table()) {
          nb::dict d;
          d["name"] = f.name;
          d["codec"] = f.codec == FieldCodec::number  ? "number"
                       : f.codec == FieldCodec::dtype ? "dtype"
                                                      : "kind";
          d["default"] = field_value(f, f.default_value);
          d["min"] = f.min;
          d["max"] = f.max;
          out.append(d);
        }
        return out;
      },
      "The KV layout fields of a namespace identity, in fingerprint order.");
  m.def(
      "normalize_layout",
      [](nb::handle layout) {
        Layout l = layout_from(layout);
        nb::dict d;
        for (const auto& f : layout_field_table()) d[f.name] = field_value(f, f.get(l));
        return d;
      },
      "layout"_a,
      "Validates a KVLayout-like object as open_namespace would; returns its fields in canonical form.");
  // Pool creation's defaults (CreateOptions{}) and limits (format.h), for the Python API's
  // signature and the CLI's help: {option: {"default", "min", "max"}}; a default of 0 means
  // "derived from the size" (max None: no limit named in format.h).
  m.def(
      "create_options",
      [] {
        auto row = [](uint64_t def, uint64_t lo, std::optional<uint64_t> hi) {
          nb::dict d;
          d["default"] = def;
          d["min"] = lo;
          d["max"] = hi ? nb::cast(*hi) : nb::none();
          return d;
        };
        nb::dict d;
        d["chunk_bytes"] = row(kCreateDefaults.chunk_bytes, 0, std::nullopt);
        d["index_slots"] = row(kCreateDefaults.index_slots, 0, std::nullopt);
        d["max_nodes"] = row(kCreateDefaults.max_nodes, 1, format::kMaxNodes);
        d["pin_slots"] = row(kCreateDefaults.pin_slots, 0, std::nullopt);
        d["max_namespaces"] = row(kCreateDefaults.max_namespaces, 1, format::kMaxNamespaces);
        d["lease_ms"] = row(kCreateDefaults.lease_ms, format::kLeaseMsMin, format::kLeaseMsMax);
        d["stripe_bytes"] =
            row(format::kStripeBytesDefault, format::kStripeBytesMin, format::kStripeBytesMax);
        d["lock_hosts"] = row(format::kLockHostsDefault, 1, format::kMaxLockHosts);
        d["intent_permille"] = row(format::kIntentPermilleDefault, 1, format::kIntentPermilleMax);
        nb::dict backend;
        backend["default"] = backend_name(kCreateDefaults.backend);
        d["backend"] = backend;
        return d;
      },
      "Pool.create's defaults and limits: {option: {default, min, max}} (backend: {default}).");
  m.def("nt_copy_kernel", [] { return std::string(nt_copy_kernel_name()); });
  m.def("checksum_copy_kernel", [] { return std::string(checksum_copy_kernel_name()); });
  m.def("set_copy_threads", [](unsigned n) { Pool::set_copy_threads(n); }, "n"_a);
  m.def(
      "copy_threads", [] { return copy_thread_count(); },
      "Threads a large block batch or row gather is split over (set_copy_threads, CXLKV_COPY_THREADS).");
  m.def("xxh3_64", [](nb::bytes b) { return xxh3(b.c_str(), b.size(), 0); });
}
