// Evictor (evictor.h): choosing victims. A big sample sorted once approximates LRU far better
// than a fresh small sample per eviction, at lower cost; a sample is re-validated before use.
#include "evictor.h"

#include <algorithm>

#include "clock.h"

namespace cxlkv {

using namespace format;

std::vector<Evictor::Victim> Evictor::window(uint64_t home) const {
  const Coherence& coh = region_.coh();
  std::vector<Victim> cands;
  for (uint64_t i = 0; i < kMaxProbe; ++i) {
    uint64_t slot = (home + i) & region_.slot_mask();
    uint64_t w = coh.read(&region_.entry(slot)->state);
    if (entry_state(w) == kReady) cands.push_back({coh.read_hint(region_.access(slot)), slot, w});
    if (entry_state(w) == kCondemned) cands.push_back({0, slot, w});  // goes first
  }
  std::sort(cands.begin(), cands.end(), [](const Victim& a, const Victim& b) { return a.access < b.access; });
  return cands;
}

void Evictor::refill_if_stale(uint32_t ns_id, const Accept& accept, Queue& q, bool force) {
  constexpr size_t kVictimSample = 1024;
  constexpr uint64_t kVictimMaxAgeUs = 100'000;
  const Coherence& coh = region_.coh();
  const uint64_t mask = region_.slot_mask();
  uint64_t now = now_mono_us();
  if (!(q.v.empty() || now - q.filled_us > kVictimMaxAgeUs || force)) return;
  q.v.clear();
  uint64_t from = hand_.load(std::memory_order_relaxed);
  uint64_t i = 0;
  for (; i <= mask && q.v.size() < kVictimSample; ++i) {
    uint64_t slot = (from + i) & mask;
    uint64_t w = coh.read(&region_.entry(slot)->state);
    if (entry_state(w) != kReady && entry_state(w) != kCondemned) continue;
    IndexEntry e;
    if (!region_.snapshot(slot, w, &e) || e.ns_id != ns_id) continue;
    if (accept && !accept(e)) continue;
    q.v.push_back({entry_state(w) == kCondemned ? 0 : coh.read_hint(region_.access(slot)), slot, w});
  }
  hand_.store(from + i, std::memory_order_relaxed);
  std::sort(q.v.begin(), q.v.end(), [](const Victim& a, const Victim& b) { return a.access > b.access; });
  q.filled_us = now;
}

bool Evictor::unchanged(const Victim& c) const {
  const Coherence& coh = region_.coh();
  if (coh.read(&region_.entry(c.slot)->state) != c.word) return false;
  if (entry_state(c.word) == kReady && coh.read_hint(region_.access(c.slot)) != c.access) return false;
  return true;
}

}  // namespace cxlkv
