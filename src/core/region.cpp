// Region (region.h): validating and adopting a mapped pool's header, and the bounds-checked
// accessors. Moved out of Pool unchanged: every check reads the private copy, never the pool.
#include "region.h"

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "checksum.h"
#include "errors.h"
#include "header_checksum.h"

namespace cxlkv {

using namespace format;

void Region::adopt(char* b, uint64_t mapped, const std::string& path, bool read_only, CacheModel* model,
                   const std::function<void(const PoolHeader&)>& feature_check) {
  // Validate a private copy: the shared header can change under us (F1), so every check below and
  // every later use reads the same bytes.
  std::memcpy(&hdr_copy_, b, sizeof hdr_copy_);
  const PoolHeader& h = hdr_copy_;
  auto* sw = reinterpret_cast<SharedWords*>(b + kSharedWordsOff);
  const std::string& P = path;
  if (std::memcmp(h.magic, kMagic, 8) != 0) {
    static const char zero[8] = {};
    uint64_t init = Coherence(Backend::flush).read(&sw->init.word);
    if (std::memcmp(h.magic, zero, 8) == 0 && init == kInitBusy)
      throw NotReadyError("pool " + P +
                          " was never completely initialized (its creator died or is still running); remove "
                          "it (cxlkv pool destroy --force) and re-create it");
    throw FormatError(P + " is not a cxlkv pool (bad magic)");
  }
  check_header(h, P);
  if (h.incompat & ~kIncompatSupported) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%llx", (unsigned long long)(h.incompat & ~kIncompatSupported));
    throw VersionError("pool " + P + " uses incompatible features unknown to this build (" + buf + ")");
  }
  if (feature_check) feature_check(h);
  if ((h.ro_compat & ~kRoCompatSupported) && !read_only) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%llx", (unsigned long long)(h.ro_compat & ~kRoCompatSupported));
    throw VersionError("pool " + P + " uses features this build may only read (ro_compat " + buf +
                       "): inspect it read-only (cxlkv pool info) or attach with a newer cxlkv");
  }
  if (h.stamp_cache_line != kCacheLine || h.stamp_header != sizeof(PoolHeader) ||
      h.stamp_node_slot != sizeof(NodeSlot) || h.stamp_node_area_fixed != sizeof(NodeAreaFixed) ||
      h.stamp_namespace != sizeof(NamespaceEntry) || h.stamp_index_entry != sizeof(IndexEntry))
    throw VersionError("pool " + P +
                       " was created by a build with another memory layout (build stamp differs)");
  if (h.pool_bytes > mapped)
    throw TruncatedError("pool " + P + " is truncated: header says " + std::to_string(h.pool_bytes) +
                         " bytes, the file has " + std::to_string(mapped));
  // Geometry: every area inside the pool, in order, without overlap.
  auto bad = [&](const char* what) {
    throw FormatError("pool " + P + " has an impossible geometry (" + what + ")");
  };
  if (h.backend != uint32_t(Backend::coherent) && h.backend != uint32_t(Backend::flush) &&
      h.backend != uint32_t(Backend::multihost))
    bad("backend");
  const bool multihost = h.backend == uint32_t(Backend::multihost);
  if (multihost ? (h.lock_hosts == 0 || h.lock_hosts > kMaxLockHosts) : h.lock_hosts != 0) bad("lock_hosts");
  if (h.max_nodes == 0 || h.max_nodes > kMaxNodes) bad("max_nodes");
  if (h.lease_ms < kLeaseMsMin || h.lease_ms > kLeaseMsMax) bad("lease_ms");
  if (h.pin_slots == 0 || h.pin_slots > (1u << 20)) bad("pin_slots");
  if (h.max_namespaces == 0 || h.max_namespaces > kMaxNamespaces) bad("max_namespaces");
  if (h.index_slots < 64 || (h.index_slots & (h.index_slots - 1)) || h.index_slots > (1ull << 36))
    bad("index_slots");
  if (h.chunk_bytes < 65536 || h.chunk_bytes % kMetaAlign || h.chunk_bytes > (1ull << 40)) bad("chunk_bytes");
  if (h.node_area_bytes < sizeof(NodeAreaFixed) + uint64_t(h.pin_slots) * 8 || h.node_area_bytes % kMetaAlign)
    bad("node_area_bytes");
  if ((h.compat & kCompatAdminMailbox) &&
      h.node_area_bytes < admin_mailbox_off(h.pin_slots) + admin_mailbox_bytes(h.max_nodes))
    bad("node_area_bytes (admin mailbox)");
  if (h.chunk_count == 0 || h.chunk_count > (1ull << 32)) bad("chunk_count");
  if (h.node_area_bytes > h.pool_bytes / h.max_nodes) bad("node_area_bytes");  // F6: no wrap below
  // Overflow-safe: a forged header (the checksum is no authentication) must not wrap a product.
  uint64_t end = kSharedWordsOff + kMetaAlign;
  if (multihost) end = kLockAreaOff + uint64_t(kLockStripes) * h.lock_hosts * sizeof(LockLine);
  auto area = [&](uint64_t off, uint64_t count, uint64_t each, const char* what) {
    uint64_t len, stop;
    if (__builtin_mul_overflow(count, each, &len) || __builtin_add_overflow(off, len, &stop)) bad(what);
    if (off < end || off % 64 || stop > h.pool_bytes) bad(what);
    end = stop;
  };
  area(h.node_table_off, h.max_nodes, sizeof(NodeSlot), "node table");
  area(h.node_area_off, h.max_nodes, h.node_area_bytes, "node areas");
  area(h.ns_table_off, h.max_namespaces, sizeof(NamespaceEntry), "namespace table");
  area(h.index_off, h.index_slots, sizeof(IndexEntry), "index");
  area(h.access_off, h.index_slots, 8, "access hints");
  area(h.chunk_map_off, h.chunk_count, 8, "chunk map");
  uint64_t stride = chunk_desc_bytes(h.chunk_bytes) + h.chunk_bytes;
  area(h.arena_off, h.chunk_count, stride, "arena");
  uint64_t init = Coherence(Backend::flush, model).read(&sw->init.word);  // valid for any backend
  if (init != kInitReady)
    throw NotReadyError("pool " + P +
                        " was never completely initialized (its creator died or is still running); remove it "
                        "(cxlkv pool destroy --force) and re-create it");

  base_ = b;
  hdr_ = &hdr_copy_;
  coh_ = Coherence(Backend(h.backend), model);
  entries_ = reinterpret_cast<IndexEntry*>(b + h.index_off);
  access_ = reinterpret_cast<uint64_t*>(b + h.access_off);
  slot_mask_ = h.index_slots - 1;
  desc_bytes_ = chunk_desc_bytes(h.chunk_bytes);
  chunk_stride_ = desc_bytes_ + h.chunk_bytes;
}

