// Quotas, the protocol (docs/ARCHITECTURE.md "Quotas"): naming a tenant and setting a limit
// (under the namespace-table lock), charging a put and evicting the subject's own blocks when it
// is over (quota_admit), and `pool check`'s recount (check_quotas). The table's reader and writer,
// the counters' bookings and the release where a block leaves its entry are Quotas' (quotas.h).
#include <chrono>
#include <cstring>
#include <thread>

#include "pool.h"

namespace cxlkv {

using namespace format;

// Quota rows change under the namespace-table lock (namespaces.cpp), one writer at a time.
void Pool::with_quota_lock(const std::function<void()>& fn) {
  if (read_only_) throw ReadOnlyError("pool " + path_ + " was opened read-only; quotas cannot be changed");
  if (!node_id_) become_writer();  // a row-less observer (host_slot.cpp): changing a quota is writing
  if (!node_id_) throw ReadOnlyError("pool " + path_ + ": changing a quota needs a node slot (none free)");
  with_ns_table_lock("no quota was changed", fn);
  quotas_.invalidate_cache();
}

uint8_t Pool::tenant_row(const std::string& tenant) {
  Quotas::check_tenant(tenant);
  for (const QuotaInfo& q : quotas_.cached())
    if (q.kind == kQuotaTenant && q.tenant == tenant) return uint8_t(q.row);
  uint32_t row = 0;
  with_quota_lock([&] { row = quotas_.row_of_locked(kQuotaTenant, 0, tenant, path_); });
  return uint8_t(row);
}

uint32_t Pool::set_quota(uint32_t ns_id, const std::string& tenant, uint64_t max_bytes, uint32_t max_ppm) {
  if ((ns_id == 0) == tenant.empty()) throw ArgumentError("a quota names either a namespace or a tenant");
  if (!tenant.empty()) Quotas::check_tenant(tenant);
  if (ns_id > hdr_->max_namespaces || (ns_id && quotas_.block_bytes_of(ns_id) == 0))
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

std::vector<QuotaInfo> Pool::quotas() { return quotas_.rows(hdr_->max_nodes); }

// `pool check`: every row readable and well-formed, every entry's rows naming rows in use, and
// each row's usage recounted from the blocks (entries that hold a block pointing back). A live
// pool may differ by the puts in flight (a warning); --repair books the difference into this
// node's counters.
void Pool::check_quotas(CheckReport& r) {
  std::vector<QuotaInfo> rows = quotas_.rows(hdr_->max_nodes);
  if (rows.empty()) return;  // no row was ever used: nothing to recount (check stays one index pass)
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
      quotas_.book(node_id_, uint8_t(q.row), uint64_t(diff > 0 ? diff : -diff), diff > 0);
      r.fixed(what + " (booked the difference)");
    } else {
      r.warnings.push_back(what + (r.repair ? " (not repaired: no node slot)" : ""));
    }
  }
}

}  // namespace cxlkv
