// Python binding of the device-transfer protocol (src/core/transfer/transfer.h): Namespace.reserve ->
// Reservation (commit/abort), Namespace.pin_verified -> VerifiedLease (recheck/release), and
// Pool.transfer_view(): the pool bytes as one uint8 array for a device path (the CUDA transfer
// registers it with cudaHostRegister; Triton's interpreter reads and writes it on the CPU).
//
// Why a view and not an address: an integer address outlives the mapping it names. The view is
// an array whose owner keeps the mapping alive (PyPool::close_pool moves the mapping into the
// views' anchor), so no access through it can touch an unmapped page. Offsets come from the core
// only (reserve, pin_verified), already bounds-checked against the pool's geometry.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings_types.h"
#include "transfer.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace cxlkv;
using namespace cxlkv::bindings;

namespace {

const char* state_name(Reservation::State s) {
  switch (s) {
    case Reservation::reserved: return "reserved";
    case Reservation::present: return "present";
    case Reservation::in_flight: return "in_flight";
    case Reservation::failed: return "failed";
    case Reservation::committed: return "committed";
    case Reservation::aborted: return "aborted";
    case Reservation::capped: return "capped";
  }
  return "?";
}

bool usable_here(const Pool& p) {
  try {
    p.ensure_usable();  // throws when closed, fenced, or inherited through fork()
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The blocks reserved for one save. Whatever is neither committed nor aborted when it goes is
// aborted then: a reservation never outlives its owner as a WRITING entry of a live node.
struct PyReservation {
  PyPool* owner;
  NsHandle ns;
  std::vector<Reservation> items;
  ~PyReservation() { abort(); }
  void abort() {
    std::shared_lock<std::shared_mutex> g(owner->mu);
    if (!owner->pool || !usable_here(*owner->pool)) return;  // a closed pool's reclaim frees them
    for (auto& r : items) owner->pool->abort(ns, &r);
  }
  // Commits every reserved block; returns the leading count present in the pool afterwards.
  size_t commit() {
    OpGuard g(*owner);
    nb::gil_scoped_release nogil;
    size_t lead = 0;
    bool leading = true;
    for (auto& r : items) {
      bool ok = r.state == Reservation::present || g.p->commit(ns, &r);
      leading = leading && ok;
      lead += leading;
    }
    return lead;
  }
};

struct PyVerifiedLease {
  PyPool* owner;
  std::vector<VerifiedBlock> blocks;
  ~PyVerifiedLease() { release(); }
  void release() {
    if (blocks.empty()) return;
    std::shared_lock<std::shared_mutex> g(owner->mu);
    if (owner->pool && usable_here(*owner->pool)) owner->pool->unpin_verified(&blocks);
    blocks.clear();
  }
};

nb::list offsets_of(const std::vector<Reservation>& items) {
  nb::list out;
  for (const auto& r : items)
    out.append((r.state == Reservation::reserved || r.state == Reservation::committed) && r.with_block
                   ? int64_t(r.offset)
                   : int64_t(-1));
  return out;
}

}  // namespace

void bind_transfer(nb::module_& m) {
  nb::class_<PyReservation>(m, "Reservation",
                            "Blocks reserved for keys (Namespace.reserve): write them at `offsets` "
                            "of Pool.transfer_view(), then commit(); abort() (or dropping it) frees them.")
      .def("__len__", [](PyReservation& r) { return r.items.size(); })
      .def_prop_ro(
          "offsets", [](PyReservation& r) { return offsets_of(r.items); },
          "pool offset of each key's reserved (or committed) block, -1 where none was reserved")
      .def_prop_ro(
          "states",
          [](PyReservation& r) {
            nb::list out;
            for (const auto& x : r.items) out.append(state_name(x.state));
            return out;
          },
          "reserved | present (already in the pool) | in_flight (another writer) | failed (no "
          "block) | committed | aborted")
      .def("commit", &PyReservation::commit,
           "Checksums each reserved block's pool bytes and publishes it; returns the number of "
           "leading keys present afterwards. Call only once the device's copy has completed.")
      .def("abort", &PyReservation::abort, "Frees every block not committed; nothing is published.");

  nb::class_<PyVerifiedLease>(
      m, "VerifiedLease", "Leading blocks pinned and verified for a device read (Namespace.pin_verified).")
      .def("__len__", [](PyVerifiedLease& l) { return l.blocks.size(); })
      .def_prop_ro("offsets",
                   [](PyVerifiedLease& l) {
                     nb::list out;
                     for (const auto& b : l.blocks) out.append(b.offset);
                     return out;
                   })
      .def(
          "recheck",
          [](PyVerifiedLease& l) {
            OpGuard g(*l.owner);
            nb::gil_scoped_release nogil;
            return g.p->recheck(l.blocks);
          },
          "After the device read the blocks: the leading count still intact (checksum and entry); "
          "the first that is not is condemned and is a miss for everyone.")
      .def("release", &PyVerifiedLease::release)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyVerifiedLease& l, nb::args) { l.release(); });

