// Quotas (format 3.0, docs/ARCHITECTURE.md "Quotas"): the on-memory part. An operator caps the
// pool bytes held by a tenant (a label an engine is configured with) or by a namespace (a model).
//
// Quota table: QuotaRow[kQuotaRows] at kQuotaTableOff, in the SharedWords page after its words.
//   A row is a *subject* (a tenant by name, or a namespace by id) and its limit. Rows are created
//   and changed only under the namespace-table lock (SharedWords.ns_lock), so each row's line has
//   one writer at a time; they are never freed nor given to another subject (the row index is
//   what index entries and usage counters name), so a cleared quota is a row with no limit.
//   Tenant rows are created by the first `namespace(layout, tenant=T)` or `pool quota --tenant T`;
//   namespace rows only by `pool quota --namespace`.
//   checksum = XXH3_64 of the row's bytes before it: a torn or stray row is seen as unreadable
//   (no limit is enforced from it; `pool check` reports it), never followed. Only an all-zero
//   row is free: a used row whose kind a stray write zeroed is unreadable, not reused (entries
//   and counters still name it; a new subject there would inherit, and evict, its blocks).
// Index entries: IndexEntry.tenant_row / ns_row (format.h) name the rows (1-based, 0 = none) the
//   entry's block is charged to. Written by the entry's writer with its key, immutable after.
// Usage counters: NodeAreaFixed.quota_charged[r] / quota_released[r], monotonic bytes, written
//   only by the owning node (one writer per line, like the other counters):
//     charged:  a writer adds the block's bytes to each row of its entry BEFORE it takes a block
//     released: whoever frees the block of an entry (evictor, deleter, drainer, reclaimer, abort)
//               adds the same bytes to its own counters
//   usage(r) = sum over node slots of charged[r] - released[r] (counters outlive attachments,
//   like the others, so usage survives restarts and spans hosts without a cross-host RMW).
//   A writer that dies between its charge and taking a block leaves usage high by one block;
//   an observer that frees without a node slot leaves it high too: `pool check` recomputes
//   usage from the blocks and reports the difference (--repair books it into its own counters).
//   Read values are untrusted: a sum outside [0, pool_bytes] is clamped, never used as an index or
//   a loop bound. A forged counter can still make a quota too strict (a sum read high: the subject
//   evicts its own blocks, at most 64 a put, then its puts fail) or lenient (read low or negative:
//   clamped to 0) until `pool check --repair` books the difference; other subjects' rows are
//   unaffected.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cxlkv::format {

constexpr uint32_t kQuotaRows = 48;
constexpr size_t kQuotaTableOff = 4096 + 1024;  // in the SharedWords page, after SharedWords
constexpr uint32_t kTenantNameBytes = 32;       // up to 31 bytes + NUL
constexpr uint32_t kPpmOne = 1000000;           // max_ppm: parts per million of the arena

enum QuotaKind : uint32_t { kQuotaFree = 0, kQuotaTenant = 1, kQuotaNamespace = 2 };

struct alignas(64) QuotaRow {
  uint32_t kind;                // QuotaKind
  uint32_t ns_id;               // kQuotaNamespace: the namespace (1..max_namespaces); else 0
  uint64_t max_bytes;           // 0 = no byte limit
  uint32_t max_ppm;             // 0 = no fraction limit; else 1..kPpmOne of the arena's bytes
  uint32_t pad;                 // zero
  char name[kTenantNameBytes];  // kQuotaTenant: the tenant, NUL-padded; else zero
  uint64_t checksum;            // XXH3_64 of the bytes before it
};
static_assert(sizeof(QuotaRow) == 64);
static_assert(kQuotaTableOff + kQuotaRows * sizeof(QuotaRow) == 8192, "the table fills its page");

}  // namespace cxlkv::format
