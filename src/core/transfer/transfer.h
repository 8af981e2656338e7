// DeviceTransfers (transfer.cpp), the device-transfer protocol, and its types: a save in two phases,
// whose bytes a device (a GPU's DMA through a registered, UVA-mapped pool) writes between reserve and
// commit, and a load whose blocks are pinned and verified before a device reads them.
//
// Integrity: the checksum of a saved block is computed by the CPU over the pool bytes at commit,
// after the device's copy completed (never over the device's source): it covers the bytes that
// readers will see, with the core's one checksum (XXH3-64, checksum.h). A load is verified over
// the pool bytes while pinned, before the device copy, and rechecked after it: a pinned READY
// block is immutable by protocol, so only a stray writer could change it in between, and the
// recheck turns that into a miss. See docs/ARCHITECTURE.md, "The CUDA data path".
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "allocator.h"
#include "index.h"
#include "quotas.h"
#include "region.h"
#include "store_types.h"

namespace cxlkv {

// One block reserved for a key: an entry in WRITING owned by this node, naming the key, with the
// block recorded. Nobody else reads it, and other puts of the key see it in flight. Without a
// block (with_block false) it is an intent: the entry only, which other puts and reserves of the
// key see in flight, which is never published (commit refuses) and which costs no pool block.
struct Reservation {
  // capped: an intent refused because this node holds DeviceTransfers::intent_cap() of them already.
  enum State : uint8_t { reserved, present, in_flight, failed, committed, aborted, capped };
  State state = failed;
  std::array<uint8_t, 32> key{};
  uint16_t depth = 0;
  uint64_t slot = 0;
  uint32_t gen = 0;
  uint32_t tag = 0;
  uint64_t chunk = 0;
  uint32_t block = 0;
  uint64_t offset = 0;  // payload's offset in the pool (reserved with a block only)
  bool with_block = true;
  QuotaCharge charged;  // what the block was charged to: an abort refunds exactly this
};

// One pinned, verified block of a load.
struct VerifiedBlock {
  uint64_t slot = 0;
  uint64_t word = 0;  // the READY state word it was verified under
  uint32_t pin_index = 0;
  uint64_t offset = 0;  // payload's offset in the pool
  uint64_t length = 0;
  uint64_t checksum = 0;
};

// The device transfers' protocol over the index's steps (Index::claim_entry, claim_block, pin,
// condemn, ...), and the one piece of state it owns: the count of this node's block-less intents
// (reserved, not yet aborted), published into its node area (NodeAreaFixed.intents) so that peers
// and `pool check` see it. It knows no Pool: Pool forwards to it (pool.h), and asks the attachment
// back only through Peers.
class DeviceTransfers {
 public:
  // What only the attachment knows.
  class Peers {
   public:
    // Throws unless the pool is open, not fenced, not inherited through fork() and not truncated.
    virtual void ensure_usable() const = 0;
    // False once the pool's pages are gone (the file shrank, a SIGBUS): releases skip their stores.
    virtual bool mapping_intact() const = 0;
    // Bytes mapped (transfer_ranges covers [0, size())).
    virtual uint64_t size() const = 0;

   protected:
    ~Peers() = default;
  };

  // node_id: this attachment's (1-based, 0 = not attached), owned and changed by the node side;
  // read here, never written.
  DeviceTransfers(Region& region, Index& index, Allocator& allocator, Quotas& quotas, const uint32_t& node_id,
                  Peers& peers)
      : region_(region),
        coh_(region.coh()),
        index_(index),
        allocator_(allocator),
        quotas_(quotas),
        node_id_(node_id),
        peers_(peers) {}

  // The operations of Pool's "device transfers" section (pool.h says what each does).
  void reserve(const NsHandle& ns, const Key& key, uint16_t depth, Reservation* r, bool with_block);
  bool commit(const NsHandle& ns, Reservation* r);
  void abort(const NsHandle& ns, Reservation* r);
  size_t pin_verified(const NsHandle& ns, const Key* keys, size_t n, std::vector<VerifiedBlock>* out);
  size_t recheck(const std::vector<VerifiedBlock>& blocks);
  void unpin_verified(std::vector<VerifiedBlock>* blocks);
  std::vector<std::pair<uint64_t, uint64_t>> transfer_ranges(uint64_t max_bytes, uint64_t page) const;
  // Block-less intents: the cap per node (the creator's share of the index, SharedWords.init) and
  // how many this node holds now.
  uint64_t intent_cap() const;
  uint64_t intents_held() const { return intents_held_.load(std::memory_order_relaxed); }

 private:
  bool verify_block(const VerifiedBlock& b);
  void publish_intents();  // the count into our node area (NodeAreaFixed.intents)
  bool closed() const { return !region_.base(); }
  void release(const std::vector<PinRef>& pins) { index_.release(pins, peers_.mapping_intact()); }
  void count(format::Counter c, uint64_t v = 1) { region_.count(node_id_, c, v); }
  const format::PoolHeader& hdr() const { return *region_.header(); }
  format::IndexEntry* entry(uint64_t slot) const { return region_.entry(slot); }
  uint64_t* block_desc(uint64_t chunk, uint32_t block) const { return region_.block_desc(chunk, block); }
  char* block_payload(const NsHandle& ns, uint64_t chunk, uint32_t block) const {
    return region_.block_payload(ns.geo, chunk, block);
  }

  Region& region_;
  Coherence& coh_;  // region_'s (one owner: the region; reassigned there for the multihost arbiter)
  Index& index_;
  Allocator& allocator_;
  Quotas& quotas_;
  const uint32_t& node_id_;
  Peers& peers_;
  std::atomic<uint64_t> intents_held_{0};  // this node's intents (reserved, not yet aborted)
};

}  // namespace cxlkv
