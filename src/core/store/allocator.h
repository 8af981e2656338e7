// Allocator: the block allocator (allocator.cpp) and device placement's filters over it
// (placement.cpp states the rule). Owns this process's allocation cursors and the pool's stripe
// geometry; the state it allocates lives in the pool (format.h: the chunk map, block descriptors).
//
// Invariants it keeps (format.h, "Chunks and blocks"):
// - A block descriptor is the single source of truth of its block: 0 = free, else USED by a node
//   in an epoch for an index slot, or FENCED by a drainer. A block is handed out only by a claim
//   of its descriptor from 0, and re-checked against the chunk word after the claim (a drained
//   chunk may have been re-carved for another namespace meanwhile).
// - A chunk changes hands only through CARVING (from FREE) or DRAINING (from ACTIVE, every block
//   fenced first); its descriptors are zeroed before it becomes ACTIVE for its new namespace.
// - Cursors are process-local hints: a stale one costs a scan, never a block.
//
// Entry points: alloc_block (the index's claim_block asks for a block) and free_block (the index
// gives one back). The allocator never evicts on its own: when it finds nothing the caller evicts
// (Index::evict_from_queue); only stealing a chunk from another namespace asks the index, through
// Peers::evict_owner, to give up the blocks of the chunk it drains; and a reclaim asks it whether
// an entry still names a dead node's block (Peers::entry_points_back).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "alloc_cursors.h"
#include "region.h"
#include "store_types.h"
#include "striping.h"

namespace cxlkv {

// What the allocator reads of capacity (`pool stats`): blocks of ACTIVE chunks, free and used,
// and the chunk counts.
struct Occupancy {
  uint64_t capacity, free, used, free_chunks, active_chunks;
};

class Allocator {
 public:
  // Who allocates: the node id (1-based, as stored in its low byte) and the low byte of its epoch,
  // stamped into every descriptor and chunk word the allocator claims.
  struct Writer {
    uint8_t node;
    uint8_t epoch8;
  };
  // The store around the allocator, asked only on the slow path that steals a chunk.
  class Peers {
   public:
    // The listed namespaces (Namespaces::handles): who may give up a chunk, and each one's geometry.
    virtual std::vector<NsHandle> namespace_handles() = 0;
    // The index's half of draining a chunk: used block (chunk, block), whose descriptor was read as
    // `desc`, is taken from the entry that owns it (READY, unpinned, pointing back here): the entry
    // is evicted and the descriptor set to `fenced`. False: it cannot be taken now.
    virtual bool evict_owner(uint64_t chunk, uint32_t block, uint64_t desc, uint64_t fenced) = 0;
    // Whether an index entry at `slot` names block (chunk, block) (Index::entry_points_back).
    virtual bool entry_points_back(uint64_t slot, uint64_t chunk, uint32_t block) = 0;

   protected:
    ~Peers() = default;
  };

  Allocator(Region& region, Peers& peers) : region_(region), peers_(peers) {}

  // A free block of `ns` for index slot `slot`, marked USED by `w`: the home chunk first, then a
  // freshly carved chunk, then a freed block of another chunk of `ns`, then a chunk stolen from
  // the namespace that holds the most. False: none (the caller evicts).
  bool alloc_block(Writer w, const NsHandle& ns, uint64_t slot, uint64_t* chunk, uint32_t* block);
  // Gives a block back (its descriptor to 0).
  void free_block(uint64_t chunk, uint32_t block) const;
  Occupancy occupancy();
  // Step 3 of the reclaim of node `dead` (nodes.cpp holds its slot RECLAIMING): a chunk it was
  // carving goes back to FREE, one it was draining is unfenced and goes back to its namespace,
  // and a block it claimed that no index entry points back to is freed.
  void release_of_node(uint8_t dead);

  // --- placement (placement.cpp) -----------------------------------------------------------
  const StripeGeometry& stripes() const { return stripes_; }
  void set_stripes(const StripeGeometry& g) { stripes_ = g; }
  // Whether block `block` of `chunk` lies wholly on ns.device (always, for a handle bound to none).
  bool block_on_device(const NsHandle& ns, uint64_t chunk, uint32_t block) const;
  bool chunk_has_device_blocks(const NsHandle& ns, uint64_t chunk) const;
  // The handle with its blocks placed on `device` only (-1: anywhere). Throws ArgumentError for a
  // device out of range, or a block larger than a stripe (it could never lie on one device); `path`
  // names the pool in the message.
  NsHandle bind_device(const NsHandle& ns, int device, const std::string& path) const;
  // Capacity and use per device (`paths`: one per device, device 0 first) and per namespace.
  std::vector<DeviceUse> device_usage(const std::vector<std::string>& paths);
  std::vector<NamespaceUse> namespace_usage();
  // Cursors and eviction queues are kept per namespace and device binding.
  static uint32_t placement_key(const NsHandle& ns) { return ns.id | (uint32_t(ns.device + 1) << 16); }

 private:
  bool carve_chunk(Writer w, const NsHandle& ns, uint64_t* chunk);
  void init_chunk(const NsHandle& ns, uint64_t chunk);  // caller holds it CARVING
  bool steal_chunk(Writer w, const NsHandle& ns, uint64_t* chunk);
  bool drain_chunk(Writer w, uint64_t chunk, uint64_t active_word, const NsHandle& donor, const NsHandle& ns);
  // noipa in allocator.cpp: a gdb reproducer breaks on it with a condition on `chunk` (rdx).
  bool claim_free_block(const NsHandle& ns, uint64_t chunk, Writer w, uint64_t slot, uint32_t* block,
                        uint32_t start);
  const format::PoolHeader& hdr() const { return *region_.header(); }

  Region& region_;
  Peers& peers_;
  StripeGeometry stripes_{};
  AllocCursors cursors_;  // where allocation starts, per placement key
};

}  // namespace cxlkv
