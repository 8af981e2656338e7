// The on-memory format of a cxlkv pool. Everything here lives in shared memory: offsets only,
// never pointers; fixed-width fields; every struct's size is pinned by static_assert and stamped
// into the header so that a build with another layout refuses the pool instead of misreading it.
//
// Pool map (all offsets from the pool base; areas 4 KiB aligned, arena chunk_bytes aligned):
//
//   [0, 4096)            PoolHeader: immutable after creation, checksummed
//   [4096, 8192)         SharedWords: the few pool-wide mutable words, one cache line each
//   node_table_off       NodeSlot[max_nodes]          one line per attached process
//   node_area_off        NodeArea[max_nodes]          owner-written: pins, counters
//   ns_table_off         NamespaceEntry[max_namespaces]
//   index_off            IndexEntry[index_slots]      open addressing, one line per entry
//   access_off           uint64 access[index_slots]   eviction hints (many writers, see below)
//   chunk_map_off        uint64 chunk_map[chunk_count]
//   arena_off            chunk_count chunks, each [BlockDesc area: desc_bytes | payload: chunk_bytes]
//
// Format changes: bump kFormatMajor for anything an old reader would misread; add an incompat
// feature bit for optional layouts an old reader must refuse; compat bits may be ignored.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cxlkv::format {

constexpr char kMagic[8] = {'C', 'X', 'L', 'K', 'V', 'P', 'L', '\0'};
constexpr uint16_t kFormatMajor = 2;  // 2: CONDEMNED entry state, counters 13..15
constexpr uint16_t kFormatMinor = 0;
constexpr uint64_t kIncompatSupported = 0;  // no incompat features defined yet
constexpr size_t kCacheLine = 64;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kSharedWordsOff = 4096;
constexpr size_t kMetaAlign = 4096;
constexpr uint32_t kMaxProbe = 128;            // linear-probe window: bounds every lookup
constexpr uint32_t kMaxBlocksPerChunk = 65535;  // BlockRef.block is 16 bits
constexpr uint32_t kMaxNodes = 254;             // node ids 1..254 fit the 8-bit owner fields
constexpr uint32_t kMaxNamespaces = 4096;
constexpr uint32_t kModelIdBytes = 96;
constexpr uint32_t kNameBytes = 96;
constexpr uint64_t kMaxBlockBytes = 0xFFFFFFFFull;  // NamespaceEntry.block_bytes in 1..this

// ---------------------------------------------------------------------------------------------
// Header. Written once by the creator before the init word says READY; never written again.
// checksum = XXH3_64(header bytes [0, offsetof(checksum))). The checksum is not authentication:
// anyone who can write the file can re-seal a forged header, so open validates every field with
// overflow-safe arithmetic (each area inside the pool, node_area_bytes <= pool_bytes / max_nodes)
// and then works from a private copy; the shared header is never read again after open.
struct PoolHeader {
  char magic[8];
  uint16_t major;
  uint16_t minor;
  uint32_t header_bytes;  // sizeof(PoolHeader)
  uint64_t compat;        // features an older reader may ignore
  uint64_t incompat;      // features an older reader must refuse
  uint64_t ro_compat;     // features an older reader may only read
  uint8_t uuid[16];
  uint64_t created_unix_ns;
  uint64_t pool_bytes;
  uint32_t backend;  // Backend
  uint32_t reserved0;
  // geometry
  uint64_t node_table_off;
  uint64_t node_area_off;
  uint64_t node_area_bytes;  // stride of NodeArea (pins + counters), 4 KiB multiple
  uint32_t max_nodes;
  uint32_t pin_slots;
  uint64_t ns_table_off;
  uint32_t max_namespaces;
  uint32_t reserved1;
  uint64_t index_off;
  uint64_t index_slots;  // power of two
  uint64_t access_off;
  uint64_t chunk_map_off;
  uint64_t chunk_count;
  uint64_t chunk_bytes;  // payload bytes per chunk; chunk stride = chunk_desc_bytes() + chunk_bytes
  uint64_t arena_off;
  // build stamp: a build whose layout differs in any of these refuses the pool
  uint32_t stamp_cache_line;
  uint32_t stamp_header;
  uint32_t stamp_node_slot;
  uint32_t stamp_node_area_fixed;
  uint32_t stamp_namespace;
  uint32_t stamp_index_entry;
  uint64_t checksum;
};
static_assert(sizeof(PoolHeader) == 216);
static_assert(sizeof(PoolHeader) <= kHeaderBytes);

