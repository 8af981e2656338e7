// Region: the mapped pool as the protocols see it. Owns where it is (base), what shape it has
// (the header, validated once and copied out of shared memory: F1), the geometry derived from
// that copy, and the coherence layer every protocol goes through. Its accessors are the only way
// to turn a number read from the pool into an address: each checks the number against the
// validated copy first (the pool is untrusted input), and throws CorruptError when it is out of
// range. Knows nothing of nodes, namespaces or keys beyond the layout of format.h.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "coherence.h"
#include "format.h"
#include "header_checksum.h"  // format::header_checksum: written by commit_new_pool, checked here

namespace cxlkv {

class Region {
 public:
  // Validates the header at b (the first `mapped` bytes of a pool) and adopts it: the private
  // copy, the geometry and the coherence backend it names. Throws FormatError (not a pool, or an
  // impossible geometry), VersionError, TruncatedError or NotReadyError; `path` names the pool in
  // the message. read_only: features this build may only read (ro_compat) are accepted. model:
  // the cache model of an emulated host (tests), or null. feature_check (optional): the caller's
  // validation of a format feature it owns (the stripe table), run on the private copy after the
  // incompat check and before the size check.
  void adopt(char* b, uint64_t mapped, const std::string& path, bool read_only, CacheModel* model,
             const std::function<void(const format::PoolHeader&)>& feature_check = {});
  // The checks of a header copy that hold before anything of the pool is mapped (adopt runs them
  // too; a striped pool's opener runs them on device 0's copy before it maps a stripe): the
  // version, the header size, the checksum. The magic is the caller's (its message says what the
  // bytes are instead). Throws VersionError or FormatError naming `path`.
  static void check_header(const format::PoolHeader& h, const std::string& path);
  // Forgets the mapping (close, abandon): base() and header() are null afterwards.
  void reset() {
    base_ = nullptr;
    hdr_ = nullptr;
  }

  char* base() const { return base_; }
  // The private validated copy (null while nothing is adopted); hdr_ points at hdr_copy_.
  const format::PoolHeader* header() const { return hdr_; }
  const format::PoolHeader* const& header_ref() const { return hdr_; }  // for Pool's hdr_ alias
  Coherence& coh() { return coh_; }
  const Coherence& coh() const { return coh_; }
  const uint64_t& slot_mask() const { return slot_mask_; }    // index_slots - 1
  const uint64_t& desc_bytes() const { return desc_bytes_; }  // a chunk's descriptor bytes
  uint64_t chunk_stride() const { return chunk_stride_; }     // descriptors + payload of a chunk

  // Bounds-checked accessors: throw CorruptError on an out-of-range value read from the pool.
  format::NodeSlot* node_slot(uint32_t idx) const;
  char* node_area(uint32_t idx) const;
  format::NodeAreaFixed* node_fixed(uint32_t idx) const {
    return reinterpret_cast<format::NodeAreaFixed*>(node_area(idx));
  }
  uint64_t* pins(uint32_t idx) const {
    return reinterpret_cast<uint64_t*>(node_area(idx) + sizeof(format::NodeAreaFixed));
  }
  format::NamespaceEntry* ns_entry(uint32_t id) const;  // 1-based id
  // Index slots wrap by the mask, so any 64-bit value names a slot of the table.
  format::IndexEntry* entry(uint64_t slot) const { return entries_ + (slot & slot_mask_); }
  uint64_t* access(uint64_t slot) const { return access_ + (slot & slot_mask_); }
  uint64_t* chunk_word(uint64_t chunk) const;
  uint64_t* block_desc(uint64_t chunk, uint32_t block) const;
  // geo: the namespace's chunk geometry (its block count bounds `block`).
  char* block_payload(const format::ChunkGeometry& geo, uint64_t chunk, uint32_t block) const;
  format::SharedWords* shared() const {
    return reinterpret_cast<format::SharedWords*>(base_ + format::kSharedWordsOff);
  }

  // Adds v to counter c of node `node_id` (1-based; the node's own line: Coherence::bump_owned).
  // Nothing while closed, or for node 0 (an observer without a node slot counts nothing).
  void count(uint32_t node_id, format::Counter c, uint64_t v = 1) {
    if (!base_ || !node_id) return;
    coh_.bump_owned(&node_fixed(node_id - 1)->counters[c], v);
  }

  // A consistent copy of index entry `slot` in the version whose state word the caller read as
  // `word` (coherence.h: snapshot); out->state = word. False: the entry moved, discard *out.
  bool snapshot(uint64_t slot, uint64_t word, format::IndexEntry* out) const;

 private:
  char* base_ = nullptr;
  const format::PoolHeader* hdr_ = nullptr;  // &hdr_copy_ once adopted
  format::PoolHeader hdr_copy_{};
  Coherence coh_;
  format::IndexEntry* entries_ = nullptr;
  uint64_t* access_ = nullptr;
  uint64_t slot_mask_ = 0;
  uint64_t chunk_stride_ = 0;
  uint64_t desc_bytes_ = 0;
};

}  // namespace cxlkv
