// Quotas (format/quota.h): the quota table and the usage counters of a pool, read validated and
// written (a row under the table lock, a node's own counters). Everything read here is
// untrusted: a row must pass its checksum and every field its bounds before it limits anything;
// usage sums are clamped to [0, pool bytes]. The protocol around it: tenants and limits are set
// under the namespace-table lock (Namespaces, namespaces.h); a put's charge, its own-block eviction and
// every release are the index's (Index, index_evict.cpp); `pool check` recounts (check.cpp).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "region.h"
#include "store_types.h"

namespace cxlkv {

// `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF): a
// tenant name read from the pool reaches Python and the CLI as text.
bool valid_utf8(const char* s, size_t n);

// One row of the quota table as read (format/quota.h: QuotaRow), with its effective limit.
struct QuotaInfo {
  uint32_t row = 0;  // 1-based (what index entries and counters name)
  bool readable = false;
  bool used = false;  // not a never-used row (all zero): an unreadable used row is never reused
  uint32_t kind = 0;  // format::QuotaKind
  uint32_t ns_id = 0;
  std::string tenant;
  uint64_t max_bytes = 0;
  uint32_t max_ppm = 0;
  uint64_t limit_bytes = 0;  // the stricter of max_bytes and max_ppm of the arena; 0 = no limit
  uint64_t usage_bytes = 0;  // counters' sum, clamped
};

// The cached view (ns_row, limit, in_use, block_bytes_of) is what every put and every release
// consults, from as many copy threads as the caller runs: reading it takes no lock. The rows are
// re-read from the pool at most every kRefreshUs, by the first thread that finds the view stale
// (the others keep using the previous view while it does), into the slot of a two-slot buffer that
// readers are not reading, which is then published (Snapshot below). A quota changed by this
// process (invalidate_cache) is seen by its next read; one changed by another process within
// kRefreshUs plus the few microseconds one re-read takes.
class Quotas {
 public:
  explicit Quotas(const Region& region);

  // Row `row` (1-based) read now: false if free or unreadable (torn, forged: info->used says which;
  // only an all-zero row is free, so a row whose kind a stray write zeroed stays its subject's).
  bool read_row(uint32_t row, QuotaInfo* info) const;
  // Every row in use (readable or not), with usage.
  std::vector<QuotaInfo> rows(uint32_t max_nodes) const;
  // The rows as read at most kRefreshUs ago (tenant_row consults this; set_quota's changes reach
  // every process within that time). Takes the refresh lock: not for the put path.
  std::vector<QuotaInfo> cached();
  void invalidate_cache();
  uint8_t ns_row(uint32_t ns_id);  // the namespace's row (1-based) or 0; lock-free
  uint64_t limit(uint32_t row);    // cached limit of a row, 0 = none; lock-free
  // A row in use, readable or not (cached; a miss re-reads the table, at most once per
  // kForcedRefreshUs in this process).
  bool in_use(uint32_t row);
  // usage(r) = sum over node slots of charged - released, as a signed total (check compares it
  // raw); usage() clamps it to [0, pool bytes].
  int64_t raw_usage(uint32_t row, uint32_t max_nodes) const;
  uint64_t usage(uint32_t row, uint32_t max_nodes) const;
  uint64_t arena_bytes() const;
  // The block bytes of namespace ns_id (READY entries are immutable: cached, lock-free), 0 if none.
  uint64_t block_bytes_of(uint32_t ns_id);

  // Serialises a row with its checksum (the writer's half; the caller holds the table lock).
  static format::QuotaRow make_row(uint32_t kind, uint32_t ns_id, const std::string& tenant,
                                   uint64_t max_bytes, uint32_t max_ppm);
  format::QuotaRow* row_ptr(uint32_t row) const;  // 1-based, bounds-checked by the caller
  // A tenant name as written by this build: 1..31 bytes of UTF-8 text without control
  // characters (ArgumentError otherwise).
  static void check_tenant(const std::string& tenant);
  // Writes row `row` (1-based) and writes it back. The caller holds the table lock.
  void write_row(uint32_t row, const format::QuotaRow& r) const;
  // The row of subject (kind, ns_id, tenant), created if absent (QuotaTableFullError, naming
  // pool `path`, if none is free). The caller holds the table lock.
  uint32_t row_of_locked(uint32_t kind, uint32_t ns_id, const std::string& tenant,
                         const std::string& path) const;
  // Adds `bytes` to node `node_id`'s (1-based) charged or released counter of `row`, written back
  // at once (other hosts enforce the same quota). Nothing without a row, a node or bytes.
  void book(uint32_t node_id, uint8_t row, uint64_t bytes, bool charge) const;
  // The block of entry e (a snapshot, or the entry itself) was freed or handed to another entry
  // (every free path): node `node_id` books its bytes released for each row of e in use.
  void release(uint32_t node_id, const format::IndexEntry& e);
  // A put charged e's rows `block_bytes` but took no block: node `node_id` gives the charge back.
  void refund(uint32_t node_id, QuotaCharge charged, uint64_t block_bytes) const;

 private:
  static constexpr uint64_t kRefreshUs = 100'000;
  static constexpr uint64_t kForcedRefreshUs = 1'000;  // in_use's re-reads on a miss: pool-driven
  // One published view of the readable rows, indexed by row (1-based). A seqlock per slot: the
  // refresher (one at a time, under refresh_mu_) rewrites only the slot readers were not sent to
  // (current_ names the other), so a reader retries only if two refreshes pass while it reads.
  // subject[r]: 0 = row r is free; kUsedUnreadable = used, but torn or forged (no kind, no limit);
  // else kReadable | kind << 32 | ns_id.
  // limit[r]: its limit in bytes, 0 = none. rows_hi: no readable row above it (puts scan 1..rows_hi).
  struct Snapshot {
    std::atomic<uint64_t> seq{0};  // odd while being rewritten
    std::atomic<uint32_t> rows_hi{0};
    std::atomic<uint64_t> subject[format::kQuotaRows + 1] = {};
    std::atomic<uint64_t> limit[format::kQuotaRows + 1] = {};
  };
  static constexpr uint64_t kReadable = 1ull << 63;
  static constexpr uint64_t kUsedUnreadable = 1ull << 62;  // never equal to a subject_word
  static uint64_t subject_word(uint32_t kind, uint32_t ns_id) {
    return kReadable | uint64_t(kind) << 32 | ns_id;
  }
  // Re-reads the table if the view is older than kRefreshUs (waits for the re-read only after
  // invalidate_cache or on first use; otherwise a concurrent refresher's view-in-progress is
  // not waited for).
  void keep_fresh();
  void refresh_locked(bool force);  // caller holds refresh_mu_
  // Calls f(const Snapshot&) on a consistent published view and returns what it returned.
  template <class F>
  auto read_view(F&& f) const;

  const Region& region_;
  Snapshot views_[2];
  std::atomic<uint32_t> current_{0};       // the slot readers read
  std::atomic<uint64_t> refreshed_us_{0};  // when current_'s rows were read; 0 = re-read before use
  std::atomic<uint64_t> forced_us_{0};     // in_use's last forced re-read (rate limit)
  mutable std::mutex refresh_mu_;          // one refresher at a time; a reader only after 8 torn tries
  std::vector<QuotaInfo> cache_;           // under refresh_mu_: the same rows, with tenant names
  // By namespace id (1..kMaxNamespaces); 0 = not known yet. Written once per id with the value
  // every writer reads (a READY namespace's layout is immutable): relaxed is enough.
  std::unique_ptr<std::atomic<uint64_t>[]> block_bytes_;
};

}  // namespace cxlkv
