// Index scan: the READY entries of a range of index slots, each read as a seqlock snapshot.
// Used by `cxlkv events` (a pool-wide event stream diffs two scans) and `cxlkv query`. Read-only:
// it never claims, pins or touches an entry. Every field it returns was validated here (state,
// namespace id); the key is opaque bytes and the depth only a hint, so neither can steer anything.
#include <cstring>

#include "index_scan.h"

namespace cxlkv {

using namespace format;

namespace {
constexpr int kRereads = 4;  // an entry still changing after this many tries is reported unstable
}

std::vector<IndexRecord> scan_index(const Region& region, uint64_t first, uint64_t count,
                                    std::vector<uint64_t>* unstable) {
  const Coherence& coh = region.coh();
  const uint64_t slots = region.slot_mask() + 1;
  if (first > slots) first = slots;
  if (count > slots - first) count = slots - first;
  const uint32_t max_ns = region.header()->max_namespaces;
  std::vector<IndexRecord> out;
  for (uint64_t slot = first; slot < first + count; ++slot) {
    bool settled = false;
    for (int attempt = 0; attempt < kRereads && !settled; ++attempt) {
      const uint64_t w = coh.read(&region.entry(slot)->state);
      // Anything but READY is absent to lookups (EVICTING, WRITING included), so absent here.
      if (entry_state(w) != kReady) {
        settled = true;
        break;
      }
      IndexEntry e;
      if (!region.snapshot(slot, w, &e)) continue;  // changed while copied: read it again
      settled = true;
      if (e.ns_id == 0 || e.ns_id > max_ns) break;  // corrupt: a block of no namespace
      IndexRecord r{};
      r.slot = slot, r.gen = entry_gen(w), r.ns_id = e.ns_id, r.depth = e.depth;
      std::memcpy(r.key, e.key, sizeof r.key);
      out.push_back(r);
    }
    if (!settled && unstable) unstable->push_back(slot);
  }
  return out;
}

}  // namespace cxlkv
