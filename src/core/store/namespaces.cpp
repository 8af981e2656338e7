// Namespaces (namespaces.h): the namespace table's protocol — open/create under the
// namespace-table lock, the listing, fingerprints checked — and the tenants and quota limits set
// under that lock.
#include "namespaces.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "errors.h"
#include "format.h"

namespace cxlkv {

using namespace format;

namespace {
std::string fixed_str(const char* p, size_t n) { return std::string(p, strnlen(p, n)); }

// Display text written into the pool: bounded, and free of NUL (which would cut it short when
// read back) and of control characters (which a terminal would execute when `pool info` prints).
void check_text(const char* field, const std::string& s, size_t capacity) {
  if (s.size() >= capacity)
    throw ArgumentError(std::string(field) + " must be at most " + std::to_string(capacity - 1) +
                        " bytes, got " + std::to_string(s.size()));
  for (unsigned char c : s)
    if (c < 0x20 || c == 0x7f)
      throw ArgumentError(std::string(field) + " must not contain NUL or control characters");
}

Layout layout_of(const NamespaceEntry& e) {
  Layout l;
  l.fields() = e.layout;
  l.name = fixed_str(e.name, kNameBytes);
  l.model_id = fixed_str(e.model_id, kModelIdBytes);
  l.source = fixed_str(e.source, kSourceBytes);
  return l;
}
}  // namespace

std::vector<std::pair<NsHandle, Layout>> Namespaces::list() {
  std::vector<std::pair<NsHandle, Layout>> out;
  for (uint32_t id = 1; id <= hdr().max_namespaces; ++id) {
    NamespaceEntry* e = region_.ns_entry(id);
    if (ns_state(coh_.read(&e->state)) != kNsReady) continue;
    coh_.invalidate(e, sizeof *e);
    Layout l = layout_of(*e);
    // F5: a READY entry is immutable by contract, but the bytes are untrusted: read once, and skip
    // an entry whose block size no writer could have stored (`pool check` reports it).
    if (l.block_bytes == 0 || l.block_bytes > kMaxBlockBytes) continue;
    NsHandle h;
    h.id = id;
    h.block_bytes = l.block_bytes;
    h.geo = chunk_geometry(hdr().chunk_bytes, l.block_bytes);
    h.name = l.name;
    out.emplace_back(h, l);
  }
  return out;
}

std::vector<NsHandle> Namespaces::handles() {
  std::vector<NsHandle> out;
  for (auto& [h, l] : list()) out.push_back(h);
  return out;
}

void Namespaces::release_of_node(uint8_t dead) {
  uint64_t lw = coh_.read(&region_.shared()->ns_lock.word);
  if (lw == dead) coh_.claim(&region_.shared()->ns_lock.word, lw, 0);
  for (uint32_t id = 1; id <= hdr().max_namespaces; ++id) {
    NamespaceEntry* ne = region_.ns_entry(id);
    uint64_t w = coh_.read(&ne->state);
    if (ns_state(w) == kNsCreating && ns_node(w) == dead) coh_.claim(&ne->state, w, 0);
  }
}

uint64_t Namespaces::break_stale_lock() {
  uint64_t* lock = &region_.shared()->ns_lock.word;
  uint64_t holder = coh_.read(lock);
  if (holder == 0) return 0;
  bool stale = holder > hdr().max_nodes;
  if (!stale) stale = node_state(coh_.read(&region_.node_slot(uint32_t(holder - 1))->state)) == kNodeFree;
  if (!stale) return 0;
  peers_.become_writer();  // a row-less observer (host_slot.cpp): breaking it is writing
  uint64_t expected = holder;
  return coh_.claim(lock, expected, 0) ? holder : 0;
}

NsHandle Namespaces::open(const Layout& want) {
  if (read_only_) throw ReadOnlyError("pool " + path_ + " was opened read-only; namespaces cannot be opened");
  check_text("namespace name", want.name, kNameBytes);
  check_text("model_id", want.model_id, kModelIdBytes);
  if (observer_ || !node_id_)
    throw ReadOnlyError("pool " + path_ +
                        " was opened as an observer (attach=false): it cannot open namespaces");
  if (want.name.empty() || want.name.size() >= kNameBytes)
    throw ArgumentError("namespace name must have 1.." + std::to_string(kNameBytes - 1) + " bytes");
  if (want.model_id.size() >= kModelIdBytes)
    throw ArgumentError("model_id must be shorter than " + std::to_string(kModelIdBytes) + " bytes");
  check_text("source", want.source, kSourceBytes);
  check_layout(want.fields());
  auto geo = chunk_geometry(hdr().chunk_bytes, want.block_bytes);
  if (geo.blocks == 0)
    throw ArgumentError("a block of " + std::to_string(want.block_bytes) +
                        " bytes does not fit in this pool's chunks of " + std::to_string(hdr().chunk_bytes) +
                        " bytes; create the pool with a larger chunk size");
  uint64_t fp = layout_fingerprint(want.model_id, want.fields());

  auto lookup = [&](NsHandle* h) -> bool {
    for (auto& [handle, layout] : list()) {
      if (layout.name != want.name) continue;
      NamespaceEntry* e = region_.ns_entry(handle.id);
      std::string diff = layout_diff(want, layout);
      if (e->fingerprint != fp || !diff.empty())
        throw LayoutMismatchError(
            "namespace '" + want.name + "' exists in pool " + path_ +
            " with another KV layout: " + (diff.empty() ? "fingerprint differs" : diff));
      *h = handle;
      return true;
    }
    return false;
  };
  NsHandle h;
  if (lookup(&h)) return h;

  // Create under the namespace-table lock (rare; a lock held by a dead node is broken by reap).
  bool found = false;
  with_lock("no namespace was created", [&] {
    if ((found = lookup(&h))) return;
    for (uint32_t id = 1; id <= hdr().max_namespaces; ++id) {
      NamespaceEntry* e = region_.ns_entry(id);
      uint64_t w = coh_.read(&e->state);
      if (ns_state(w) != kNsFree) continue;
      if (!coh_.claim(&e->state, w, make_ns_word(kNsCreating, uint8_t(node_id_)))) continue;
      coh_.check_fence();  // before the plain stores: a dirty line reaches memory flushed or not
      std::memset(reinterpret_cast<char*>(e) + 8, 0, sizeof *e - 8);
      e->fingerprint = fp;
      e->layout = want.fields();
      std::memcpy(e->model_id, want.model_id.data(), want.model_id.size());
      std::memcpy(e->name, want.name.data(), want.name.size());
      std::memcpy(e->source, want.source.data(), want.source.size());
      coh_.flush(e, sizeof *e);
      coh_.publish(&e->state, make_ns_word(kNsReady, 0));
      h.id = id;
      h.block_bytes = want.block_bytes;
      h.geo = geo;
      h.name = want.name;
      found = true;
      return;
    }
  });
  if (found) return h;
  throw NamespaceTableFullError("pool " + path_ + ": all " + std::to_string(hdr().max_namespaces) +
                                " namespace slots are in use");
}

// The namespace-table lock (SharedWords.ns_lock) around fn: namespaces are created and quota rows
// change under it, one writer at a time. Bound: 3 leases, the cross-host locks' bound: a holder
// stalled that long is judged dead and reaped first, so a live-looking holder past it is a stray
// write (or a stalled writer whose heartbeat runs): LockTimeoutError, `nothing_done` saying what
// was not written. The lock is released however fn ends (a fenced node's release is left to
// whoever reclaims it).
void Namespaces::with_lock(const char* nothing_done, const std::function<void()>& fn) {
  uint64_t* lock = &region_.shared()->ns_lock.word;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(3 * uint64_t(hdr().lease_ms));
  for (int spins = 0;; ++spins) {
    uint64_t expected = 0;
    if (coh_.claim(lock, expected, node_id_)) break;
    if (spins % 100 == 0) break_stale_lock();  // F13: a holder that can never release it
    if (spins % 100 == 99) peers_.reap_dead_nodes();
    if (spins % 100 == 50 && std::chrono::steady_clock::now() > deadline)
      throw LockTimeoutError("pool " + path_ + ": namespace table lock held by live node " +
                             std::to_string(expected) + " for more than 3 leases (" +
                             std::to_string(3 * uint64_t(hdr().lease_ms)) +
                             " ms): a stalled writer or a stray write; " + nothing_done);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  struct Unlock {
    Coherence& coh;
    uint64_t* w;
    ~Unlock() {
      try {
        coh.publish(w, 0);
      } catch (...) {  // fenced: the lock is broken by whoever reclaims this node
      }
    }
  } unlock{coh_, lock};
  fn();
}

// --- quotas (format/quota.h; docs/ARCHITECTURE.md "Quotas"): naming a tenant and setting a limit,
// under the namespace-table lock. The table's reader and writer are Quotas' (quotas.h); a put's
// charge and own-block eviction are Index::quota_admit's (index_evict.cpp).

// Quota rows change under the namespace-table lock (with_lock), one writer at a time.
void Namespaces::with_quota_lock(const std::function<void()>& fn) {
  if (read_only_) throw ReadOnlyError("pool " + path_ + " was opened read-only; quotas cannot be changed");
  if (!node_id_) peers_.become_writer();  // a row-less observer (host_slot.cpp): changing a quota is writing
  if (!node_id_) throw ReadOnlyError("pool " + path_ + ": changing a quota needs a node slot (none free)");
  with_lock("no quota was changed", fn);
  quotas_.invalidate_cache();
}

uint8_t Namespaces::tenant_row(const std::string& tenant) {
  Quotas::check_tenant(tenant);
  for (const QuotaInfo& q : quotas_.cached())
    if (q.kind == kQuotaTenant && q.tenant == tenant) return uint8_t(q.row);
  uint32_t row = 0;
  with_quota_lock([&] { row = quotas_.row_of_locked(kQuotaTenant, 0, tenant, path_); });
  return uint8_t(row);
}

uint32_t Namespaces::set_quota(uint32_t ns_id, const std::string& tenant, uint64_t max_bytes,
                               uint32_t max_ppm) {
  if ((ns_id == 0) == tenant.empty()) throw ArgumentError("a quota names either a namespace or a tenant");
  if (!tenant.empty()) Quotas::check_tenant(tenant);
  if (ns_id > hdr().max_namespaces || (ns_id && quotas_.block_bytes_of(ns_id) == 0))
    throw ArgumentError("namespace id " + std::to_string(ns_id) + " is not a namespace of pool " + path_);
  if (max_ppm > kPpmOne) throw ArgumentError("a fraction of the pool must be at most 1");
  const uint32_t kind = ns_id ? kQuotaNamespace : kQuotaTenant;
  if (!max_bytes && !max_ppm) {  // a clear: a subject without a row has no limit, and rows are never freed
    bool has_row = false;
    for (uint32_t r = 1; r <= kQuotaRows && !has_row; ++r) {
      QuotaInfo q;
      has_row = quotas_.read_row(r, &q) && q.kind == kind && q.ns_id == ns_id && q.tenant == tenant;
    }
    if (!has_row) return 0;
  }
  uint32_t row = 0;
  with_quota_lock([&] {
    row = quotas_.row_of_locked(kind, ns_id, tenant, path_);
    quotas_.write_row(row, Quotas::make_row(kind, ns_id, tenant, max_bytes, max_ppm));
  });
  return row;
}

}  // namespace cxlkv
