// Index (index.h): lookup, insert and pins. Open addressing with linear probing over a fixed table
// of one-line entries, keyed by (namespace, full 32-byte key); format.h has the entry state
// machine and index.h the invariants (publication, pins). Eviction and the release of entries
// nobody will finish are in index_evict.cpp.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>

#include "checksum.h"
#include "clock.h"
#include "errors.h"
#include "index.h"
#include "key_hash.h"

namespace cxlkv {

using namespace format;

namespace {
inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

bool Index::find(const NsHandle& ns, const Key& key, const uint64_t* hash, Found* out,
                 const uint64_t* home_word) {
  KeyHash kh = hash ? key_hash_split(*hash, slot_mask()) : key_hash(key.data(), ns.id, slot_mask());
  for (uint32_t i = 0; i < kMaxProbe; ++i) {
    uint64_t slot = (kh.home + i) & slot_mask();
    uint64_t w = i == 0 && home_word ? *home_word : coh_.read(&entry(slot)->state);
    uint8_t st = entry_state(w);
    if (st == kEmpty) return false;
    if (st == kEvicting && entry_tag(w) == kh.tag) {
      // An evictor is checking pins (microseconds): it may well put the entry back to READY,
      // e.g. when a lease pins it. Wait a little rather than report a false miss.
      for (int spin = 0; spin < 2000 && entry_state(w) == kEvicting; ++spin) {
        cpu_relax();
        w = coh_.read(&entry(slot)->state);
      }
      st = entry_state(w);
    }
    if (st != kReady || entry_tag(w) != kh.tag) continue;
    IndexEntry e;
    bool stable = false;
    for (int t = 0; t < 4 && !stable; ++t) {
      stable = snapshot(slot, w, &e);
      if (!stable) {
        w = coh_.read(&entry(slot)->state);
        if (entry_state(w) != kReady) break;
      }
    }
    if (!stable) continue;
    if (e.ns_id == ns.id && std::memcmp(e.key, key.data(), 32) == 0) {
      out->slot = slot;
      out->word = w;
      out->e = e;
      return true;
    }
  }
  return false;
}

// for_lease: the pin outlives the call (acquire); lease pins together stay below lease_cap(),
// so gets keep get_pin_reserve() slots of headroom. Sets *exhausted when no slot is left.
bool Index::pin(uint64_t slot, uint64_t word, PinRef* out, bool* exhausted, bool for_lease) {
  uint32_t idx;
  if (for_lease && lease_pins_.fetch_add(1, std::memory_order_relaxed) >= lease_cap()) {
    lease_pins_.fetch_sub(1, std::memory_order_relaxed);
    *exhausted = true;
    count(kPinsExhausted);
    return false;
  }
  if (!alloc_pin(&idx)) {
    if (for_lease) lease_pins_.fetch_sub(1, std::memory_order_relaxed);
    *exhausted = true;
    count(kPinsExhausted);
    return false;
  }
  uint64_t* p = &region_.pins(node_id_ - 1)[idx];
  coh_.publish(p, pin_value(slot, entry_gen(word)));
  coh_.fence();  // the pin store must be visible before we re-check the state
  if (coh_.read(&entry(slot)->state) != word) {
    coh_.publish(p, 0);
    free_pin(idx);
    if (for_lease) lease_pins_.fetch_sub(1, std::memory_order_relaxed);
    return false;
  }
  *out = PinRef{slot, entry_gen(word), idx};
  return true;
}

void Index::unpin(const PinRef& p) {
  coh_.publish(&region_.pins(node_id_ - 1)[p.pin_index], 0);
  free_pin(p.pin_index);
}

bool Index::is_pinned(uint64_t slot, uint32_t gen) {
  const uint64_t v = pin_value(slot, gen);
  for (uint32_t i = 0; i < hdr().max_nodes; ++i) {
    if (node_state(coh_.read(&region_.node_slot(i)->state)) == kNodeFree) continue;
    uint64_t hw = std::min<uint64_t>(coh_.read(&region_.node_fixed(i)->pin_hw), hdr().pin_slots);
    const uint64_t* p = region_.pins(i);
    coh_.invalidate(p, hw * 8);
    for (uint64_t k = 0; k < hw; ++k)
      if (coh_.read_hint(&p[k]) == v) return true;
  }
  return false;
}

// Access hint = [time in ms : 48][0xFFFF - depth : 16]. Eviction takes the smallest: the least
// recently used time first and, within one time, the deepest block of its chain first. Batch
// operations (store, load, match_prefix, acquire) stamp all their keys with one time, so a chain
// touched together loses its tail before its head, and older chains go before newer ones.
namespace {
thread_local uint64_t t_batch_ms = 0;
inline uint64_t access_hint(uint64_t ms, uint16_t depth) { return (ms << 16) | uint64_t(0xFFFF - depth); }
}  // namespace
AccessStamp::AccessStamp(uint64_t ms) : prev_(t_batch_ms) { t_batch_ms = ms ? ms : now_mono_us() / 1000; }
AccessStamp::~AccessStamp() { t_batch_ms = prev_; }
uint64_t AccessStamp::current() { return t_batch_ms; }

void Index::touch(uint64_t slot, uint16_t depth) {
  uint64_t ms = t_batch_ms ? t_batch_ms : now_mono_us() / 1000;
  uint64_t v = access_hint(ms, depth);
  if (coh_.read_hint(access(slot)) != v) coh_.write_hint(access(slot), v);
}

bool Index::validate_ref(const NsHandle& ns, const IndexEntry& e) const {
  if (e.chunk >= hdr().chunk_count || e.block >= ns.geo.blocks || e.length > ns.block_bytes) return false;
  uint64_t w = coh_.read(region_.chunk_word(e.chunk));
  // DRAINING: the chunk may change hands, but only after this entry is evicted, which a pin
  // prevents; so its READY entries are still valid to read.
  return (chunk_state(w) == kChunkActive || chunk_state(w) == kChunkDraining) && chunk_ns(w) == ns.id;
}

bool Index::locate(const NsHandle& ns, const Key& key, uint64_t* offset, uint64_t* length) {
  Found f;
  if (!find(ns, key, nullptr, &f) || !validate_ref(ns, f.e)) return false;
  *offset = uint64_t(block_payload(ns, f.e.chunk, f.e.block) - region_.base());
  *length = f.e.length;
  return true;
}

bool Index::put(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth) {
  PutResult r = put_ex(ns, key, src, n, depth);
  return r == PutResult::stored || r == PutResult::present;
}

// A WRITING entry holds a stored block of nobody: it is this key in flight only if its writer
// is alive and it names this key (key and ns_id are written right after the claim). A dead
// writer's entry is skipped and, at most every 100 ms, reaped (F10).
bool Index::writing_same_key(const NsHandle& ns, const Key& key, uint64_t slot, uint64_t w) {
  uint8_t node = entry_node(w);
  if (node == 0 || node > hdr().max_nodes) return false;
  if (peers_.writer_gone(node)) {
    if (now_unix_ns() - peers_.last_reap_ns() > 100'000'000) peers_.reap_dead_nodes();
    return false;
  }
  IndexEntry e;
  snapshot(slot, w, &e);  // fields of a WRITING entry: only key and ns_id matter, written once
  return e.ns_id == ns.id && std::memcmp(e.key, key.data(), 32) == 0;
}

PutResult Index::put_ex(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    if (__builtin_add_overflow(total, src[i].bytes, &total)) total = ~0ull;
  }
  if (total > ns.block_bytes)
    throw ArgumentError("payload of " + std::to_string(total) + " bytes exceeds the namespace block size " +
                        std::to_string(ns.block_bytes));
  Claimed c;
  PutResult r = claim_entry(ns, key, depth, &c);
  if (r != PutResult::stored) return r;
  try {
    return fill_claimed(ns, key, src, n, depth, total, c.slot, c.gen, c.tag) ? PutResult::stored
                                                                             : PutResult::failed;
  } catch (...) {
    finish_evict(c.slot, make_entry_word(kWriting, uint8_t(node_id_), c.gen, c.tag));  // never leave a
    throw;                                                                             // WRITING entry behind
  }
}

// First half of put() (and of reserve(), transfer.cpp): an entry for `key` in WRITING, owned by
// this node and naming the key, or why not (present, in flight elsewhere, no slot).
PutResult Index::claim_entry(const NsHandle& ns, const Key& key, uint16_t depth, Claimed* out) {
  KeyHash kh = key_hash(key.data(), ns.id, slot_mask());
  for (int attempt = 0; attempt < 16; ++attempt) {
    uint64_t reuse = ~0ull, reuse_word = 0;
    for (uint32_t i = 0; i < kMaxProbe; ++i) {
      uint64_t slot = (kh.home + i) & slot_mask();
      uint64_t w = coh_.read(&entry(slot)->state);
      uint8_t st = entry_state(w);
      if (st == kEmpty || st == kTombstone) {
        if (reuse == ~0ull) reuse = slot, reuse_word = w;
        if (st == kEmpty) break;
        continue;
      }
      if (entry_tag(w) != kh.tag) continue;
      if (st == kWriting && writing_same_key(ns, key, slot, w)) {
        count(kPutsInFlight);
        return PutResult::in_flight;
      }
      IndexEntry e;
      if (st == kReady && snapshot(slot, w, &e) && e.ns_id == ns.id && !std::memcmp(e.key, key.data(), 32)) {
        touch(slot, depth);
        count(kPutsPresent);
        return PutResult::present;
      }
    }
    if (reuse == ~0ull) {
      // The whole probe window is occupied: evict its best victim (any namespace).
      if (!evict_in_window(kh.home)) {
        count(kPutsFailed);
        return PutResult::failed;
      }
      continue;
    }
    const uint32_t gen = (entry_gen(reuse_word) + 1) & 0xFFFFFF;
    const uint64_t writing = make_entry_word(kWriting, uint8_t(node_id_), gen, kh.tag);
    if (!coh_.claim(&entry(reuse)->state, reuse_word, writing)) continue;
    {  // name the key at once, so that other puts of it see it in flight (format.h)
      IndexEntry* e = entry(reuse);
      coh_.check_fence();  // multihost: before plain stores (a dirty line reaches memory anyway)
      std::memcpy(e->key, key.data(), 32);
      e->ns_id = uint16_t(ns.id);
      e->tenant_row = ns.tenant_row;  // format/quota.h: whom the block is charged to
      e->ns_row = quotas_.ns_row(ns.id);
      e->chunk = kNoChunk, e->block = 0;  // no block yet: never the slot's previous one
      coh_.flush(e, sizeof *e);
      coh_.fence();
      coh_.fault("insert.claimed");
    }
    auto abandon = [&] {
      IndexEntry* e = entry(reuse);
      coh_.publish(&e->state, make_entry_word(kTombstone, 0, gen, kh.tag));
    };
    // Two nodes may have claimed slots for the same key at once: the earlier probe position wins.
    PutResult lost = PutResult::stored;
    for (uint32_t i = 0; i < kMaxProbe && lost == PutResult::stored; ++i) {
      uint64_t slot = (kh.home + i) & slot_mask();
      if (slot == reuse) continue;
      uint64_t w = coh_.read(&entry(slot)->state);
      uint8_t st = entry_state(w);
      if (st == kEmpty) break;
      if (entry_tag(w) != kh.tag) continue;
      bool before = ((slot - kh.home) & slot_mask()) < ((reuse - kh.home) & slot_mask());
      IndexEntry o;
      if (st == kWriting && before && writing_same_key(ns, key, slot, w)) lost = PutResult::in_flight;
      if (st == kReady && snapshot(slot, w, &o) && o.ns_id == ns.id && !std::memcmp(o.key, key.data(), 32))
        lost = PutResult::present;
    }
    if (lost != PutResult::stored) {
      abandon();
      count(lost == PutResult::present ? kPutsPresent : kPutsInFlight);
      return lost;
    }
    *out = Claimed{reuse, gen, kh.tag};
    return PutResult::stored;
  }
  count(kPutsFailed);
  return PutResult::failed;
}

// A block for the WRITING entry `slot` (allocated, else evicted, else after reaping the dead),
// recorded in the entry at once so that a reclaimer finds it. None: the entry is tombstoned.
bool Index::claim_block(const NsHandle& ns, uint64_t slot, uint32_t gen, uint32_t tag, uint64_t* chunk,
                        uint32_t* block, QuotaCharge* charged) {
  IndexEntry* e = entry(slot);
  bool got = false;
  QuotaCharge charge;
  // quota_admit (index_evict.cpp): charged to the entry's quota rows; over quota with nothing of its own to
  // evict: none
  if (!quota_admit(ns, slot, chunk, block, &got, &charge)) {
    coh_.publish(&e->state, make_entry_word(kTombstone, 0, gen, tag));
    return false;
  }
  if (!got) got = allocator_.alloc_block(writer(), ns, slot, chunk, block);
  if (!got) got = evict_from_queue(ns, chunk, block, slot);
  if (!got && now_unix_ns() - peers_.last_reap_ns() > 100'000'000) {
    // Dead nodes may hold pins or blocks: reclaim them, then try both paths again.
    if (peers_.reap_dead_nodes() > 0)
      got = allocator_.alloc_block(writer(), ns, slot, chunk, block) ||
            evict_from_queue(ns, chunk, block, slot);
  }
  if (!got) {
    quotas_.refund(node_id_, charge, ns.block_bytes);  // quotas.cpp
    coh_.publish(&e->state, make_entry_word(kTombstone, 0, gen, tag));
    count(kPutsFailed);
    return false;
  }
  if (charged) *charged = charge;
  coh_.check_fence();
  e->chunk = uint32_t(*chunk);  // written early so a reclaimer can find the block
  e->block = uint16_t(*block);
  coh_.flush(e, sizeof *e);
  return true;
}

// Second half of put(): this node owns `slot` in WRITING. Allocates a block (evicting if
// needed), copies and checksums the payload, and publishes READY.
bool Index::fill_claimed(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth,
                         uint64_t total, uint64_t slot, uint32_t gen, uint32_t tag) {
  IndexEntry* e = entry(slot);
  const uint64_t reuse = slot;
  {  // (scope kept flat for readability of the publication order below)
    uint64_t chunk = 0;
    uint32_t block = 0;
    if (!claim_block(ns, slot, gen, tag, &chunk, &block)) return false;
    char* dst = block_payload(ns, chunk, block);
    Checksum hs;  // over the bytes written to the pool, not a second read of the caller's buffer
    for (size_t i = 0; i < n; ++i) {
      const bool more = i + 1 < n;  // the next fragment's source streams in beside this one's
      hs.update_copy(dst, src[i].ptr, src[i].bytes, more ? src[i + 1].ptr : nullptr,
                     more ? src[i + 1].bytes : 0);
      dst += src[i].bytes;
    }
    coh_.stream_fence();  // payload reaches memory before the entry can say READY
    coh_.stream_written(block_payload(ns, chunk, block), total);
    coh_.fault("insert.copied");
    coh_.check_fence();
    e->depth = depth;
    e->length = uint32_t(total);
    e->checksum = hs.digest();
    coh_.flush(e, sizeof *e);
    coh_.publish(&e->state, make_entry_word(kReady, 0, gen, tag));  // commit: written last
    touch(reuse, depth);
    count(kPuts);
    count(kBytesStored, total);
    return true;
  }
}

bool Index::copy_out(const NsHandle& ns, const Found& f, const Piece* dst, size_t n) {
  const char* src = block_payload(ns, f.e.chunk, f.e.block);
  uint64_t left = f.e.length;
  coh_.invalidate(src, left);
  // Each pool line is read once into an L1 bounce buffer, hashed there and streamed from there
  // into the caller's buffer (no read-for-ownership of its lines), so the checksum covers the
  // very bytes delivered: a concurrent writer of the pool block yields a mismatch, never wrong
  // bytes that pass (F2).
  Checksum hs;
  for (size_t i = 0; i < n && left; ++i) {
    uint64_t take = std::min<uint64_t>(dst[i].bytes, left);
    const uint64_t next = i + 1 < n ? std::min<uint64_t>(dst[i + 1].bytes, left - take) : 0;
    hs.update_copy(dst[i].ptr, src, take, src + take, next);
    src += take;
    left -= take;
  }
  coh_.stream_fence();
  return left == 0 && hs.digest() == f.e.checksum;
}

bool Index::get(const NsHandle& ns, const Key& key, const Piece* dst, size_t n, uint64_t* length) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    Found f;
    if (!find(ns, key, nullptr, &f)) break;
    if (!validate_ref(ns, f.e)) {
      count(kCorruptEntries);
      break;
    }
    uint64_t cap = 0;
    for (size_t i = 0; i < n; ++i) cap += dst[i].bytes;
    if (cap < f.e.length)
      throw ArgumentError("output buffer of " + std::to_string(cap) + " bytes is smaller than the block (" +
                          std::to_string(f.e.length) + " bytes)");
    PinRef p;
    bool exhausted = false;
    if (!pin(f.slot, f.word, &p, &exhausted, /*for_lease=*/false)) {
      if (exhausted) break;  // counted in pin(); retrying cannot free a slot
      continue;              // being evicted right now
    }
    bool ok = copy_out(ns, f, dst, n);
    if (!ok) {
      count(kChecksumFailures);
      condemn(f.slot, f.word);  // while pinned: readers of other nodes may hold pins too
    }
    unpin(p);
    if (!ok) {
      reclaim_condemned(f.slot);
      break;
    }
    touch(f.slot, f.e.depth);
    count(kHits);
    count(kBytesLoaded, f.e.length);
    if (length) *length = f.e.length;
    return true;
  }
  count(kMisses);
  return false;
}