// ---------------------------------------------------------------------------------------------
// Pool-wide mutable words, each alone in its cache line.
//
// init: 0 = never initialized; kInitBusy = creator at work; kInitReady = usable.
//   A pool is used only when init == kInitReady; the creator publishes it last, after the header
//   checksum and every area are written (LMDB's "commit word written last").
// ns_lock: 0 = free, else the node id holding the namespace-table lock (creation is rare; a lock
//   held by a dead node is broken by whoever reclaims that node).
constexpr uint64_t kInitBusy = 0x5953554254494E49ull;   // "INITBUSY"
constexpr uint64_t kInitReady = 0x5944414552544E49ull;  // "INTREADY"
struct alignas(kCacheLine) SharedLine {
  uint64_t word;
  uint64_t pad[7];
};
struct SharedWords {
  SharedLine init;
  SharedLine ns_lock;
};

// ---------------------------------------------------------------------------------------------
// Node slot: one per attached process, one cache line, written only by its owner (or, once the
// owner is dead, by the one reclaimer that claimed it). node id = slot index + 1.
//
// state word = [state:8][pid:32][epoch:24]   (pid in the word so a CLAIMED slot can be judged)
//   FREE(0) -> CLAIMED (claim; start/host not yet valid) -> ALIVE (fields valid, published)
//   ALIVE -> FREE (clean close)
//   CLAIMED|ALIVE|RECLAIMING(dead pid) -> RECLAIMING(reclaimer pid) (claim) -> FREE (publish)
// Invariant: a node's pins, WRITING/EVICTING entries and CARVING chunks exist only while its slot
// is CLAIMED, ALIVE or RECLAIMING.
enum NodeState : uint8_t { kNodeFree = 0, kNodeClaimed = 1, kNodeAlive = 2, kNodeReclaiming = 3 };
struct alignas(kCacheLine) NodeSlot {
  uint64_t state;
  uint64_t pid;
  uint64_t start_time;  // /proc/<pid>/stat field 22: tells a reused pid apart
  uint64_t host_id;     // hash of the boot id: liveness is only judged on the same host
  uint64_t heartbeat_ns;
  uint64_t attach_unix_ns;
  uint64_t pad[2];
};
static_assert(sizeof(NodeSlot) == 64);
inline uint8_t node_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint32_t node_pid(uint64_t w) { return uint32_t(w >> 24); }
inline uint32_t node_epoch(uint64_t w) { return uint32_t(w) & 0xFFFFFF; }
inline uint64_t make_node_word(uint8_t st, uint32_t pid, uint32_t epoch) {
  return (uint64_t(st) << 56) | (uint64_t(pid) << 24) | (epoch & 0xFFFFFF);
}

// Node area: written only by the owning node. Readers of other nodes scan pins[0, pin_hw).
// pin value: 0 = empty, else pin_value(slot, gen): the entry at `slot` in generation `gen` must
// not be freed (hazard-pointer style; validated by generation, no shared counters).
// Counters are monotonic over the pool's life: an attaching node keeps the slot's counters, so
// stats() (the sum over all slots) still counts processes that have exited.
enum Counter : uint32_t {
  kHits, kMisses, kPuts, kPutsPresent, kPutsFailed, kEvictions, kChecksumFailures,
  kBytesStored, kBytesLoaded, kDeletes, kReclaimedNodes, kEvictSkippedPinned, kCorruptEntries,
  kCondemnedEntries, // entries taken out of the index after a checksum failure (see kCondemned state)
  kPinsExhausted, // a get or acquire found no free pin slot in this node's pin array
  kPutsInFlight,  // put found the key being written by a live node: not stored (yet)
  kCounterCount
};
struct alignas(kCacheLine) NodeAreaFixed {
  uint64_t pin_hw;  // pins at index >= pin_hw are all zero
  uint64_t pad0[7];
  uint64_t counters[16];
};
static_assert(kCounterCount <= 16);
static_assert(sizeof(NodeAreaFixed) == 192);
inline uint64_t pin_value(uint64_t slot, uint32_t gen) { return ((slot + 1) << 24) | gen; }

