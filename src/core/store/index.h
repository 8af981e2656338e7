// Index: the prefix index (format.h, "Index entry"): open addressing with linear probing over a
// fixed table of one-line entries, keyed by (namespace, full 32-byte key). Owns the index's
// protocol — lookup (find, match_prefix, acquire, get), insert (put: claim_entry, claim_block,
// fill_claimed, each half reused by the device transfers), pins, eviction, and the release of
// entries nobody will finish — and its process-local state: the victim queues (Evictor) and the
// count of lease pins. The state it works on lives in the pool (entries, access hints, pins, block
// descriptors). It knows no Pool: Pool forwards to it (pool.h), and it asks the node side back
// only through Peers (slow paths).
//
// Invariants it keeps (format.h states them; index.cpp and index_evict.cpp implement them):
// - Publication: a writer owns its entry in WRITING (claimed from EMPTY/TOMBSTONE), names the key
//   at once, copies the payload, writes every field, and publishes the state word READY last.
//   Readers see either nothing or a complete block, and believe a snapshot only if the state word
//   is unchanged after it (Region::snapshot).
// - Pins (hazard slots): a reader writes (slot, gen) into its own pin array, fences, and re-reads
//   the state word; an evictor moves READY -> EVICTING with a claim (a full fence), then scans all
//   pin arrays. Either the reader sees EVICTING and backs off, or the evictor sees the pin and puts
//   the entry back: a pinned block is never freed, and no shared counter is incremented.
// - A block leaves an entry only while its descriptor names the entry's slot (USED, slot): it is
//   freed, or handed straight to a new owner, by the one holder of the entry in EVICTING (or by
//   one without a node id, outside any reclaim, the one winner of the tombstone claim); every such release
//   books the block's bytes released to the entry's quota rows (Quotas::release). One step does
//   both, let_go (index_evict.cpp).
// - WRITING and EVICTING entries exist only while their node slot is CLAIMED, ALIVE or
//   RECLAIMING (L4): an entry whose writer is gone is skipped by puts and released (abandoned_by).
// - Lease pins together stay below lease_cap(), so single gets always find a pin slot.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allocator.h"
#include "evictor.h"
#include "pin_slots.h"
#include "quotas.h"
#include "region.h"
#include "store_types.h"

namespace cxlkv {

class Index {
 public:
  // The node side, asked only on slow paths (a WRITING entry of another node, no block found).
  class Peers {
   public:
    // Node `node` (1-based, as an entry names it) can no longer finish what it started.
    virtual bool writer_gone(uint8_t node) = 0;
    // Reclaims the nodes judged dead (nodes.cpp); returns how many.
    virtual uint64_t reap_dead_nodes() = 0;
    // When the last reap pass started (unix ns): puts reap at most every 100 ms.
    virtual uint64_t last_reap_ns() const = 0;
    // False while the last owner of FREE node slot `node` may still have the pool open.
    virtual bool owner_closed(uint8_t node) = 0;

   protected:
    ~Peers() = default;
  };
  // Where a key was found: its slot, the READY state word read, and a snapshot of the entry.
  struct Found {
    uint64_t slot;
    uint64_t word;
    format::IndexEntry e;
  };
  // An entry claimed in WRITING by claim_entry, for claim_block and fill_claimed.
  struct Claimed {
    uint64_t slot;
    uint32_t gen;
    uint32_t tag;
  };

  // node_id, node_word: who this attachment is (1-based node id, 0 = not attached; its node slot
  // word), owned and changed by the node side (attach, detach); read here, never written.
  Index(Region& region, Allocator& allocator, Quotas& quotas, const uint32_t& node_id,
        const uint64_t& node_word, Peers& peers)
      : region_(region),
        coh_(region.coh()),
        allocator_(allocator),
        quotas_(quotas),
        node_id_(node_id),
        node_word_(node_word),
        peers_(peers) {}

  // How far this process's pins reach in its node's pin array: detach clears them up to here.
  uint64_t pin_high_water() const { return pin_slots_.high_water(); }

