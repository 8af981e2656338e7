// Quotas (format/quota.h): reading the quota table and the usage counters of a pool, validated.
// Everything read here is untrusted: a row must pass its checksum and every field its bounds
// before it limits anything; usage sums are clamped to [0, pool bytes]. The protocol around it
// (charging a put, evicting a subject's own blocks, releasing, `pool check`) is Pool's, in
// quota_protocol.cpp.
#pragma once
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "region.h"

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

class Quotas {
 public:
  explicit Quotas(const Region& region) : region_(region) {}

  // Row `row` (1-based) read now: false if free or unreadable (torn, forged: info->used says which;
  // only an all-zero row is free, so a row whose kind a stray write zeroed stays its subject's).
  bool read_row(uint32_t row, QuotaInfo* info) const;
  // Every row in use (readable or not), with usage.
  std::vector<QuotaInfo> rows(uint32_t max_nodes) const;
  // The rows as read at most kRefreshUs ago (puts consult this; set_quota's changes reach
  // every process within that time).
  std::vector<QuotaInfo> cached();
  void invalidate_cache();
  // The namespace's row (1-based) or 0. Every put asks this: it reads ns_of_row_ without a lock
  // and takes mu_ only when that table is stale (once per kRefreshUs, or after invalidate_cache).
  uint8_t ns_row(uint32_t ns_id);
  uint64_t limit(uint32_t row);  // cached limit of a row, 0 = none
  bool in_use(uint32_t row);     // a readable row (cached)
  // usage(r) = sum over node slots of charged - released, as a signed total (check compares it
  // raw); usage() clamps it to [0, pool bytes].
  int64_t raw_usage(uint32_t row, uint32_t max_nodes) const;
  uint64_t usage(uint32_t row, uint32_t max_nodes) const;
  uint64_t arena_bytes() const;
  // The block bytes of namespace ns_id (READY entries are immutable: cached), 0 if none.
  uint64_t block_bytes_of(uint32_t ns_id);

  // Serialises a row with its checksum (the writer's half; the caller holds the table lock).
  static format::QuotaRow make_row(uint32_t kind, uint32_t ns_id, const std::string& tenant,
                                   uint64_t max_bytes, uint32_t max_ppm);
  format::QuotaRow* row_ptr(uint32_t row) const;  // 1-based, bounds-checked by the caller

 private:
  static constexpr uint64_t kRefreshUs = 100'000;
  void refresh_locked();  // caller holds mu_; also republishes ns_of_row_
  const Region& region_;
  std::mutex mu_;
  std::vector<QuotaInfo> cache_;
  uint64_t cache_us_ = 0;
  bool cache_valid_ = false;
  // Lock-free copy of cache_'s namespace rows for ns_row: ns_of_row_[r-1] = ns_id + 1 when row r
  // is a readable namespace row, else 0. Each slot is one atomic word, so a reader racing a
  // refresh sees every row either as before or as after it (as stale as the mutex-held cache
  // could be). ns_rows_us_ is when it was filled; 0 = stale (never filled, or invalidated).
  std::array<std::atomic<uint64_t>, format::kQuotaRows> ns_of_row_{};
  std::atomic<uint64_t> ns_rows_us_{0};
  std::vector<uint64_t> block_bytes_;  // by namespace id; 0 = not known yet
};

}  // namespace cxlkv
