// Quotas (format/quota.h, docs/ARCHITECTURE.md "Quotas"): the table's validated reader and the
// usage sums. The protocol around it: quotas.h.
#include "quotas.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "checksum.h"
#include "clock.h"
#include "errors.h"

namespace cxlkv {

using namespace format;

bool valid_utf8(const char* s, size_t n) {
  static constexpr uint32_t kLeast[5] = {0, 0, 0x80, 0x800, 0x10000};  // shortest form of each length
  const auto* u = reinterpret_cast<const unsigned char*>(s);
  for (size_t i = 0; i < n;) {
    const unsigned c = u[i];
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (!len || len > n - i) return false;
    uint32_t cp = len == 1 ? c : c & (0x7Fu >> len);
    for (size_t k = 1; k < len; ++k) {
      if ((u[i + k] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (u[i + k] & 0x3F);
    }
    if (cp < kLeast[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

QuotaRow* Quotas::row_ptr(uint32_t row) const {
  return reinterpret_cast<QuotaRow*>(region_.base() + kQuotaTableOff) + (row - 1);
}

QuotaRow Quotas::make_row(uint32_t kind, uint32_t ns_id, const std::string& tenant, uint64_t max_bytes,
                          uint32_t max_ppm) {
  QuotaRow r;
  std::memset(&r, 0, sizeof r);
  r.kind = kind;
  r.ns_id = ns_id;
  r.max_bytes = max_bytes;
  r.max_ppm = max_ppm;
  std::memcpy(r.name, tenant.data(), std::min<size_t>(tenant.size(), kTenantNameBytes - 1));
  r.checksum = xxh3(&r, offsetof(QuotaRow, checksum));
  return r;
}

void Quotas::check_tenant(const std::string& t) {
  if (t.empty() || t.size() >= kTenantNameBytes)
    throw ArgumentError("tenant must have 1.." + std::to_string(kTenantNameBytes - 1) + " bytes, got " +
                        std::to_string(t.size()));
  for (unsigned char c : t)
    if (c < 0x20 || c == 0x7f) throw ArgumentError("tenant must not contain NUL or control characters");
  if (!valid_utf8(t.data(), t.size())) throw ArgumentError("tenant must be UTF-8 text");
}

void Quotas::write_row(uint32_t row, const QuotaRow& r) const {
  const Coherence& coh = region_.coh();
  QuotaRow* p = row_ptr(row);
  coh.check_fence();  // before the plain stores (a dirty line reaches memory flushed or not)
  auto* d = reinterpret_cast<uint64_t*>(p);
  const auto* s = reinterpret_cast<const uint64_t*>(&r);
  for (size_t i = 0; i < sizeof r / 8; ++i)
    std::atomic_ref<uint64_t>(d[i]).store(s[i], std::memory_order_relaxed);
  coh.flush(p, sizeof r);
  coh.fence();
}

uint32_t Quotas::row_of_locked(uint32_t kind, uint32_t ns_id, const std::string& tenant,
                               const std::string& path) const {
  uint32_t free_row = 0;
  for (uint32_t r = 1; r <= kQuotaRows; ++r) {
    QuotaInfo q;
    if (read_row(r, &q)) {
      if (q.kind == kind && q.ns_id == ns_id && q.tenant == tenant) return r;
    } else if (!q.used && !free_row) {
      free_row = r;  // an unreadable row is not free: `pool check` reports it, nobody reuses it
    }
  }
  if (!free_row)
    throw QuotaTableFullError("pool " + path + ": all " + std::to_string(kQuotaRows) +
                              " quota rows (tenants and namespace quotas) are in use");
  write_row(free_row, make_row(kind, ns_id, tenant, 0, 0));
  return free_row;
}

void Quotas::book(uint32_t node_id, uint8_t row, uint64_t bytes, bool charge) const {
  if (row == 0 || row > kQuotaRows || !node_id || !bytes) return;
  NodeAreaFixed* f = region_.node_fixed(node_id - 1);
  uint64_t* w = charge ? &f->quota_charged[row - 1] : &f->quota_released[row - 1];
  region_.coh().bump_owned(w, bytes);
  region_.coh().flush(w, sizeof *w);  // other hosts enforce the same quota: the line reaches memory now
}

void Quotas::release(uint32_t node_id, const IndexEntry& e) {
  if (!e.tenant_row && !e.ns_row) return;
  const uint64_t bytes = block_bytes_of(e.ns_id);
  // Only rows in use (readable or not: a row whose checksum a stray write broke is still its
  // subject's, and its charges were booked): a forged entry naming a free row must not book bytes
  // a later subject of that row would start with (its usage would read low, its quota lenient).
  if (e.tenant_row && in_use(e.tenant_row)) book(node_id, e.tenant_row, bytes, false);
  if (e.ns_row && in_use(e.ns_row)) book(node_id, e.ns_row, bytes, false);
}

void Quotas::refund(uint32_t node_id, QuotaCharge charged, uint64_t block_bytes) const {
  book(node_id, charged.tenant_row, block_bytes, false);
  book(node_id, charged.ns_row, block_bytes, false);
}

uint64_t Quotas::arena_bytes() const {
  const PoolHeader* h = region_.header();
  uint64_t out;
  if (__builtin_mul_overflow(h->chunk_count, h->chunk_bytes, &out)) return h->pool_bytes;
  return out;
}

bool Quotas::read_row(uint32_t row, QuotaInfo* info) const {
  *info = QuotaInfo{};
  info->row = row;
  if (row == 0 || row > kQuotaRows) return false;
  const QuotaRow* p = row_ptr(row);
  QuotaRow r;
  bool sum_ok = false;
  for (int attempt = 0; attempt < 3 && !sum_ok; ++attempt) {  // a row being rewritten reads torn
    region_.coh().invalidate(p, sizeof r);
    auto* s = reinterpret_cast<uint64_t*>(const_cast<QuotaRow*>(p));
    for (size_t i = 0; i < sizeof r / 8; ++i) {
      const uint64_t v = std::atomic_ref<uint64_t>(s[i]).load(std::memory_order_relaxed);
      std::memcpy(reinterpret_cast<char*>(&r) + i * 8, &v, 8);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    const auto* words = reinterpret_cast<const uint64_t*>(&r);
    if (std::all_of(words, words + sizeof r / 8, [](uint64_t w) { return w == 0; }))
      return false;  // never used (zeroed at creation); anything else names a subject, maybe torn
    sum_ok = r.checksum == xxh3(&r, offsetof(QuotaRow, checksum));
  }
  info->kind = r.kind;
  info->used = true;
  if (!sum_ok) return false;
  const PoolHeader* h = region_.header();
  bool ok = r.max_ppm <= kPpmOne && r.pad == 0;
  if (r.kind == kQuotaNamespace) {
    ok = ok && r.ns_id >= 1 && r.ns_id <= h->max_namespaces;
  } else if (r.kind == kQuotaTenant) {
    size_t n = strnlen(r.name, kTenantNameBytes);
    ok = ok && r.ns_id == 0 && n >= 1 && n < kTenantNameBytes;
    for (size_t i = 0; ok && i < n; ++i) ok = uint8_t(r.name[i]) >= 0x20 && r.name[i] != 0x7f;
    ok = ok && valid_utf8(r.name, n);  // Python and the CLI print it as text
    if (ok) info->tenant.assign(r.name, n);
  } else {
    ok = false;
  }
  if (!ok) return false;
  info->readable = true;
  info->ns_id = r.ns_id;
  info->max_bytes = r.max_bytes;
  info->max_ppm = r.max_ppm;
  uint64_t limit = r.max_bytes;
  if (r.max_ppm) {
    const uint64_t a = arena_bytes();
    const uint64_t by_ppm = a / kPpmOne * r.max_ppm + a % kPpmOne * r.max_ppm / kPpmOne;
    if (limit == 0 || by_ppm < limit) limit = by_ppm;
    if (limit == 0) limit = 1;  // a fraction too small for a byte still limits
  }
  info->limit_bytes = limit;
  return true;
}

std::vector<QuotaInfo> Quotas::rows(uint32_t max_nodes) const {
  std::vector<QuotaInfo> out;
  for (uint32_t r = 1; r <= kQuotaRows; ++r) {
    QuotaInfo q;
    if (read_row(r, &q) || q.used) {
      if (q.readable) q.usage_bytes = usage(r, max_nodes);
      out.push_back(q);
    }
  }
  return out;
}

Quotas::Quotas(const Region& region)
    : region_(region), block_bytes_(std::make_unique<std::atomic<uint64_t>[]>(kMaxNamespaces + 1)) {}

template <class F>
auto Quotas::read_view(F&& f) const {
  // Lock-free while refreshes are rare. Pool content can drive refreshes (in_use forces one when
  // a release names a free row, at most one per kForcedRefreshUs), and a reader preempted on every
  // try could still retry for long: after kLockFreeTries it reads under refresh_mu_, where no
  // refresher writes, which bounds its wait by one refresh.
  constexpr int kLockFreeTries = 8;
  for (int i = 0; i < kLockFreeTries; ++i) {
    const Snapshot& v = views_[current_.load(std::memory_order_acquire)];
    const uint64_t seq = v.seq.load(std::memory_order_acquire);
    if (seq & 1) continue;  // two refreshes passed since current_ was read: read the other slot
    auto out = f(v);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (v.seq.load(std::memory_order_relaxed) == seq) return out;
  }
  std::lock_guard<std::mutex> g(refresh_mu_);
  return f(views_[current_.load(std::memory_order_acquire)]);
}

void Quotas::keep_fresh() {
  const uint64_t t = refreshed_us_.load(std::memory_order_acquire);
  if (t && now_mono_us() - t <= kRefreshUs) return;  // the put path: one clock read, no lock
  if (!t) {  // first use, or this process changed a quota: its next read sees the change
    std::lock_guard<std::mutex> g(refresh_mu_);
    refresh_locked(false);
    return;
  }
  std::unique_lock<std::mutex> g(refresh_mu_, std::try_to_lock);
  if (g.owns_lock()) refresh_locked(false);  // else another thread is re-reading the rows right now
}

void Quotas::refresh_locked(bool force) {
  const uint64_t now = std::max<uint64_t>(now_mono_us(), 1);
  const uint64_t t = refreshed_us_.load(std::memory_order_relaxed);
  if (!force && t && now - t <= kRefreshUs) return;  // refreshed while we waited for the lock
  cache_.clear();
  std::vector<uint32_t> unreadable;  // used, but torn or forged: still someone's (release books them)
  for (uint32_t r = 1; r <= kQuotaRows; ++r) {
    QuotaInfo q;
    if (read_row(r, &q))
      cache_.push_back(q);
    else if (q.used)
      unreadable.push_back(r);
  }
  const uint32_t next = current_.load(std::memory_order_relaxed) ^ 1;
  Snapshot& v = views_[next];
  const uint64_t seq = v.seq.load(std::memory_order_relaxed);
  v.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // odd before any field changes
  for (uint32_t r = 1; r <= kQuotaRows; ++r) {
    v.subject[r].store(0, std::memory_order_relaxed);
    v.limit[r].store(0, std::memory_order_relaxed);
  }
  uint32_t hi = 0;
  for (const QuotaInfo& q : cache_) {
    v.subject[q.row].store(subject_word(q.kind, q.ns_id), std::memory_order_relaxed);
    v.limit[q.row].store(q.limit_bytes, std::memory_order_relaxed);
    hi = std::max(hi, q.row);
  }
  for (uint32_t r : unreadable) v.subject[r].store(kUsedUnreadable, std::memory_order_relaxed);
  v.rows_hi.store(hi, std::memory_order_relaxed);
  v.seq.store(seq + 2, std::memory_order_release);
  current_.store(next, std::memory_order_release);
  refreshed_us_.store(now, std::memory_order_release);
}

std::vector<QuotaInfo> Quotas::cached() {
  std::lock_guard<std::mutex> g(refresh_mu_);
  refresh_locked(false);
  return cache_;
}

void Quotas::invalidate_cache() {
  std::lock_guard<std::mutex> g(refresh_mu_);  // a re-read in progress may predate the change
  refreshed_us_.store(0, std::memory_order_release);
}

uint8_t Quotas::ns_row(uint32_t ns_id) {
  keep_fresh();
  const uint64_t want = subject_word(kQuotaNamespace, ns_id);
  return read_view([&](const Snapshot& v) {
    const uint32_t hi = std::min(v.rows_hi.load(std::memory_order_relaxed), kQuotaRows);
    for (uint32_t r = 1; r <= hi; ++r)
      if (v.subject[r].load(std::memory_order_relaxed) == want) return uint8_t(r);
    return uint8_t(0);
  });
}

uint64_t Quotas::limit(uint32_t row) {
  if (row == 0 || row > kQuotaRows) return 0;
  keep_fresh();
  return read_view([&](const Snapshot& v) { return v.limit[row].load(std::memory_order_relaxed); });
}

bool Quotas::in_use(uint32_t row) {
  if (row == 0 || row > kQuotaRows) return false;
  auto used = [&] {
    return read_view([&](const Snapshot& v) { return v.subject[row].load(std::memory_order_relaxed) != 0; });
  };
  keep_fresh();
  if (used()) return true;
  // Maybe a row created since the last refresh: read once more. Entries naming a free row are
  // pool content (a forged entry), so these re-reads are at most one per kForcedRefreshUs: a
  // release that names a row created within that time is not booked (its usage reads high until
  // `pool check --repair` recounts it), never a re-read of the whole table per release.
  const uint64_t now = std::max<uint64_t>(now_mono_us(), 1);
  uint64_t last = forced_us_.load(std::memory_order_relaxed);
  if (last && now - last <= kForcedRefreshUs) return false;
  if (!forced_us_.compare_exchange_strong(last, now, std::memory_order_relaxed)) return used();
  {
    std::lock_guard<std::mutex> g(refresh_mu_);
    refresh_locked(true);
  }
  return used();
}

int64_t Quotas::raw_usage(uint32_t row, uint32_t max_nodes) const {
  if (row == 0 || row > kQuotaRows) return 0;
  uint64_t charged = 0, released = 0;  // wrapping sums: the difference is what counts
  for (uint32_t i = 0; i < max_nodes; ++i) {
    const NodeAreaFixed* f = region_.node_fixed(i);
    charged += region_.coh().read(&f->quota_charged[row - 1]);
    released += region_.coh().read(&f->quota_released[row - 1]);
  }
  return int64_t(charged - released);
}

uint64_t Quotas::usage(uint32_t row, uint32_t max_nodes) const {
  const int64_t u = raw_usage(row, max_nodes);
  const uint64_t most = region_.header()->pool_bytes;
  if (u < 0) return 0;
  return uint64_t(u) > most ? most : uint64_t(u);
}

uint64_t Quotas::block_bytes_of(uint32_t ns_id) {
  const PoolHeader* h = region_.header();
  if (ns_id == 0 || ns_id > h->max_namespaces || ns_id > kMaxNamespaces) return 0;
  const uint64_t known = block_bytes_[ns_id].load(std::memory_order_relaxed);
  if (known) return known;
  const NamespaceEntry* e = region_.ns_entry(ns_id);
  if (ns_state(region_.coh().read(&e->state)) != kNsReady) return 0;
  region_.coh().invalidate(e, sizeof *e);
  const uint64_t b = std::atomic_ref<uint64_t>(const_cast<NamespaceEntry*>(e)->layout.block_bytes).load();
  if (b == 0 || b > kMaxBlockBytes) return 0;
  // READY entries never change: the first good read holds
  block_bytes_[ns_id].store(b, std::memory_order_relaxed);
  return b;
}

}  // namespace cxlkv