  // --- block operations (index.cpp) --------------------------------------------------------
  // put: true if the key is readable afterwards (stored now or already there); false if it is
  // only in flight by another live writer, or no block could be allocated or evicted.
  PutResult put_ex(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth);
  bool put(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth);
  // get: scatter the payload into dst pieces (total >= length); false on miss or checksum failure.
  bool get(const NsHandle& ns, const Key& key, const Piece* dst, size_t n, uint64_t* length);
  bool contains(const NsHandle& ns, const Key& key);
  size_t match_prefix(const NsHandle& ns, const Key* keys, size_t n);
  bool remove(const NsHandle& ns, const Key& key);
  // Where the payload of `key` lies: pool offset and length; false if absent.
  bool locate(const NsHandle& ns, const Key& key, uint64_t* offset, uint64_t* length);
  // acquire: pins the leading present keys, as lease pins (lease_cap).
  std::vector<PinRef> acquire(const NsHandle& ns, const Key* keys, size_t n);
  // Releases lease pins; `intact`: the pool's pages are still there (else the pins died with them).
  void release(const std::vector<PinRef>& pins, bool intact);
  uint32_t lease_cap() const;
  uint32_t get_pin_reserve() const;

  // --- the protocol's steps, for the device transfers and check (transfer.cpp, check.cpp) ----
  // hash: key_hash64(key, ns) or null; home_word: the home slot's state word as read a moment ago by
  // read_homes (snapshot re-checks it before anything is believed), or null to read it here.
  bool find(const NsHandle& ns, const Key& key, const uint64_t* hash, Found* out,
            const uint64_t* home_word = nullptr);
  // for_lease: the pin outlives the call (acquire); sets *exhausted when no slot is left.
  bool pin(uint64_t slot, uint64_t word, PinRef* out, bool* exhausted, bool for_lease);
  void unpin(const PinRef& p);
  bool is_pinned(uint64_t slot, uint32_t gen);
  void touch(uint64_t slot, uint16_t depth);
  // The entry's block lies in an ACTIVE (or DRAINING) chunk of `ns`, within its geometry.
  bool validate_ref(const NsHandle& ns, const format::IndexEntry& e) const;
  // First half of put (and of reserve): an entry for `key` in WRITING, owned by this node and
  // naming the key, or why not (present, in flight elsewhere, no slot).
  PutResult claim_entry(const NsHandle& ns, const Key& key, uint16_t depth, Claimed* out);
  // A block for the WRITING entry `slot`, recorded in the entry. None: the entry is tombstoned.
  // *charged (if given): the quota rows the block was charged to, for a refund by the caller.
  bool claim_block(const NsHandle& ns, uint64_t slot, uint32_t gen, uint32_t tag, uint64_t* chunk,
                   uint32_t* block, QuotaCharge* charged = nullptr);
  // Frees the block of an entry this node holds in EVICTING (or WRITING) and tombstones the slot.
  void finish_evict(uint64_t slot, uint64_t evicting_word);
  void condemn(uint64_t slot, uint64_t ready_word);
  // `as`: inside the reclaim of node `as`, the id to hold a released entry EVICTING under (0: this
  // node's own; index_evict.cpp says why).
  bool reclaim_condemned(uint64_t slot, uint8_t as = 0);
  // Entries nobody will finish (index_evict.cpp): why (or ""), and their release.
  std::string abandoned_by(uint64_t slot, uint64_t word, bool by_epoch);
  bool release_abandoned(uint64_t slot, uint64_t word, uint8_t as = 0);
  // The reclaim of node `dead` (nodes.cpp), the index's part: its entries and the abandoned ones.
  void release_of_node(uint8_t dead);
  // An entry at `slot` names block (chunk, block) (Allocator::Peers::entry_points_back).
  bool entry_points_back(uint64_t slot, uint64_t chunk, uint32_t block);
  // The index's half of draining a chunk (Allocator::Peers::evict_owner, which Pool forwards here).
  bool evict_owner(uint64_t chunk, uint32_t block, uint64_t desc, uint64_t fenced);

