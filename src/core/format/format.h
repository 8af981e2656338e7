// The on-memory format of a cxlkv pool. Everything here lives in shared memory: offsets only,
// never pointers; fixed-width fields; every struct's size is pinned by static_assert and stamped
// into the header so that a build with another layout refuses the pool instead of misreading it.
//
// Pool map (all offsets from the pool base; areas 4 KiB aligned, arena chunk_bytes aligned):
//
//   [0, 4096)            PoolHeader: immutable after creation, checksummed
//   [4096, 8192)         SharedWords: the few pool-wide mutable words, one cache line each;
//                        QuotaRow[kQuotaRows] from kQuotaTableOff (quota.h, format 3)
//   [8192, ...)          LockLine[kLockStripes][lock_hosts]  multihost only (lock_hosts > 0)
//   node_table_off       NodeSlot[max_nodes]          two lines per attached process
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
#include <bit>
#include <cstddef>
#include <cstdint>

#include "quota.h"

namespace cxlkv::format {

// Every multi-byte field is little-endian, as the x86-64 and AArch64 hosts of a CXL pod write it.
// A big-endian build would read a byte-swapped major and misjudge the pool: it does not compile.
static_assert(std::endian::native == std::endian::little, "the pool format is little-endian");

constexpr char kMagic[8] = {'C', 'X', 'L', 'K', 'V', 'P', 'L', '\0'};
constexpr uint16_t kFormatMajor = 3;  // 3: quotas (quota.h): the quota table in the SharedWords page,
                                      // IndexEntry.ns_id split into ns_id:16 + tenant_row + ns_row,
                                      // NodeAreaFixed grown by the usage counters (and 24 counters)
// 2: NamespaceEntry of 512 bytes (source, dtype code), CONDEMNED entry state, node liveness by OFD
//    lock + heartbeat lease. A 2.x build refuses a 3.x pool (major), and a 3.x build a 2.x pool.
// Minor versions of 2 (each readable by 2.0 builds: they ignore what they do not know), kept by 3:
// 1: compat feature kCompatAdminMailbox (node areas end with an RPC mailbox).
// 2: multihost backend (3): the lock area between SharedWords and the node table (lock_hosts in
//    the header, host_slot in NodeSlot). Older builds refuse backend 3 and ignore the zero fields.
// 3: (a) striped pools (incompat feature kIncompatStriped: one pool over several devices, see
//    StripeTable below). Older builds refuse them (unknown incompat bit).
//    (b) multihost host slots shared by the processes of one host: LockLine.tier1 / holder_line
//    (the cross-process tier 1, from pad) and NodeSlot.flags (kNodeSharesHostSlot, from pad0). A
//    2.2 build never sets the flag; a 2.3 build refuses to share a row with a node that lacks it,
//    and a 2.2 build refuses any second node on its row, so mixed builds never share one. This is
//    negotiated per node, not by the header: a single-file pool still records minor 2
//    (pool_minor()), since every 2.2 build reads it correctly.
// 4: multihost observers that write hold a node slot flagged kNodeObserver (NodeSlot.flags; since
//    issue 23 one that only reads holds none and no row: nothing in the format changed), and rows
//    are probed (host_slot.cpp); LockLine.waits (from pad): a waiting holder's progress. Nothing an
//    older build misreads (it sees an observer as any node); single-file pools still record minor 2.
// 5: bounded intents (issue 23): SharedWords.init.pad[kInitIntentCap] holds the creator's cap of
//    block-less intents per node, NodeAreaFixed.intents (from pad0) the owner's count. Older
//    builds ignore both (they enforce no cap); single-file pools still record minor 2.
//    Also in 5 (issue 22, the same landing): LayoutFields lost tp_rank/tp_size (NamespaceEntry bytes 48..55)
//    and gained heads_per_entry (bytes 48..51; 52..55 padding), and the namespace fingerprint recipe is v3
//    (layout.cpp). A namespace of either side never matches a layout of the other (the fingerprints differ:
//    an open by name is a LayoutMismatchError, and the vLLM connector's names changed with its identity), so
//    an older pool's namespaces are a cold cache to this build and never wrong KV. Older builds show
//    heads_per_entry as tp_rank in listings; they never open these namespaces.
constexpr uint16_t kFormatMinor = 5;  // every minor of 2 above holds for 3 (3.5 = 2.5 + quotas)
// kIncompatStriped: the pool is interleaved over StripeTable::device_count devices; a reader that
// maps only the first device would see the other devices' stripes as missing bytes.
constexpr uint64_t kIncompatStriped = 1;
constexpr uint64_t kIncompatSupported = kIncompatStriped;
constexpr uint64_t kRoCompatSupported = 0;  // no ro_compat features defined yet
// Compat features (an older reader may ignore them: it never looks past the pins of a node area).
// kCompatAdminMailbox: every node area ends with that node's admin RPC mailbox (see NodeArea
// below); a pool without the bit simply has no mailbox (`pool ping` says so).
constexpr uint64_t kCompatAdminMailbox = 1;
constexpr size_t kCacheLine = 64;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kSharedWordsOff = 4096;
constexpr size_t kMetaAlign = 4096;
constexpr uint32_t kMaxProbe = 128;             // linear-probe window: bounds every lookup
constexpr uint32_t kMaxBlocksPerChunk = 65535;  // BlockRef.block is 16 bits
constexpr uint32_t kMaxNodes = 254;             // node ids 1..254 fit the 8-bit owner fields
// Pin slots per node (the default of pool creation). The vLLM connector leases a request's whole
// matched prefix: 4096 pins = 64 Ki tokens at 16 tokens per block, e.g. two 32 Ki-token prompts
// leased at once by one engine, with gets' reserve on top (Index::get_pin_reserve). Costs 32 KiB
// per node slot (2 MiB for 64 nodes), and an evictor scans only up to each node's high-water mark.
// It is the cap of the size-derived default (plan_geometry): pools under 64 MiB get fewer.
constexpr uint32_t kDefaultPinSlots = 4096;
constexpr uint32_t kMaxNamespaces = 4096;
constexpr uint32_t kModelIdBytes = 96;
constexpr uint32_t kNameBytes = 96;
constexpr uint32_t kSourceBytes = 256;              // NamespaceEntry.source: up to 255 bytes + NUL
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
  uint64_t ro_compat;     // features an older reader may only read: it opens read-only (inspect)
                          // and refuses to attach
  uint8_t uuid[16];
  uint64_t created_unix_ns;
  uint64_t pool_bytes;
  uint32_t backend;   // Backend
  uint32_t lease_ms;  // heartbeat lease of nodes judged across kernels (see NodeSlot), kLeaseMs..
  // geometry
  uint64_t node_table_off;
  uint64_t node_area_off;
  uint64_t node_area_bytes;  // stride of NodeArea (pins + counters), 4 KiB multiple
  uint32_t max_nodes;
  uint32_t pin_slots;
  uint64_t ns_table_off;
  uint32_t max_namespaces;
  uint32_t lock_hosts;  // multihost: host slots of the lock area (LockLine); 0 for other backends
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
// init.pad[kInitIntentCap] (format 2.5): block-less intents (Pool::reserve without a block) one
//   node may hold at once, written by the creator before the init word says READY and never
//   again. Untrusted like every shared word: read through intent_cap_of_word (0 = a pool made
//   before 2.5: the default share; clamped to [1, index_slots / 2]).
constexpr uint32_t kInitIntentCap = 0;
constexpr uint32_t kIntentPermilleDefault = 50;  // 5 % of the index per node
constexpr uint32_t kIntentPermilleMax = 500;
inline uint64_t intent_cap_of(uint64_t index_slots, uint32_t permille) {
  const uint64_t cap = index_slots / 1000 * permille + index_slots % 1000 * permille / 1000;
  return cap < 1 ? 1 : cap;
}
inline uint64_t intent_cap_of_word(uint64_t word, uint64_t index_slots) {
  if (word == 0) return intent_cap_of(index_slots, kIntentPermilleDefault);
  const uint64_t most = index_slots / 2 < 1 ? 1 : index_slots / 2;
  return word > most ? most : word;
}
struct SharedWords {
  SharedLine init;
  SharedLine ns_lock;
};

// ---------------------------------------------------------------------------------------------
// Lock area (multihost backend only): Lamport's bakery over plain loads and stores, no atomic
// read-modify-write across hosts (docs/ARCHITECTURE.md "Multi-host CXL 2.0"). Claims and shared
// publishes of a pool word take the stripe of the word's cache line (kLockStripes stripes). Line
// (stripe k, host h) sits at kLockAreaOff + (k * lock_hosts + h) * 64 and is written ONLY by the
// process attached as host slot h (one writer per line); everyone reads it after dropping it.
//   choosing: 1 while h picks its ticket. number: h's ticket, 0 = not competing. choosing and
//   number share the line, so `number = max + 1, choosing = 0` reaches memory in one write-back.
//   node / node_word: the node slot (id, state word) h competes for, so a waiter can tell a host
//   whose ticket and heartbeat stood still for a whole lease (dead, or fenced: skipped).
// Every process of one host shares that host's row (format 2.3): the line is then written by the
// processes of ONE coherence domain, one at a time, so other hosts still see one writer per line.
//   tier1: host-local (never read by another host): 0 = free, else tier1_word() of the process of
//     this host that holds the row for this stripe (CAS among the host's processes: legal inside
//     one coherence domain). Only its holder writes choosing/number/node/node_word.
//   holder_line: host-local: pool offset of the line the tier-1 holder is about to modify under
//     the lock, so a process that takes over from a dead holder writes that line back first (its
//     dirty copy lives on in the host's caches). Validated before use.
//   waits (2.4): advanced by the holder every few ms while its ticket waits for smaller ones, so
//     a host blocked behind this ticket can tell a holder that waits (progress: no bound) from
//     one that sits on a ticket (a holder stalled inside the lock, or a stray write): only the
//     latter counts toward Bakery::kWaitLeases. Each such write rewrites the whole ticket
//     (choosing, number, node, node_word), so a forged ticket in a waiting holder's line lives
//     one progress write at most; and whatever `waits` does, a claim ends within
//     Bakery::kClaimLeases (issue 23).
//   Every word of a line is untrusted: a tier-1 word is judged from the node table
//     (Bakery::classify_tier1), never from the line.
// See docs/ARCHITECTURE.md §11 "Host slots".
constexpr size_t kLockAreaOff = kSharedWordsOff + kMetaAlign;  // 8192
constexpr uint32_t kLockStripes = 16;
constexpr uint32_t kMaxLockHosts = 64;
constexpr uint32_t kLockHostsDefault = 16;
struct alignas(kCacheLine) LockLine {
  uint64_t choosing;
  uint64_t number;
  uint64_t node;
  uint64_t node_word;
  uint64_t tier1;
  uint64_t holder_line;
  uint64_t waits;  // format 2.4: bumped and written back by the holder while it WAITS in tier 2
  uint64_t pad[1];
};
static_assert(sizeof(LockLine) == 64);
// tier1 word = [1:1][nonce:15][participant+1:16][node:8][node epoch:24]. participant: the byte
// this process holds an OFD lock on for its attachment's life (Pool::participant_offset), 0 = none
// (no usable lock file: judged by silence only); node 0 = an observer (no node slot); nonce: random
// per attachment (tells apart two attachments without participant byte or node).
inline uint64_t make_tier1_word(uint32_t participant1, uint32_t node, uint32_t epoch) {
  return (1ull << 63) | (uint64_t(participant1 & 0xFFFF) << 32) | (uint64_t(node & 0xFF) << 24) |
         (epoch & 0xFFFFFF);
}
inline uint32_t tier1_participant1(uint64_t w) { return uint32_t(w >> 32) & 0xFFFF; }
inline uint32_t tier1_node(uint64_t w) { return uint32_t(w >> 24) & 0xFF; }
inline uint32_t tier1_epoch(uint64_t w) { return uint32_t(w) & 0xFFFFFF; }

// ---------------------------------------------------------------------------------------------
// Node slot: one per attachment, two cache lines. node id = slot index + 1. See
// docs/ARCHITECTURE.md "Liveness".
//
// Line 0 (claim line): `state` is changed by claim only (the attacher, the owner at detach, a
// reclaimer); the other fields are written only by the attacher while the slot is CLAIMED, before
// it publishes ALIVE, and are immutable while ALIVE.
//   state word = [state:8][domain:32][epoch:24]
//   FREE(0) -> CLAIMED(domain) (claim; fields not yet valid) -> ALIVE (fields valid, published)
//   ALIVE -> FREE (clean close: the owner publishes FREE, then drops its lock)
//   CLAIMED|ALIVE|RECLAIMING judged dead -> RECLAIMING(reclaimer's domain) (claim) -> FREE
//   domain = liveness::domain_tag(host_id, lock_id) of whoever wrote the word; in the word so a
//   CLAIMED slot can be judged before its fields are published.
// Line 1 (heartbeat line): written only by the slot's owner (its attach, then its process's
//   heartbeat thread); never by a reclaimer, so a paused owner that resumes cannot tear a line a
//   reclaimer wrote. `beat` advances every lease_ms/4 while the owner's state word is unchanged.
//
// Liveness invariants (who may be judged dead, and how):
//   L1 Same kernel: the owner holds an OFD write lock on byte Pool::lock_offset(slot) of the pool file
//      from before its claim until after its FREE publish; a reclaimer takes that lock before it
//      claims the slot RECLAIMING and keeps it until FREE. A judge whose (host_id, lock_id) equal
//      the slot's (domain tag for CLAIMED/RECLAIMING, the fields for ALIVE) judges by the lock
//      alone: held by another open file description = alive (a SIGSTOPped owner stays alive),
//      free = dead. Pids are never used: they mean nothing outside the owner's PID namespace.
//   L2 Other kernel (another host_id or lock_id, or no working lock): dead only once the pair
//      (state word, beat) has not changed for lease_ms on the judge's own monotonic clock; a judge
//      with no history observes for a full lease first. Wall-clock fields are display only.
//   L3 A node whose state word no longer equals its own is fenced: it stops beating and every
//      later operation fails (ensure_usable); it never writes its slot again.
//   L4 A node's pins, WRITING/EVICTING entries and CARVING/DRAINING chunks exist only while its
//      slot is CLAIMED, ALIVE or RECLAIMING.
//   L5 Every reclaim adds 1 to the reclaimed slot's counters[kReclaimedNodes] (the reclaimer owns
//      the dead node's area while RECLAIMING), so observers and reaps at open are counted too.
// NodeSlot.flags: this node takes its host slot's row through the shared tier 1 (format 2.3).
constexpr uint64_t kNodeSharesHostSlot = 1;
// NodeSlot.flags: an observer that writes (`pool reap`, `check` reclaiming or repairing): it takes no
// namespaces, and holds a node slot only so that its host's row is visible to attachers and its
// fence has a heartbeat (format 2.4; display only for older builds, which treat it as any node).
// An observer that only reads holds no slot at all (host_slot.cpp, "Observers").
constexpr uint64_t kNodeObserver = 2;
enum NodeState : uint8_t { kNodeFree = 0, kNodeClaimed = 1, kNodeAlive = 2, kNodeReclaiming = 3 };
constexpr uint32_t kLeaseMsDefault = 10000;
constexpr uint32_t kLeaseMsMin = 50;
constexpr uint32_t kLeaseMsMax = 3600 * 1000;
struct alignas(kCacheLine) NodeSlot {
  // line 0: claim line
  uint64_t state;
  uint64_t pid;             // in the owner's PID namespace: display only, never judged
  uint64_t pid_ns;          // inode of the owner's /proc/self/ns/pid: display only
  uint64_t host_id;         // liveness::host_id(): boot id hash (or CXLKV_HOST_ID)
  uint64_t lock_id;         // liveness::LockFile::lock_id: (st_dev, st_ino) hash; 0 = lease only
  uint64_t attach_unix_ns;  // display only
  uint64_t host_slot;       // multihost: the attacher's row in the lock area (+1; 0 = none)
  uint64_t flags;           // kNodeSharesHostSlot (format 2.3; 0 from older builds)
  // line 1: heartbeat line (owner only)
  alignas(kCacheLine) uint64_t beat;
  uint64_t beat_unix_ns;  // display only (wall clocks jump and differ between hosts)
  uint64_t pad1[6];
};
static_assert(sizeof(NodeSlot) == 128);
inline uint8_t node_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint32_t node_domain(uint64_t w) { return uint32_t(w >> 24); }
inline uint32_t node_epoch(uint64_t w) { return uint32_t(w) & 0xFFFFFF; }
inline uint64_t make_node_word(uint8_t st, uint32_t domain, uint32_t epoch) {
  return (uint64_t(st) << 56) | (uint64_t(domain) << 24) | (epoch & 0xFFFFFF);
}

// Node area: written by the owning node while its slot is ALIVE; before that by the attacher
// (which resets pins and pin_hw while its slot is CLAIMED), and by the one reclaimer of a dead
// owner (which clears its pins and pin_hw while the slot is RECLAIMING, and adds to
// counters[kReclaimedNodes]). Never two writers at once: the slot's state word says which one.
// Readers of other nodes scan pins[0, pin_hw).
// pin value: 0 = empty, else pin_value(slot, gen): the entry at `slot` in generation `gen` must
// not be freed (hazard-pointer style; validated by generation, no shared counters).
// Counters are monotonic over the pool's life: an attaching node keeps the slot's counters, so
// stats() (the sum over all slots) still counts processes that have exited.
// The ONE list of counters: X(enum name, name shown by `pool stats`, meaning). Append only: a
// counter's position is its index in NodeAreaFixed.counters of existing pools. The meaning is
// bound to Python (_core.counter_info()): the exporter's help texts and docs/METRICS.md quote it.
#define CXLKV_COUNTERS(X)                                                                      \
  X(kHits, hits, "lookups that delivered a block")                                             \
  X(kMisses, misses, "lookups that found nothing usable")                                      \
  X(kPuts, puts, "blocks stored")                                                              \
  X(kPutsPresent, puts_present, "puts of a key already stored")                                \
  X(kPutsFailed, puts_failed,                                                                  \
    "puts that found no block to allocate or evict (pool full of pinned or in-flight blocks)") \
  X(kEvictions, evictions, "blocks evicted to make room")                                      \
  X(kChecksumFailures, checksum_failures,                                                      \
    "reads whose bytes failed the checksum (a miss, never wrong bytes)")                       \
  X(kBytesStored, bytes_stored, "payload bytes stored")                                        \
  X(kBytesLoaded, bytes_loaded, "payload bytes delivered")                                     \
  X(kDeletes, deletes, "entries deleted")                                                      \
  X(kReclaimedNodes, reclaimed_nodes, "dead nodes reclaimed (what they held released)")        \
  X(kEvictSkippedPinned, evict_skipped_pinned, "eviction candidates skipped because pinned")   \
  X(kCorruptEntries, corrupt_entries, "index entries dropped as corrupt")                      \
  X(kCondemnedEntries, condemned, "entries taken out after a checksum failure")                \
  X(kPinsExhausted, pins_exhausted, "gets/acquires that found no free pin slot")               \
  X(kPutsInFlight, puts_in_flight, "puts that found the key being written by a live node")     \
  X(kPutsOverQuota, puts_over_quota,                                                           \
    "puts refused: over their quota with none of their own blocks to evict")                   \
  X(kQuotaEvictions, quota_evictions, "blocks evicted to keep their tenant or namespace within its quota")
// The formatter cannot see that the X-macro's expansion ends with a comma.
// clang-format off
enum Counter : uint32_t {
#define CXLKV_COUNTER_ENUM(id, name, what) id,
  CXLKV_COUNTERS(CXLKV_COUNTER_ENUM)
#undef CXLKV_COUNTER_ENUM
  kCounterCount
};
// clang-format on
struct alignas(kCacheLine) NodeAreaFixed {
  uint64_t pin_hw;   // pins at index >= pin_hw are all zero
  uint64_t intents;  // format 2.5: block-less intents the owner holds now (reset by a reclaimer)
  uint64_t pad0[6];
  uint64_t counters[24];  // format 3: 24 (was 16)
  // format 3, quota.h: bytes charged to / released from each quota row by this node (monotonic)
  uint64_t quota_charged[kQuotaRows];
  uint64_t quota_released[kQuotaRows];
};
static_assert(kCounterCount <= 24);
static_assert(sizeof(NodeAreaFixed) == 1024);
// Admin mailbox (kCompatAdminMailbox): an rpc::Channel (rpc.h) of max_nodes slots at
// admin_mailbox_off(pin_slots) in node T's area, through which any node C asks T (ping, ...).
//   req[C-1]  written ONLY by node C (the client; its node id makes it the slot's one writer)
//   resp[C-1] written ONLY by node T (its responder thread)
// This is the one exception to "a node area is written only by its owner": the request lines
// belong to their clients. Nothing resets the mailbox (not attach, not reclaim): seq numbers only
// grow across incarnations (rpc::Channel::resume_seq), so a stale line is never mistaken for new.
constexpr uint64_t admin_mailbox_off(uint32_t pin_slots) {
  return (sizeof(NodeAreaFixed) + uint64_t(pin_slots) * 8 + kCacheLine - 1) / kCacheLine * kCacheLine;
}
// Two lines (request, response) per slot; rpc_admin.cpp asserts this equals rpc::body_bytes.
constexpr uint64_t admin_mailbox_bytes(uint32_t max_nodes) { return uint64_t(max_nodes) * 2 * kCacheLine; }
inline uint64_t pin_value(uint64_t slot, uint32_t gen) { return ((slot + 1) << 24) | gen; }

// ---------------------------------------------------------------------------------------------
// The KV layout fields of a namespace: the ONE list of them. NamespaceEntry embeds them as
// LayoutFields, and the fingerprint, the mismatch message, pool.namespaces() and the Python
// binding's KVLayout reader iterate this list (layout.cpp, bindings.cpp): adding a layout field is
// one line here (and a kFormatMajor bump; a Python layout without the attribute gets the default).
// X(type, name, codec, default, min, max): codec = how the value is named in text: number
// (decimal), dtype (dtype.h codes), kind (LayoutKind names, names.h). min/max bound what a caller
// may ask for; values read from a pool are bounded again before they steer anything.
// heads_per_entry (dense only): 0, an entry holds a whole block as its writer laid it out (all
// num_kv_heads); k >= 1, an entry holds k KV heads of one block (every layer, K and V), so a
// reader of any tensor-parallel size reads exactly its heads (docs/ARCHITECTURE.md, "One block
// layout for every TP size"); num_kv_heads is then the model's total.
#define CXLKV_LAYOUT_FIELDS(X)                                   \
  X(uint64_t, block_bytes, number, 0, 1, format::kMaxBlockBytes) \
  X(uint32_t, dtype, dtype, 1 /* bf16 */, 1, 0xFFFFFFFFu)        \
  X(uint32_t, kind, kind, 1 /* kLayoutDense */, 1, 0xFFFFFFFFu)  \
  X(uint32_t, num_layers, number, 1, 1, 0xFFFFFFFFu)             \
  X(uint32_t, num_kv_heads, number, 1, 1, 0xFFFFFFFFu)           \
  X(uint32_t, head_size, number, 1, 1, 0xFFFFFFFFu)              \
  X(uint32_t, tokens_per_block, number, 16, 1, 0xFFFFFFFFu)      \
  X(uint32_t, heads_per_entry, number, 0, 0, 0xFFFFFFFFu)

// Plain and fixed-width; copied whole into and out of the entry. Nothing hashes its raw bytes (the
// fingerprint walks the list), so padding a new field may introduce is harmless.
struct LayoutFields {
#define CXLKV_LAYOUT_MEMBER(type, name, ...) type name;
  CXLKV_LAYOUT_FIELDS(CXLKV_LAYOUT_MEMBER)
#undef CXLKV_LAYOUT_MEMBER
};
constexpr size_t kLayoutFieldSpace = 48;  // room for LayoutFields in NamespaceEntry's first line
static_assert(sizeof(LayoutFields) <= kLayoutFieldSpace,
              "layout fields outgrew their line: grow NamespaceEntry");

// Namespace entry: identifies one model/KV layout. 512 bytes, 8 cache lines.
// state word = [state:8][node:8][reserved:48]; FREE(0) -> CREATING(node) -> READY. Written under
// ns_lock only; READY entries are immutable, so readers need no lock.
// layout.dtype is a DType code (dtype.h), layout.kind a LayoutKind: whatever alias a caller used,
// the entry holds the canonical code. fingerprint = layout_fingerprint(model_id, layout)
// (layout.cpp): model_id and every layout field, never name or source.
// Strings (model_id, name, source) are NUL-padded, at most N-1 bytes, without NUL or control
// characters when written by this build; readers still treat them as untrusted bytes.
// `source` is provenance for operators (what the identity was derived from, e.g. "weights
// sha256-sampled of /models/x (3 files, 269 MB)"); it is display text, NOT part of the fingerprint:
// two processes that derive the same identity by different routes share the namespace.
enum NsState : uint8_t { kNsFree = 0, kNsCreating = 1, kNsReady = 2 };
enum LayoutKind : uint32_t { kLayoutDense = 1, kLayoutMla = 2, kLayoutOpaque = 3 };
struct alignas(kCacheLine) NamespaceEntry {
  uint64_t state;
  uint64_t fingerprint;
  LayoutFields layout;
  uint8_t reserved[kLayoutFieldSpace - sizeof(LayoutFields)];  // zero
  char model_id[kModelIdBytes];
  char name[kNameBytes];
  char source[kSourceBytes];
};
static_assert(sizeof(NamespaceEntry) == 512);
static_assert(offsetof(NamespaceEntry, model_id) == 64);
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
//   EVICTING(n)   node n is freeing it; readers treat it as absent (from READY or CONDEMNED;
//                 or from WRITING/EVICTING of a gone node, by the node releasing it)
//   TOMBSTONE     free for reuse, does not end a probe              (from WRITING or EVICTING)
//   CONDEMNED     failed its checksum: invisible to lookups and puts, does not end a probe, its
//                 block stays USED (readers that pinned it may still be copying); any node
//                 moves it CONDEMNED -> EVICTING(n) -> TOMBSTONE once no pin names it (the
//                 reader that condemned it after unpinning, an evictor, a reclaim, `pool check`;
//                 an observer, which has no n, straight to TOMBSTONE: no pin can appear any more)
//                                                                    (from READY, by claim;
//                 from EVICTING of a gone node that a reader still pins, by its releaser)
// gen increments on every WRITING claim: a pin (slot, gen) cannot match a later reuse.
// tag = 24 bits of the key hash, so probes skip most foreign slots without reading the key.
// Readers: read state, read fields, re-read state; equal words => consistent snapshot (seqlock).
enum EntryState : uint8_t {
  kEmpty = 0,
  kWriting = 1,
  kReady = 2,
  kEvicting = 3,
  kTombstone = 4,
  kCondemned = 5
};
// chunk/block of a WRITING entry: kNoChunk from the claim until its writer records the block it
// allocated (so that nothing, a reclaimer included, follows the slot's previous block), and for
// the whole life of an intent entry (Pool::reserve without a block: a "being written" marker
// that never becomes READY). Every reader already treats chunk >= chunk_count as "no block".
constexpr uint32_t kNoChunk = 0xFFFFFFFFu;
struct alignas(kCacheLine) IndexEntry {
  uint64_t state;
  uint8_t key[32];
  uint16_t ns_id;      // format 3: 16 bits (namespace ids are <= kMaxNamespaces; the chunk map holds 16)
  uint8_t tenant_row;  // format 3 (quota.h): quota row of the writer's tenant, 1-based; 0 = none
  uint8_t ns_row;      // format 3: quota row of the namespace when the writer charged it; 0 = none
  uint32_t chunk;      // kNoChunk: no block (WRITING only)
  uint16_t block;
  uint16_t depth;     // position in its prefix chain, as the writer knew it (eviction hint)
  uint32_t length;    // payload bytes (<= namespace block_bytes)
  uint64_t checksum;  // XXH3_64 of the payload
};
static_assert(sizeof(IndexEntry) == 64);
inline uint8_t entry_state(uint64_t w) { return uint8_t(w >> 56); }
inline uint8_t entry_node(uint64_t w) { return uint8_t(w >> 48); }
inline uint32_t entry_gen(uint64_t w) { return uint32_t(w >> 24) & 0xFFFFFF; }
inline uint32_t entry_tag(uint64_t w) { return uint32_t(w) & 0xFFFFFF; }
inline uint64_t make_entry_word(uint8_t st, uint8_t node, uint32_t gen, uint32_t tag) {
  return (uint64_t(st) << 56) | (uint64_t(node) << 48) | (uint64_t(gen & 0xFFFFFF) << 24) | (tag & 0xFFFFFF);
}

// Access hints: access[slot] = [ms:48][0xFFFF - depth:16]: the millisecond of the last use, then
// the inverted chain depth, so among blocks used in the same millisecond the deeper ones compare
// older and go first (tail-first eviction). Any node may write it; a lost or stale update only
// changes which victim is chosen, never correctness.

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
  return (uint64_t(st) << 56) | (uint64_t(node) << 48) | (uint64_t(epoch) << 40) |
         (slot & ((1ull << 40) - 1));
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

// ---------------------------------------------------------------------------------------------
// Striped pools (format 2.3, incompat kIncompatStriped; docs/ARCHITECTURE.md "Device interleaving").
// The pool is ONE contiguous range of pool_bytes in every process, cut into stripes of
// stripe_bytes: stripe i lives on device (i % device_count) at device offset
//   data_off(d) + (i / device_count) * stripe_bytes,  data_off(0) = 0, data_off(d > 0) = label_bytes
// so every offset of the format keeps its meaning. Device 0 starts with the pool itself (stripe 0
// holds the header and this table); every other device starts with a DeviceLabel in its first
// label_bytes (outside the striped range), naming the pool it belongs to and its position, so a
// device list in the wrong order, a missing device or a device of another pool is refused at open.
// Both are written once by the creator before the init word says READY, never again; readers
// validate them (checksums, every field bounded) before a single stripe is mapped.
constexpr size_t kStripeTableOff = 1024;  // in the header page, after PoolHeader
constexpr uint32_t kMaxDevices = 16;
constexpr uint64_t kStripeBytesDefault = 2ull << 20;  // Beluga's software interleaving granularity
constexpr uint64_t kStripeBytesMin = 64ull << 10;
constexpr uint64_t kStripeBytesMax = 1ull << 30;
// Label area of devices 1..: label_bytes = min(stripe_bytes, kLabelAlignMax), so every stripe's
// offset on its device is as aligned as its address in the range (devdax maps 2 MiB-aligned
// offsets only; tmpfs huge pages need the same alignment in the file as in memory).
constexpr uint64_t kLabelAlignMax = 2ull << 20;
constexpr uint64_t label_bytes_for(uint64_t stripe_bytes) {
  return stripe_bytes < kLabelAlignMax ? stripe_bytes : kLabelAlignMax;
}
constexpr char kStripeMagic[8] = {'C', 'X', 'L', 'K', 'V', 'S', 'T', '\0'};
constexpr char kLabelMagic[8] = {'C', 'X', 'L', 'K', 'V', 'D', 'V', '\0'};
struct StripeTable {
  char magic[8];                       // kStripeMagic
  uint32_t device_count;               // 2..kMaxDevices
  uint32_t table_bytes;                // sizeof(StripeTable)
  uint64_t stripe_bytes;               // power of two in kStripeBytesMin..kStripeBytesMax; divides pool_bytes
  uint64_t label_bytes;                // label area at the start of devices 1..: label_bytes_for(stripe)
  uint64_t device_bytes[kMaxDevices];  // bytes each device must have (label + its stripes); 0 past count
  uint64_t checksum;                   // XXH3_64 of the bytes before it
};
static_assert(sizeof(StripeTable) == 168);
static_assert(kStripeTableOff >= sizeof(PoolHeader) && kStripeTableOff + sizeof(StripeTable) <= kHeaderBytes);
struct DeviceLabel {
  char magic[8];  // kLabelMagic
  uint8_t pool_uuid[16];
  uint32_t device_index;  // 1..device_count-1 (device 0 carries the header instead)
  uint32_t device_count;
  uint64_t stripe_bytes;
  uint64_t pool_bytes;
  uint64_t label_bytes;
  uint64_t checksum;  // XXH3_64 of the bytes before it
};
static_assert(sizeof(DeviceLabel) == 64);
// The minor version a pool records: the oldest that describes it (single-file pools stay 2.2).
constexpr uint16_t pool_minor(bool striped) { return striped ? 3 : 2; }

}  // namespace cxlkv::format