  nb::handle ns_type = nb::type<PyNamespace>();
  ns_type.attr("reserve") = nb::cpp_function(
      [](PyNamespace& n, nb::handle keys, uint32_t start_depth, bool blocks) {
        auto ks = to_keys(keys);
        auto* r = new PyReservation{n.owner, n.h, {}};
        r->items.resize(ks.size());
        try {
          OpGuard g(*n.owner);
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < ks.size(); ++i)
            g.p->reserve(n.h, ks[i], uint16_t(std::min<size_t>(start_depth + i, 0xFFFF)), &r->items[i],
                         blocks);
        } catch (...) {
          delete r;  // aborts what was reserved
          throw;
        }
        return r;
      },
      nb::scope(ns_type), nb::name("reserve"), nb::is_method(), "keys"_a, "start_depth"_a = 0,
      "blocks"_a = true, nb::keep_alive<0, 1>(), nb::rv_policy::take_ownership,
      "Two-phase save: a block of block_bytes for each key not in the pool yet (Reservation). "
      "blocks=False: intents only, an entry per key that others see in flight and that costs no "
      "pool block (offsets -1; commit raises ArgumentError; abort or the owner's death releases).");
  ns_type.attr("pin_verified") = nb::cpp_function(
      [](PyNamespace& n, nb::handle keys) {
        auto ks = to_keys(keys);
        auto* l = new PyVerifiedLease{n.owner, {}};
        {
          OpGuard g(*n.owner);
          nb::gil_scoped_release nogil;
          g.p->pin_verified(n.h, ks.data(), ks.size(), &l->blocks);
        }
        return l;
      },
      nb::scope(ns_type), nb::name("pin_verified"), nb::is_method(), "keys"_a, nb::keep_alive<0, 1>(),
      nb::rv_policy::take_ownership,
      "Pins the leading present keys whose pool bytes match their checksum (VerifiedLease).");

  nb::handle pool_type = nb::type<PyPool>();
  pool_type.attr("transfer_view") = nb::cpp_function(
      [](PyPool& pp) {
        std::shared_ptr<MappingAnchor> anchor;
        void* base = nullptr;
        size_t shape[1] = {0};
        {
          // Exclusively, and so without the GIL (PyPool::mu's lock order): a thread of a save
          // may hold `mu` shared while it waits for the GIL to return from commit().
          nb::gil_scoped_release nogil;
          std::unique_lock<std::shared_mutex> g(pp.mu);
          Pool& p = pp.get();
          if (p.read_only()) throw ReadOnlyError("a read-only pool has no writable view");
          anchor = pp.views.lock();
          if (!anchor) {
            anchor = std::make_shared<MappingAnchor>();
            pp.views = anchor;
          }
          base = p.mapped_base();
          shape[0] = size_t(p.size());
        }
        // `anchor` keeps the mapping alive from here on, even if the pool closes meanwhile
        // (close_pool moves the mapping into it).
        auto* keep = new std::shared_ptr<MappingAnchor>(std::move(anchor));
        nb::capsule owner(keep,
                          [](void* k) noexcept { delete static_cast<std::shared_ptr<MappingAnchor>*>(k); });
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(base, 1, shape, owner);
      },
      nb::scope(pool_type), nb::name("transfer_view"), nb::is_method(),
      "The pool bytes as a writable uint8 array (offsets of Reservation / VerifiedLease index it). "
      "It keeps the mapping alive after close(); write only blocks you reserved.");
  pool_type.attr("transfer_ranges") = nb::cpp_function(
      [](PyPool& pp, uint64_t max_bytes, uint64_t page) {
        OpGuard g(pp);
        return g.p->transfer_ranges(max_bytes, page);
      },
      nb::scope(pool_type), nb::name("transfer_ranges"), nb::is_method(), "max_bytes"_a, "page"_a = 4096,
      "(offset, length) ranges covering the pool, each <= max_bytes, cut between chunks on a page.");
}