bool Index::contains(const NsHandle& ns, const Key& key) {
  Found f;
  return find(ns, key, nullptr, &f);
}

// Batched lookups (match_prefix, acquire): hash every key and prefetch its home line and
// access-hint line first, then read every home slot's state word in a loop of independent loads,
// so that the misses of a long prefix overlap (the walk that follows, one key after another,
// would keep only a few in flight: its loads wait on branches over the previous key's entry).
// Measured on a 2-core KVM guest: software prefetches alone leave ~10% of 256 random lines
// uncached (dropped), which the dependent walk then pays in full; the loads of the gather do not
// drop. See BENCHMARKS.md (index).
void Index::read_homes(const NsHandle& ns, const Key* keys, size_t n, std::vector<uint64_t>& hashes,
                       std::vector<uint64_t>& home_words) {
  hashes.resize(n);
  home_words.resize(n);
  for (size_t i = 0; i < n; ++i) {
    hashes[i] = key_hash64(keys[i].data(), ns.id);
    __builtin_prefetch(entry(hashes[i] & slot_mask()), 0, 3);
    __builtin_prefetch(access(hashes[i] & slot_mask()), 1, 3);  // touch() writes it afterwards
  }
  for (size_t i = 0; i < n; ++i) {
    const uint64_t home = hashes[i] & slot_mask(), w = coh_.read(&entry(home)->state);
    home_words[i] = w;
    // A key not at home (its home holds another tag, a tombstone, a writer) is probed on at the
    // next slot: another line, so prefetch it now. Branch-free: the home line itself otherwise.
    const uint8_t st = entry_state(w);
    const bool on = st != kEmpty && !(st == kReady && entry_tag(w) == key_tag(hashes[i]));
    __builtin_prefetch(entry((home + on) & slot_mask()), 0, 3);
  }
}

