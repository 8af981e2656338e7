// Quotas (format/quota.h, docs/ARCHITECTURE.md "Quotas"): the table's reader (Quotas), and the
// protocol around it as Pool members: naming a tenant, setting a limit (under the namespace-table
// lock), charging a put and evicting the subject's own blocks when it is over (quota_admit), the
// release when a block is freed (quota_release), and `pool check`'s recount (check_quotas).
#include "quotas.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include "checksum.h"
#include "clock.h"
#include "pool.h"

namespace cxlkv {

using namespace format;

namespace {
// A tenant name as written by this build: 1..31 printable bytes without control characters.
void check_tenant(const std::string& t) {
  if (t.empty() || t.size() >= kTenantNameBytes)
    throw ArgumentError("tenant must have 1.." + std::to_string(kTenantNameBytes - 1) + " bytes, got " +
                        std::to_string(t.size()));
  for (unsigned char c : t)
    if (c < 0x20 || c == 0x7f) throw ArgumentError("tenant must not contain NUL or control characters");
}
}  // namespace

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
    if (r.kind == kQuotaFree && r.checksum == 0) return false;  // never used (zeroed at creation)
    sum_ok = r.checksum == xxh3(&r, offsetof(QuotaRow, checksum));
  }
  info->kind = r.kind;
  if (!sum_ok) return false;
  const PoolHeader* h = region_.header();
  bool ok = r.max_ppm <= kPpmOne && r.pad == 0;
  if (r.kind == kQuotaNamespace) {
    ok = ok && r.ns_id >= 1 && r.ns_id <= h->max_namespaces;
  } else if (r.kind == kQuotaTenant) {
    size_t n = strnlen(r.name, kTenantNameBytes);
    ok = ok && r.ns_id == 0 && n >= 1 && n < kTenantNameBytes;
    for (size_t i = 0; ok && i < n; ++i) ok = uint8_t(r.name[i]) >= 0x20 && r.name[i] != 0x7f;
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
    if (read_row(r, &q) || q.kind != kQuotaFree) {
      if (q.readable) q.usage_bytes = usage(r, max_nodes);
      out.push_back(q);
    }
  }
  return out;
}

std::vector<QuotaInfo> Quotas::cached() {
  std::lock_guard<std::mutex> g(mu_);
  const uint64_t now = now_mono_us();
  if (!cache_valid_ || now - cache_us_ > kRefreshUs) {
    cache_.clear();
    for (uint32_t r = 1; r <= kQuotaRows; ++r) {
      QuotaInfo q;
      if (read_row(r, &q)) cache_.push_back(q);
    }
    cache_us_ = now;
    cache_valid_ = true;
  }
  return cache_;
}

void Quotas::invalidate_cache() {
  std::lock_guard<std::mutex> g(mu_);
  cache_valid_ = false;
}

uint8_t Quotas::ns_row(uint32_t ns_id) {
  for (const QuotaInfo& q : cached())
    if (q.kind == kQuotaNamespace && q.ns_id == ns_id) return uint8_t(q.row);
  return 0;
}

uint64_t Quotas::limit(uint32_t row) {
  for (const QuotaInfo& q : cached())
    if (q.row == row) return q.limit_bytes;
  return 0;
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
  if (ns_id == 0 || ns_id > h->max_namespaces) return 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (block_bytes_.size() > ns_id && block_bytes_[ns_id]) return block_bytes_[ns_id];
  }
  const NamespaceEntry* e = region_.ns_entry(ns_id);
  if (ns_state(region_.coh().read(&e->state)) != kNsReady) return 0;
  region_.coh().invalidate(e, sizeof *e);
  const uint64_t b = std::atomic_ref<uint64_t>(const_cast<NamespaceEntry*>(e)->layout.block_bytes).load();
  if (b == 0 || b > kMaxBlockBytes) return 0;
  std::lock_guard<std::mutex> g(mu_);
  if (block_bytes_.size() <= ns_id) block_bytes_.resize(h->max_namespaces + 1, 0);
  block_bytes_[ns_id] = b;  // READY entries never change: the first good read holds
  return b;
}

// --- Pool: the protocol --------------------------------------------------------------------------