void Region::check_header(const PoolHeader& h, const std::string& P) {
  if (h.major > kFormatMajor)
    throw VersionError("pool " + P + " has format " + std::to_string(h.major) + "." +
                       std::to_string(h.minor) + ", newer than this cxlkv build supports (" +
                       std::to_string(kFormatMajor) + ".x)");
  if (h.major < kFormatMajor)
    throw VersionError("pool " + P + " has an old format " + std::to_string(h.major) + ".x; re-create it");
  if (h.header_bytes != sizeof(PoolHeader))
    throw FormatError("pool " + P + " header has " + std::to_string(h.header_bytes) + " bytes, expected " +
                      std::to_string(sizeof(PoolHeader)));
  if (h.checksum != header_checksum(h))
    throw FormatError("pool " + P + " header checksum mismatch: the header is corrupt");
}

bool Region::snapshot(uint64_t slot, uint64_t word, IndexEntry* out) const {
  IndexEntry* e = entry(slot);
  const bool stable = coh_.snapshot(out, e, sizeof *e, &e->state, word);
  out->state = word;  // the version the copy belongs to (its own copy of the word may be newer)
  return stable;
}

// ---------------------------------------------------------------------------------------------
// Bounds-checked accessors. Values read from the pool are untrusted: check before use.
NodeSlot* Region::node_slot(uint32_t idx) const {
  if (idx >= hdr_->max_nodes) throw CorruptError("node index " + std::to_string(idx) + " out of range");
  return reinterpret_cast<NodeSlot*>(base_ + hdr_->node_table_off) + idx;
}
char* Region::node_area(uint32_t idx) const {
  if (idx >= hdr_->max_nodes) throw CorruptError("node index " + std::to_string(idx) + " out of range");
  return base_ + hdr_->node_area_off + uint64_t(idx) * hdr_->node_area_bytes;
}
NamespaceEntry* Region::ns_entry(uint32_t id) const {
  if (id == 0 || id > hdr_->max_namespaces)
    throw CorruptError("namespace id " + std::to_string(id) + " out of range");
  return reinterpret_cast<NamespaceEntry*>(base_ + hdr_->ns_table_off) + (id - 1);
}
uint64_t* Region::chunk_word(uint64_t chunk) const {
  if (chunk >= hdr_->chunk_count) throw CorruptError("chunk " + std::to_string(chunk) + " out of range");
  return reinterpret_cast<uint64_t*>(base_ + hdr_->chunk_map_off) + chunk;
}
uint64_t* Region::block_desc(uint64_t chunk, uint32_t block) const {
  if (chunk >= hdr_->chunk_count || block >= desc_bytes_ / 8)
    throw CorruptError("block " + std::to_string(chunk) + ":" + std::to_string(block) + " out of range");
  return reinterpret_cast<uint64_t*>(base_ + hdr_->arena_off + chunk * chunk_stride_) + block;
}
char* Region::block_payload(const ChunkGeometry& geo, uint64_t chunk, uint32_t block) const {
  if (chunk >= hdr_->chunk_count || block >= geo.blocks)
    throw CorruptError("block " + std::to_string(chunk) + ":" + std::to_string(block) + " out of range");
  return base_ + hdr_->arena_off + chunk * chunk_stride_ + desc_bytes_ + uint64_t(block) * geo.block_stride;
}

}  // namespace cxlkv