 private:
  using Victim = Evictor::Victim;
  bool tombstone_then_free(uint64_t slot, uint64_t word);  // release_abandoned for an observer
  // The descriptor of the block entry e names, with its word as read; d null if (chunk, block)
  // lie outside the pool (the pool is untrusted input).
  struct BlockDesc {
    uint64_t* d = nullptr;
    uint64_t word = 0;
    // The block is still entry `slot`'s: its descriptor reads USED for that slot.
    bool names(uint64_t slot) const {
      return d && format::block_state(word) == format::kBlockUsed && format::block_slot(word) == slot;
    }
  };
  BlockDesc read_desc(const format::IndexEntry& e) const;
  // How a block leaves its entry (let_go): by publish for the one holder of the entry in EVICTING,
  // by a claim from the word read where another writer of the descriptor may be beside us.
  enum class Write { publish, claim };
  // The one step by which a block leaves entry `slot` (invariant above): see index_evict.cpp.
  bool let_go(uint64_t slot, const format::IndexEntry& e, BlockDesc desc, uint64_t to, Write how);
  void read_homes(const NsHandle& ns, const Key* keys, size_t n, std::vector<uint64_t>& hashes,
                  std::vector<uint64_t>& home_words);
  bool writing_same_key(const NsHandle& ns, const Key& key, uint64_t slot, uint64_t writing_word);
  bool fill_claimed(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth,
                    uint64_t total, uint64_t slot, uint32_t gen, uint32_t tag);
  bool copy_out(const NsHandle& ns, const Found& f, const Piece* dst, size_t n);
  bool evict_in_window(uint64_t home);
  bool evict_from_queue(const NsHandle& ns, uint64_t* out_chunk, uint32_t* out_block,
                        uint64_t new_owner_slot);
  bool evict_victim(const Victim& c, const NsHandle* ns, uint64_t* out_chunk, uint32_t* out_block,
                    uint64_t new_owner_slot);
  // A put about to take a block (claim_block): charged to its entry's quota rows, evicting the
  // subject's own blocks while over (index_evict.cpp). False: over quota, nothing of its own to evict.
  bool quota_admit(const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block, bool* got,
                   QuotaCharge* charged);
  bool snapshot(uint64_t slot, uint64_t word, format::IndexEntry* out) const {
    return region_.snapshot(slot, word, out);
  }
  bool alloc_pin(uint32_t* idx) {
    return pin_slots_.alloc(idx, hdr().pin_slots, [this](uint64_t hw) {
      coh_.publish(&region_.node_fixed(node_id_ - 1)->pin_hw, hw);
    });
  }
  void free_pin(uint32_t idx) { pin_slots_.free(idx); }
  void count(format::Counter c, uint64_t v = 1) { region_.count(node_id_, c, v); }
  uint8_t my_epoch8() const { return uint8_t(format::node_epoch(node_word_)); }
  Allocator::Writer writer() const { return {uint8_t(node_id_), my_epoch8()}; }
  const format::PoolHeader& hdr() const { return *region_.header(); }
  uint64_t slot_mask() const { return region_.slot_mask(); }
  format::IndexEntry* entry(uint64_t slot) const { return region_.entry(slot); }
  uint64_t* access(uint64_t slot) const { return region_.access(slot); }
  uint64_t* block_desc(uint64_t chunk, uint32_t block) const { return region_.block_desc(chunk, block); }
  char* block_payload(const NsHandle& ns, uint64_t chunk, uint32_t block) const {
    return region_.block_payload(ns.geo, chunk, block);
  }

  Region& region_;
  Coherence& coh_;  // region_'s (one owner: the region; reassigned there for the multihost arbiter)
  Allocator& allocator_;
  Quotas& quotas_;
  PinSlots pin_slots_;  // this process's pin indexes over its node's pin array (pin_slots.h)
  const uint32_t& node_id_;
  const uint64_t& node_word_;
  Peers& peers_;
  Evictor evictor_{region_};             // chooses victims (evictor.h); evict_victim carries them out
  std::atomic<uint64_t> lease_pins_{0};  // pins held by this process's leases (see lease_cap)
};

}  // namespace cxlkv