// The namespace-table lock (SharedWords.ns_lock) around fn: quota rows change under it, one writer
// at a time. The same bounds as open_namespace's creation: 3 leases, stale holders broken.
void Pool::with_quota_lock(const std::function<void()>& fn) {
  if (read_only_) throw ReadOnlyError("pool " + path_ + " was opened read-only; quotas cannot be changed");
  if (!node_id_) become_writer();  // a row-less observer (host_slot.cpp): changing a quota is writing
  if (!node_id_) throw ReadOnlyError("pool " + path_ + ": changing a quota needs a node slot (none free)");
  uint64_t* lock = &shared()->ns_lock.word;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(3 * uint64_t(hdr_->lease_ms));
  for (int spins = 0;; ++spins) {
    uint64_t expected = 0;
    if (coh_.claim(lock, expected, node_id_)) break;
    if (spins % 100 == 0) break_stale_ns_lock();
    if (spins % 100 == 99) reap_dead_nodes();
    if (spins % 100 == 50 && std::chrono::steady_clock::now() > deadline)
      throw LockTimeoutError("pool " + path_ + ": namespace table lock held by live node " +
                             std::to_string(expected) + " for more than 3 leases: no quota was changed");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  try {
    fn();
  } catch (...) {
    coh_.publish(lock, 0);
    throw;
  }
  coh_.publish(lock, 0);
  quotas_.invalidate_cache();
}

void Pool::write_quota_row(uint32_t row, const QuotaRow& r) {
  QuotaRow* p = quotas_.row_ptr(row);
  coh_.check_fence();  // before the plain stores (a dirty line reaches memory flushed or not)
  auto* d = reinterpret_cast<uint64_t*>(p);
  const auto* s = reinterpret_cast<const uint64_t*>(&r);
  for (size_t i = 0; i < sizeof r / 8; ++i)
    std::atomic_ref<uint64_t>(d[i]).store(s[i], std::memory_order_relaxed);
  coh_.flush(p, sizeof r);
  coh_.fence();
}

// The row of subject (kind, ns_id, tenant), created if absent. Caller holds the quota lock.
uint32_t Pool::quota_row_locked(uint32_t kind, uint32_t ns_id, const std::string& tenant) {
  uint32_t free_row = 0;
  for (uint32_t r = 1; r <= kQuotaRows; ++r) {
    QuotaInfo q;
    if (quotas_.read_row(r, &q)) {
      if (q.kind == kind && q.ns_id == ns_id && q.tenant == tenant) return r;
    } else if (q.kind == kQuotaFree && !free_row) {
      free_row = r;  // an unreadable row is not free: `pool check` reports it, nobody reuses it
    }
  }
  if (!free_row)
    throw QuotaTableFullError("pool " + path_ + ": all " + std::to_string(kQuotaRows) +
                              " quota rows (tenants and namespace quotas) are in use");
  write_quota_row(free_row, Quotas::make_row(kind, ns_id, tenant, 0, 0));
  return free_row;
}

uint8_t Pool::tenant_row(const std::string& tenant) {
  check_tenant(tenant);
  for (const QuotaInfo& q : quotas_.cached())
    if (q.kind == kQuotaTenant && q.tenant == tenant) return uint8_t(q.row);
  uint32_t row = 0;
  with_quota_lock([&] { row = quota_row_locked(kQuotaTenant, 0, tenant); });
  return uint8_t(row);
}

uint32_t Pool::set_quota(uint32_t ns_id, const std::string& tenant, uint64_t max_bytes, uint32_t max_ppm) {
  if ((ns_id == 0) == tenant.empty()) throw ArgumentError("a quota names either a namespace or a tenant");
  if (!tenant.empty()) check_tenant(tenant);
  if (ns_id > hdr_->max_namespaces || (ns_id && quotas_.block_bytes_of(ns_id) == 0))
    throw ArgumentError("namespace id " + std::to_string(ns_id) + " is not a namespace of pool " + path_);
  if (max_ppm > kPpmOne) throw ArgumentError("a fraction of the pool must be at most 1");
  const uint32_t kind = ns_id ? kQuotaNamespace : kQuotaTenant;
  uint32_t row = 0;
  with_quota_lock([&] {
    row = quota_row_locked(kind, ns_id, tenant);
    write_quota_row(row, Quotas::make_row(kind, ns_id, tenant, max_bytes, max_ppm));
  });
  return row;
}

std::vector<QuotaInfo> Pool::quotas() { return quotas_.rows(hdr_->max_nodes); }

void Pool::quota_book(uint8_t row, uint64_t bytes, bool charge) {
  if (row == 0 || row > kQuotaRows || !node_id_ || !bytes) return;
  NodeAreaFixed* f = node_fixed(node_id_ - 1);
  uint64_t* w = charge ? &f->quota_charged[row - 1] : &f->quota_released[row - 1];
  coh_.bump_owned(w, bytes);
  coh_.flush(w, sizeof *w);  // other hosts enforce the same quota: the line reaches memory now
}

void Pool::quota_release(const IndexEntry& e) {
  if (!e.tenant_row && !e.ns_row) return;
  const uint64_t bytes = quotas_.block_bytes_of(e.ns_id);
  quota_book(e.tenant_row, bytes, false);
  quota_book(e.ns_row, bytes, false);
}

// Charges the block a put is about to take to the rows its entry names, then, for each row over
// its limit, evicts the subject's own oldest unpinned blocks of this namespace (tails of chains
// first: the evictor's order) until it fits. The first such block is handed straight to `slot`
// (*got: the caller allocates nothing), so a subject at its limit never takes a block from the
// free pool or from anyone else. False: over the limit with nothing of its own left to evict;
// the charge is returned and puts_over_quota counted.
bool Pool::quota_admit(const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block, bool* got) {
  *got = false;
  IndexEntry* e = entry(slot);  // ours (WRITING): the rows we wrote with the key
  const uint8_t rows[2] = {e->tenant_row, e->ns_row};
  if (!rows[0] && !rows[1]) return true;
  for (uint8_t r : rows) quota_book(r, ns.block_bytes, true);
  constexpr int kMaxOwnEvictions = 64;  // bounds a put whatever the counters say
  for (uint8_t r : rows) {
    if (!r || r > kQuotaRows) continue;
    const uint64_t limit = quotas_.limit(r);
    if (!limit) continue;
    for (int n = 0; quotas_.usage(r, hdr_->max_nodes) > limit; ++n) {
      Evictor::Accept own = [&](const IndexEntry& v) {
        return (v.tenant_row == r || v.ns_row == r) &&
               (ns.device < 0 || (validate_ref(ns, v) && block_on_device(ns, v.chunk, v.block)));
      };
      const uint32_t key = placement_key(ns) | (uint32_t(r) << 24);  // a queue per (subject, namespace)
      bool evicted =
          n < kMaxOwnEvictions && evictor_.from_queue(
                                      key, ns.id, own,
                                      [&](const Victim& c) {
                                        return *got ? evict_victim(c, &ns, nullptr, nullptr, ~0ull)
                                                    : (*got = evict_victim(c, &ns, chunk, block, slot));
                                      });
      if (!evicted) {
        if (*got) {  // the block handed over is ours now: give it back
          uint64_t* d = block_desc(*chunk, *block);
          uint64_t dw = coh_.read(d);
          if (block_state(dw) == kBlockUsed && block_slot(dw) == slot) free_block(*chunk, *block);
          *got = false;
        }
        quota_refund(ns, slot);
        count(kPutsOverQuota);
        return false;
      }
      count(kQuotaEvictions);
    }
  }
  return true;
}

void Pool::quota_refund(const NsHandle& ns, uint64_t slot) {
  const IndexEntry* e = entry(slot);
  quota_book(e->tenant_row, ns.block_bytes, false);
  quota_book(e->ns_row, ns.block_bytes, false);
}

// `pool check`: every row readable and well-formed, every entry's rows naming rows in use, and
// each row's usage recounted from the blocks (entries that hold a block pointing back). A live
// pool may differ by the puts in flight (a warning); --repair books the difference into this
// node's counters.
void Pool::check_quotas(CheckReport& r) {
  std::vector<QuotaInfo> rows = quotas_.rows(hdr_->max_nodes);
  std::vector<bool> in_use(kQuotaRows + 1, false);
  for (const QuotaInfo& q : rows) {
    if (!q.readable) {
      r.error("quota row " + std::to_string(q.row) +
              " is unreadable (checksum or field out of range): " + "no limit is enforced from it");
      continue;
    }
    in_use[q.row] = true;
    if (q.kind == kQuotaNamespace && quotas_.block_bytes_of(q.ns_id) == 0)
      r.error("quota row " + std::to_string(q.row) + " names namespace " + std::to_string(q.ns_id) +
              ", which does not exist");
  }
  std::vector<int64_t> held(kQuotaRows + 1, 0);
  uint64_t bad_rows = 0;
  for (uint64_t slot = 0; slot <= slot_mask_; ++slot) {
    const uint64_t w = coh_.read(&entry(slot)->state);
    const uint8_t st = entry_state(w);
    if (st != kWriting && st != kReady && st != kEvicting && st != kCondemned) continue;
    IndexEntry e;
    if (!snapshot(slot, w, &e) || (!e.tenant_row && !e.ns_row)) continue;
    if (e.tenant_row > kQuotaRows || e.ns_row > kQuotaRows || (e.tenant_row && !in_use[e.tenant_row]) ||
        (e.ns_row && !in_use[e.ns_row])) {
      ++bad_rows;
      continue;
    }
    if (e.chunk >= hdr_->chunk_count || e.block >= desc_bytes_ / 8) continue;
    const uint64_t dw = coh_.read(block_desc(e.chunk, e.block));
    if (block_state(dw) != kBlockUsed || block_slot(dw) != slot) continue;
    const int64_t bytes = int64_t(quotas_.block_bytes_of(e.ns_id));
    if (e.tenant_row) held[e.tenant_row] += bytes;
    if (e.ns_row) held[e.ns_row] += bytes;
  }
  if (bad_rows)
    r.error(std::to_string(bad_rows) +
            " index entries name quota rows not in use (their blocks are charged to nobody)");
  for (const QuotaInfo& q : rows) {
    if (!q.readable) continue;
    const int64_t counted = quotas_.raw_usage(q.row, hdr_->max_nodes);
    if (counted == held[q.row]) continue;
    const std::string who =
        q.kind == kQuotaTenant ? "tenant '" + q.tenant + "'" : "namespace " + std::to_string(q.ns_id);
    const std::string what = "quota usage of " + who + ": counters say " + std::to_string(counted) +
                             " bytes, its blocks hold " + std::to_string(held[q.row]);
    if (r.repair && node_id_ && !read_only_) {
      const int64_t diff = held[q.row] - counted;
      quota_book(uint8_t(q.row), uint64_t(diff > 0 ? diff : -diff), diff > 0);
      r.fixed(what + " (booked the difference)");
    } else {
      r.warnings.push_back(what + (r.repair ? " (not repaired: no node slot)" : ""));
    }
  }
}

}  // namespace cxlkv