// ---------------------------------------------------------------------------------------------
// Namespace entry: identifies one model/KV layout. 256 bytes, 4 cache lines.
// state word = [state:8][node:8][reserved:48]; FREE(0) -> CREATING(node) -> READY. Written under
// ns_lock only; READY entries are immutable, so readers need no lock.
enum NsState : uint8_t { kNsFree = 0, kNsCreating = 1, kNsReady = 2 };
enum LayoutKind : uint32_t { kLayoutDense = 1, kLayoutMla = 2, kLayoutOpaque = 3 };
struct alignas(kCacheLine) NamespaceEntry {
  uint64_t state;
  uint64_t fingerprint;  // XXH3 over the layout fields below
  uint64_t block_bytes;  // 1..2^32-1; readers skip an entry outside that range (corrupt)
  uint32_t dtype_bytes;
  uint32_t kind;
  uint32_t num_layers;
  uint32_t num_kv_heads;
  uint32_t head_size;
  uint32_t tokens_per_block;
  uint32_t tp_rank;
  uint32_t tp_size;
  char dtype[8];
  char model_id[kModelIdBytes];
  char name[kNameBytes];
};
static_assert(sizeof(NamespaceEntry) == 256);
inline uint8_t ns_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint8_t ns_node(uint64_t w) { return uint8_t(w >> 48); }
inline uint64_t make_ns_word(uint8_t st, uint8_t node) {
  return (uint64_t(st) << 56) | (uint64_t(node) << 48);
}

// ---------------------------------------------------------------------------------------------
// Index entry: one cache line. All fields except `state` are written only while the writer owns
// the entry in WRITING state; they are immutable while READY or CONDEMNED. The writer writes
// key and ns_id right after its claim (before the payload), so a put of the same key can tell
// an in-flight copy of its key from a 24-bit tag collision.
//
// state word = [state:8][node:8][gen:24][tag:24]
//   EMPTY(0)      never used: ends a probe
//   WRITING(n)    node n claimed the slot and is filling it        (from EMPTY or TOMBSTONE)
//   READY         visible: payload complete and checksummed         (from WRITING, published last)
//   EVICTING(n)   node n is freeing it; readers treat it as absent (from READY or CONDEMNED)
//   TOMBSTONE     free for reuse, does not end a probe              (from WRITING or EVICTING)
//   CONDEMNED     failed its checksum: invisible to lookups and puts, does not end a probe, its
//                 block stays USED (readers that pinned it may still be copying); any node
//                 moves it CONDEMNED -> EVICTING(n) -> TOMBSTONE once no pin names it (the
//                 reader that condemned it after unpinning, an evictor, `pool check`)
//                                                                    (from READY, by claim)
// gen increments on every WRITING claim: a pin (slot, gen) cannot match a later reuse.
// tag = 24 bits of the key hash, so probes skip most foreign slots without reading the key.
// Readers: read state, read fields, re-read state; equal words => consistent snapshot (seqlock).
enum EntryState : uint8_t {
  kEmpty = 0, kWriting = 1, kReady = 2, kEvicting = 3, kTombstone = 4, kCondemned = 5
};
struct alignas(kCacheLine) IndexEntry {
  uint64_t state;
  uint8_t key[32];
  uint32_t ns_id;
  uint32_t chunk;
  uint16_t block;
  uint16_t depth;  // position in its prefix chain, as the writer knew it (eviction hint)
  uint32_t length; // payload bytes (<= namespace block_bytes)
  uint64_t checksum;  // XXH3_64 of the payload
};
static_assert(sizeof(IndexEntry) == 64);
inline uint8_t entry_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint8_t entry_node(uint64_t w) { return uint8_t(w >> 48); }
inline uint32_t entry_gen(uint64_t w) { return uint32_t(w >> 24) & 0xFFFFFF; }
inline uint32_t entry_tag(uint64_t w) { return uint32_t(w) & 0xFFFFFF; }
inline uint64_t make_entry_word(uint8_t st, uint8_t node, uint32_t gen, uint32_t tag) {
  return (uint64_t(st) << 56) | (uint64_t(node) << 48) | (uint64_t(gen & 0xFFFFFF) << 24) |
         (tag & 0xFFFFFF);
}

// Access hints: access[slot] = microsecond timestamp of the last use, minus a depth penalty so
// deeper blocks of a chain look older and go first (tail-first eviction). Any node may write it;
// a lost or stale update only changes which victim is chosen, never correctness.