size_t Index::match_prefix(const NsHandle& ns, const Key* keys, size_t n) {
  AccessStamp stamp;
  const uint64_t ms = AccessStamp::current();
  thread_local std::vector<uint64_t> hashes, home_words;
  read_homes(ns, keys, n, hashes, home_words);
  thread_local std::vector<uint64_t> slots;
  slots.clear();
  for (size_t m = 0; m < n; ++m) {
    // Fast path, the common case: the key is READY at its home. Its key and ns_id are compared in
    // place (a seqlock compare of the entry's head, Coherence::snapshot_matches) and believed only
    // if the state word is unchanged afterwards; anything else takes find()'s full probe.
    const uint64_t home = hashes[m] & slot_mask(), w = home_words[m];
    if (entry_state(w) == kReady && entry_tag(w) == key_tag(hashes[m])) {
      IndexEntry* e = entry(home);
      static_assert(offsetof(IndexEntry, key) == 8 && offsetof(IndexEntry, ns_id) == 40);
      uint64_t expect[5] = {0, 0, 0, 0, ns.id};  // key words, then [chunk:32][rows:16][ns_id:16] (LE)
      std::memcpy(expect, keys[m].data(), 32);
      static constexpr uint64_t kMask[5] = {~0ull, ~0ull, ~0ull, ~0ull, 0xFFFFull};  // ns_id:16 (format 3)
      if (coh_.snapshot_matches(e->key, expect, kMask, 5, &e->state, w)) {
        slots.push_back(home);
        continue;
      }
    }
    Found f;
    if (!find(ns, keys[m], &hashes[m], &f, &home_words[m])) break;
    slots.push_back(f.slot);
  }
  for (size_t i = 0; i < slots.size(); ++i) {  // touch(), with the batch's one time
    uint64_t* a = access(slots[i]);
    const uint64_t v = access_hint(ms, uint16_t(std::min<size_t>(i, 0xFFFF)));
    if (coh_.read_hint(a) != v) coh_.write_hint(a, v);
  }
  return slots.size();
}

uint32_t Index::lease_cap() const { return hdr().pin_slots - get_pin_reserve(); }
uint32_t Index::get_pin_reserve() const {
  // Single gets (and load's per-key gets on up to copy_threads threads) must always find a pin
  // slot, whatever leases hold: keep 1/8 of the slots, at least 1 and at most 64, for them.
  return std::clamp<uint32_t>(hdr().pin_slots / 8, 1, 64);
}

std::vector<PinRef> Index::acquire(const NsHandle& ns, const Key* keys, size_t n) {
  AccessStamp stamp;
  std::vector<PinRef> out;
  thread_local std::vector<uint64_t> hashes, home_words;
  read_homes(ns, keys, n, hashes, home_words);
  for (size_t i = 0; i < n; ++i) {
    Found f;
    PinRef p;
    bool ok = false, exhausted = false;
    for (int attempt = 0; attempt < 3 && !ok && !exhausted; ++attempt) {
      if (!find(ns, keys[i], &hashes[i], &f, attempt == 0 ? &home_words[i] : nullptr)) break;
      ok = pin(f.slot, f.word, &p, &exhausted, /*for_lease=*/true);
    }
    if (!ok) break;
    touch(f.slot, uint16_t(std::min<size_t>(i, 0xFFFF)));
    out.push_back(p);
  }
  return out;
}

void Index::release(const std::vector<PinRef>& pins, bool intact) {
  // On a shrunk file the pins' pages are gone (a store would be a SIGBUS once no handler of ours
  // is installed, e.g. at interpreter exit); the pins died with them.
  if (intact)
    for (const PinRef& p : pins) unpin(p);
  lease_pins_.fetch_sub(pins.size(), std::memory_order_relaxed);
}

}  // namespace cxlkv