// ---------------------------------------------------------------------------------------------
// Chunk map word = [state:8][node:8][ns:16][reserved:32]
//   FREE(0) -> CARVING(node, ns) (claim; block descs being reset) -> ACTIVE(ns) (published)
//   ACTIVE(ns) -> DRAINING(node, ns) (claim by a node of another namespace that found no free
//     chunk): it fences every FREE desc and evicts every READY block, then re-carves the chunk
//     for its own namespace (-> CARVING -> ACTIVE(new ns)), or, if a block is pinned or in flight,
//     unfences and puts the chunk back ACTIVE(ns).
// Allocators only claim descs of ACTIVE chunks of their namespace; a desc fenced by a drainer
// fails their claim, so no block is handed out of a chunk that changes hands.
// Block geometry follows from (chunk_bytes, namespace block_bytes), see chunk_geometry().
enum ChunkState : uint8_t { kChunkFree = 0, kChunkCarving = 1, kChunkActive = 2, kChunkDraining = 3 };
inline uint8_t chunk_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint8_t chunk_node(uint64_t w) { return uint8_t(w >> 48); }
inline uint32_t chunk_ns(uint64_t w) { return uint32_t(w >> 32) & 0xFFFF; }
inline uint64_t make_chunk_word(uint8_t st, uint8_t node, uint32_t ns) {
  return (uint64_t(st) << 56) | (uint64_t(node) << 48) | (uint64_t(ns & 0xFFFF) << 32);
}

// Block descriptor (one uint64 per block, at the start of its chunk)
//   = [state:8][node:8][epoch:8][slot:40]   (epoch: low 8 bits of the owner's node epoch, so a
//     later process that reuses the node id is not mistaken for the owner)
//   FREE(0) -> USED(node, slot) (claim by the allocating writer, after it owns index slot `slot`)
//   USED -> FREE (publish by the evictor/deleter, or by the reclaimer of a dead writer)
//   FREE -> FENCED(node), USED -> FENCED(node): only by the drainer of a DRAINING chunk
// Accounting invariant, per namespace, checked by `pool check`:
//   capacity (sum of blocks of its ACTIVE chunks) == free + ready + in_flight + condemned
//   where ready = USED blocks whose entry is READY and points back to the block,
//         in_flight = USED blocks whose entry is WRITING or EVICTING,
//         condemned = USED blocks whose entry is CONDEMNED and points back to the block.
enum BlockState : uint8_t { kBlockFree = 0, kBlockUsed = 1, kBlockFenced = 2 };
inline uint8_t block_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint8_t block_node(uint64_t w) { return uint8_t(w >> 48); }
inline uint64_t block_slot(uint64_t w) { return w & ((1ull << 40) - 1); }
inline uint8_t block_epoch(uint64_t w) { return uint8_t(w >> 40); }
inline uint64_t make_block_word(uint8_t st, uint8_t node, uint8_t epoch, uint64_t slot) {
  return (uint64_t(st) << 56) | (uint64_t(node) << 48) | (uint64_t(epoch) << 40) | (slot & ((1ull << 40) - 1));
}

// A chunk is [desc area | payload]. The desc area is sized at creation for blocks of
// kDescGranule bytes, so large blocks pack the payload exactly (8 x 2 MiB blocks in 16 MiB) and
// blocks smaller than the granule are limited by the desc count instead.
constexpr uint64_t kDescGranule = 1024;
// Overflow-safe: a value whose rounding would pass 2^64 (possible only for values read from a
// corrupt pool) saturates to 0, which every caller treats as "impossible size".
inline uint64_t round_up(uint64_t v, uint64_t a) {
  if (a == 0) return 0;
  uint64_t r = v % a;
  if (r == 0) return v;
  uint64_t out;
  if (__builtin_add_overflow(v, a - r, &out)) return 0;
  return out;
}
inline uint64_t chunk_desc_bytes(uint64_t chunk_bytes) {
  return round_up(chunk_bytes / kDescGranule * 8, kMetaAlign);
}
struct ChunkGeometry {
  uint32_t blocks;        // blocks in the chunk
  uint64_t block_stride;  // block_bytes rounded up to a cache line
};
// blocks = min(chunk_bytes / stride, desc_bytes / 8, kMaxBlocksPerChunk); a block_bytes of 0 or
// one whose stride overflows gives blocks = 0 (callers refuse such a namespace).
inline ChunkGeometry chunk_geometry(uint64_t chunk_bytes, uint64_t block_bytes) {
  ChunkGeometry g{};
  g.block_stride = round_up(block_bytes, kCacheLine);
  if (g.block_stride == 0) return g;
  uint64_t n = chunk_bytes / g.block_stride;
  uint64_t by_desc = chunk_desc_bytes(chunk_bytes) / 8;
  if (n > by_desc) n = by_desc;
  if (n > kMaxBlocksPerChunk) n = kMaxBlocksPerChunk;
  g.blocks = uint32_t(n);
  return g;
}

}  // namespace cxlkv::format
