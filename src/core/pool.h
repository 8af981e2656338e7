// Pool: one attachment of this process to a cxlkv pool, and the façade over the core's internal
// types: Region (region.h: the mapped bytes, the validated header copy, bounds-checked accessors,
// coherence) and the protocols that use it. Owns the mapping, the node slot (through Attachment,
// attachment.h) and the process-local helpers (pin-slot allocator, allocation cursors).
// Thread-safe: several threads of one process may use one Pool (the Python binding releases the
// GIL during copies).
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator.h"
#include "arbiter.h"
#include "arena_view.h"
#include "attachment.h"
#include "check.h"
#include "checksum.h"
#include "clock.h"
#include "coherence.h"
#include "copy_threads.h"
#include "errors.h"
#include "evictor.h"
#include "format.h"
#include "geometry.h"
#include "index.h"
#include "index_scan.h"
#include "layout.h"
#include "liveness.h"
#include "lock_check.h"
#include "mapping.h"
#include "namespaces.h"
#include "node_table.h"
#include "quotas.h"
#include "region.h"
#include "rpc_admin.h"
#include "store_types.h"
#include "stripe_table.h"
#include "transfer.h"

namespace cxlkv {

// How Pool::open maps and trusts an existing pool (F11, F23).
struct OpenOptions {
  bool populate = false;  // fault the whole mapping in now
  // Inspect only (pool info): O_RDONLY, a private copy-on-write mapping, no node slot, no reap;
  // works for a reader without write access. Namespaces cannot be opened. The owner check is
  // skipped: nothing of ours is put into the pool.
  bool read_only = false;
  // Accept a pool owned by another user (not root), or one that others can write. Such a user can
  // read every block and corrupt the pool at will; the default refuses it.
  bool allow_foreign_owner = false;
  // Accept a pool whose group is one of ours (owner check by group instead of by user).
  bool allow_group = false;
  // false: an observer (check, info, stats, reap, destroy): it takes no node slot and, on the
  // multihost backend, no host slot (row) until it has something to write (Attachment::become_writer),
  // so looking never costs a host its attach; it cannot open namespaces.
  bool attach = true;
  // multihost: this host's row in the lock area, 0..lock_hosts-1; -1: CXLKV_HOST_SLOT, else
  // host_id % lock_hosts. Every process of one host shares its row (the tier 1 of arbiter.h); two
  // host ids on one row are refused (HostSlotBusyError).
  int host_slot = -1;
};

// A simulated host of the non-coherence emulator (src/sim): the pool is its private copy of the
// shared region, every flush/invalidate goes through `model`. Test only.
struct EmulatedHost {
  char* base = nullptr;  // this host's private copy of the pool
  uint64_t size = 0;
  CacheModel* model = nullptr;
  uint64_t host_id = 0;  // liveness identity (lease only: no lock file)
  int host_slot = 0;
};

struct DestroyOptions {
  bool ignore_attached = false;  // destroy even while live nodes are attached
  bool remove_invalid = false;   // also remove a file that is not a (complete) pool: 0 bytes, bad magic
};

class Pool final : private Allocator::Peers,
                   private Index::Peers,
                   private Namespaces::Peers,
                   private Attachment::Peers,
                   private DeviceTransfers::Peers,
                   private Checker::Peers {
 public:
  static std::unique_ptr<Pool> create(const std::string& path, const CreateOptions& opt, bool exist_ok);
  // attach=false: an observer (check, info, stats, reap) that takes no node slot, so it works on a
  // full node table and never fills one; it may still reclaim dead nodes. It cannot open namespaces.
  static std::unique_ptr<Pool> open(const std::string& path, bool populate = false, bool attach = true);
  static std::unique_ptr<Pool> open(const std::string& path, const OpenOptions& opt);
  // `path` may name several devices, comma-separated (a striped pool, striped_pool.cpp).
  static void destroy(const std::string& path, const DestroyOptions& opt = {});
  // Attaches a simulated host to an emulated region (tests; src/sim). The region must hold a pool
  // created by create(); heartbeats are this host's own business (heartbeat_tick).
  static std::unique_ptr<Pool> open_emulated(const EmulatedHost& host, bool attach = true);
  // One heartbeat of an emulated host (the heartbeat thread does it for real attachments).
  bool heartbeat_tick() { return attachment_.heartbeat_tick(); }
  // One pass of an emulated host's row healing (Bakery::heal_own_row, which the heartbeat thread
  // runs after each beat for real attachments): the stripes reset; 0 without a row or a node.
  uint32_t heal_lock_row() { return attachment_.heal_lock_row(); }
  uint32_t host_slot() const { return attachment_.host_slot(); }
  // multihost: whether this attachment holds a row of the lock area (an observer holds none until
  // it writes: become_writer).
  bool holds_row() const { return bakery_ != nullptr; }
  const Bakery* bakery() const { return bakery_.get(); }
  // Node ids (1-based) whose slot is not FREE after reaping the dead ones, with their pids.
  std::vector<std::pair<uint32_t, uint32_t>> attached_nodes();
  ~Pool();
  void close();
  // Forgets this attachment without one more store into the pool (a crashed or fenced simulated
  // host; or a process that knows it was fenced): peers reclaim its node by lease.
  void abandon();
  bool closed() const { return !region_.base(); }
  // Throws if the pool is closed, or if this attachment was inherited through fork(): the child
  // does not own the parent's node slot and must open the pool itself.
  // Also throws once this node was reclaimed while alive (fenced: liveness invariant L3).
  void ensure_usable() const override;  // (and DeviceTransfers::Peers)
  // False once the mapped file shrank below the mapping (or a SIGBUS was answered): the pool's
  // pages are gone; close and lease release then skip their stores. One fstat.
  bool mapping_intact() const override;  // (Attachment::Peers and DeviceTransfers::Peers)

  // --- identity ---------------------------------------------------------------------------
  const std::string& path() const { return path_; }
  uint64_t size() const override { return emu_.base ? emu_.size : map_.size(); }  // (DeviceTransfers::Peers)
  uint32_t node_id() const { return node_id_; }
  const format::PoolHeader& header() const { return *hdr_; }  // the private validated copy
  bool read_only() const { return read_only_; }
  // The mapped file's identity (fstat of the fd that was mapped) and whether `path` still names it.
  uint64_t file_dev() const { return map_.file_dev(); }
  uint64_t file_ino() const { return map_.file_ino(); }
  // The page size that backs this process's mapping of the pool, as obtained (huge_pages.h).
  PageInfo page_info() const { return map_.page_info(); }
  bool file_replaced() const;
  // True once a SIGBUS in this pool's mapping was turned into zero pages (file shrunk under us).
  bool truncated() const { return map_.truncated(); }
  // Throws TruncatedError (naming the path and its current size) if truncated().
  void check_truncated() const;
  Backend backend() const { return coh_.backend(); }

  // --- namespaces (Namespaces, store/namespaces.h) -------------------------------------------
  NsHandle open_namespace(const Layout& layout) { return namespaces_.open(layout); }
  // --- device interleaving (placement.cpp, striped_pool.cpp) --------------------------------
  const StripeGeometry& stripes() const { return allocator_.stripes(); }
  // The mapped devices of a striped pool (device 0 first); empty for a single-device pool.
  const std::vector<MappedDevice>& device_files() const { return map_.devices(); }
  // The handle with its blocks placed on `device` only (-1: anywhere). Throws ArgumentError for a
  // device out of range, or a block larger than a stripe (it could never lie on one device).
  NsHandle bind_device(const NsHandle& ns, int device) const {
    return allocator_.bind_device(ns, device, path_);
  }
  // Where the payload of `key` lies: pool offset and length; false if absent.
  bool locate(const NsHandle& ns, const Key& key, uint64_t* offset, uint64_t* length) {
    ensure_usable();
    return index_.locate(ns, key, offset, length);
  }
  // The arena's bounds (arena_view.h), for row gathers from offsets a caller kept (token_rows.cpp).
  // No ensure_usable() here: taken under an operation that checked it (bindings' OpGuard).
  ArenaView arena_view() const {
    if (!hdr_) return {};
    return {region_.base(), hdr_->arena_off, hdr_->arena_off + hdr_->chunk_count * chunk_stride()};
  }
  // The pool bytes [offset, offset + length) if they lie wholly inside the arena, else null.
  const char* arena_bytes(uint64_t offset, uint64_t length) const {
    return arena_view().bytes(offset, length);
  }
  std::vector<DeviceUse> device_usage();         // pool.cpp
  std::vector<NamespaceUse> namespace_usage() {  // one entry per listed namespace, by id
    ensure_usable();
    return allocator_.namespace_usage();
  }
  std::vector<std::pair<NsHandle, Layout>> list_namespaces() { return namespaces_.list(); }

  // --- quotas (Namespaces: set under the namespace-table lock; Quotas: the rows, format/quota.h)
  // The row of tenant `tenant`, created (under the namespace-table lock) on first use; 1-based.
  uint8_t tenant_row(const std::string& tenant) { return namespaces_.tenant_row(tenant); }
  // Sets the limit of a namespace (ns_id, tenant "") or a tenant (ns_id 0): max_bytes and/or
  // max_ppm of the arena, 0 = none (both 0 clears it). Returns the row.
  uint32_t set_quota(uint32_t ns_id, const std::string& tenant, uint64_t max_bytes, uint32_t max_ppm) {
    return namespaces_.set_quota(ns_id, tenant, max_bytes, max_ppm);
  }
  std::vector<QuotaInfo> quotas() { return quotas_.rows(hdr_->max_nodes); }  // every row in use, with usage

  // --- block operations (the prefix index: Index, store/index.h) ------------------------------
  // put: true if the key is readable afterwards (stored now or already there); false if it is
  // only in flight by another live writer, or no block could be allocated or evicted.
  PutResult put_ex(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth) {
    return index_.put_ex(ns, key, src, n, depth);
  }
  bool put(const NsHandle& ns, const Key& key, const Piece* src, size_t n, uint16_t depth) {
    return index_.put(ns, key, src, n, depth);
  }
  // get: scatter the payload into dst pieces (total >= length); false on miss or checksum failure.
  bool get(const NsHandle& ns, const Key& key, const Piece* dst, size_t n, uint64_t* length) {
    return index_.get(ns, key, dst, n, length);
  }
  bool contains(const NsHandle& ns, const Key& key) { return index_.contains(ns, key); }
  size_t match_prefix(const NsHandle& ns, const Key* keys, size_t n) {
    return index_.match_prefix(ns, keys, n);
  }
  bool remove(const NsHandle& ns, const Key& key) { return index_.remove(ns, key); }
  // acquire: pins the leading present keys. All leases of this process together hold at most
  // lease_cap() = pin_slots - get_pin_reserve() pins, so single gets always find a slot; a lease
  // cut short by that cap (or by a full pin array) counts `pins_exhausted`.
  std::vector<PinRef> acquire(const NsHandle& ns, const Key* keys, size_t n) {
    return index_.acquire(ns, keys, n);
  }
  uint32_t lease_cap() const { return index_.lease_cap(); }
  uint32_t get_pin_reserve() const { return index_.get_pin_reserve(); }
  // Block-less intents (reserve without a block): the cap per node (the creator's share of the
  // index, SharedWords.init) and how many this node holds now. A reserve past the cap is refused
  // (Reservation::capped) before it touches the index, so one node's flood of intents never
  // takes the slots other nodes' puts need.
  uint64_t intent_cap() const { return transfers_.intent_cap(); }
  uint64_t intents_held() const { return transfers_.intents_held(); }
  void release(const std::vector<PinRef>& pins) { index_.release(pins, mapping_intact()); }

  // --- batched gather/scatter (copy_engine.cpp) ---------------------------------------------
  // Gathers, for key i, the fragments at block id block_ids[i] into one pool block (depth of key
  // i in its chain = start_depth + i). Returns the number of leading keys readable afterwards
  // (stored now or already READY; a key only in flight by another writer is not counted).
  size_t store(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
               const int64_t* block_ids, uint32_t start_depth = 0) {
    return store_blocks(
        ns, keys, n, frags, block_ids, start_depth,
        [&](const Key& k, const Piece* p, size_t np, uint16_t depth) { return put(ns, k, p, np, depth); });
  }
  // Scatters blocks back; returns the number of leading keys loaded (a miss, a checksum failure
  // or an entry shorter than ns.block_bytes stops the count; later keys may still have been
  // written, and so may the front of the block that stopped it).
  size_t load(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
              const int64_t* block_ids) {
    return load_blocks(
        ns, keys, n, frags, block_ids,
        [&](const Key& k, const Piece* p, size_t np, uint64_t* len) { return get(ns, k, p, np, len); });
  }
  static void set_copy_threads(unsigned n) { cxlkv::set_copy_threads(n); }

  // --- device transfers (DeviceTransfers, transfer/transfer.h; forwarded in pool.cpp) --------
  // reserve: an entry in WRITING and a block of ns.block_bytes for the key, at r->offset in the
  // pool (r->state reserved), or why not (present, in_flight, failed: nothing held). Without a
  // block: the entry only (an intent marker; its chunk stays kNoChunk), released by abort.
  void reserve(const NsHandle& ns, const Key& key, uint16_t depth, Reservation* r, bool with_block = true);
  // commit: the device's copy into a reserved block is complete. Checks that the entry and the
  // block are still this reservation's, checksums the pool bytes and publishes READY. False: not
  // published (the reservation was lost or its entry corrupted), and released.
  bool commit(const NsHandle& ns, Reservation* r);
  void abort(const NsHandle& ns, Reservation* r);  // releases a reserved block: nothing published
  // pin_verified: pins the leading present keys (as lease pins) whose block holds exactly
  // ns.block_bytes and whose pool bytes match their checksum; the first mismatch is condemned (a
  // miss, here and everywhere) and ends the count. Appends to *out; returns the count.
  size_t pin_verified(const NsHandle& ns, const Key* keys, size_t n, std::vector<VerifiedBlock>* out);
  // recheck: after the device read them, the leading count of `blocks` still READY under the word
  // they were pinned with and matching their checksum; the first mismatch is condemned.
  size_t recheck(const std::vector<VerifiedBlock>& blocks);
  void unpin_verified(std::vector<VerifiedBlock>* blocks);
  // The mapped pool bytes [base, base + size()), for a device to map (cudaHostRegister): offsets
  // handed out above are relative to it. Null when closed.
  char* mapped_base() const { return region_.base(); }
  // The mapping, taken out of a closed pool by a caller that lets devices read it (bindings:
  // views of the pool bytes outlive close(); their owner unmaps it when the last one goes).
  Mapping take_mapping_on_close();
  // [offset, length) ranges covering the pool, each at most max_bytes, cut on pages between two
  // chunks' payloads (no block is split): a device registers the mapping one range at a time
  // (cudaHostRegister of >= 512 GiB at once fails on recent drivers). Throws ArgumentError when
  // max_bytes is smaller than a chunk.
  std::vector<std::pair<uint64_t, uint64_t>> transfer_ranges(uint64_t max_bytes, uint64_t page) const;

  // --- maintenance (Attachment: nodes.cpp; check.cpp) ----------------------------------------
  // Returns nodes reclaimed (Index::Peers, Namespaces::Peers).
  uint64_t reap_dead_nodes() override { return attachment_.reap_dead_nodes(); }
  // Reclaims node `id` if it is judged dead (waiting up to one lease to judge a node of another
  // kernel), or, with force, even if alive (its process is fenced: L3). Returns the judgment made
  // before acting; verdict kDead means it was reclaimed (or kAlive + force: reclaimed anyway).
  // wait_ms > 0: keep watching a node judged alive or undecided until it is dead (then reclaim
  // it) or wait_ms passed.
  NodeInfo reap_node(uint32_t id, bool force, bool* reclaimed, uint64_t wait_ms = 0) {
    return attachment_.reap_node(id, force, reclaimed, wait_ms);
  }
  std::vector<NodeInfo> nodes() { return node_table_.verdicts(node_id_, node_word_); }  // judged now
  // Verifies every invariant of format.h (after reaping the dead, watching nodes of another kernel
  // for up to a lease); with repair, also releases what nobody else ever will (check.cpp:
  // abandoned entries, unpinned condemned and leaked blocks; lock_check.cpp: tickets in rows no
  // host owns). Without it, check only resets what this attachment owns anyway (its own lock row).
  // watch_ms: how long to watch nodes of another kernel that are not judged yet (undecided nodes
  // make the report fail): 0 = not at all (a library call must not block for a lease, which the
  // header may set to an hour), < 0 = a lease and a quarter (`cxlkv pool check`).
  // The protocol is Checker's (store/check.h); what only the attachment has it asks through
  // Checker::Peers, below.
  CheckReport check(bool repair = false, int64_t watch_ms = 0) {
    return Checker(region_, index_, quotas_, namespaces_, node_table_, node_id_, read_only_, *this)
        .run(repair, watch_ms);
  }
  // --- admin RPC (rpc_admin.cpp) -------------------------------------------------------------
  bool has_admin_mailbox() const { return admin_.present(); }
  // One round trip through node `node`'s admin mailbox; needs an attached pool (our node id is
  // our request slot there). Waits at most timeout_ms for the answer.
  PingResult ping(uint32_t node, uint64_t timeout_ms) {
    ensure_usable();
    return admin_.ping(node_id_, node, timeout_ms, path_);
  }
  std::vector<uint64_t> counters();                         // summed over attached nodes
  Occupancy occupancy() { return allocator_.occupancy(); }  // allocator.h
  // --- index scan (index_scan.cpp): the READY entries of slots [first, first + count) ---------
  // Entries that stay in flight across a few re-reads go to `unstable` (their slot), so a caller
  // diffing two scans keeps what it knew of them instead of reading them as gone.
  std::vector<IndexRecord> scan_index(uint64_t first, uint64_t count, std::vector<uint64_t>* unstable) {
    ensure_usable();
    return cxlkv::scan_index(region_, first, count, unstable);
  }
  uint64_t index_slots() const { return slot_mask_ + 1; }

 private:
  Pool() = default;
  void validate_and_attach(bool fresh, bool attach = true);
  // striped_pool.cpp: a pool over several devices (create/destroy/validation of the stripe table)
  static std::unique_ptr<Pool> create_striped(const std::string& spec, format::PoolHeader h,
                                              const CreateOptions& opt, bool exist_ok);
  static void destroy_striped(const std::string& spec, const DestroyOptions& opt);
  // The one validator of a striped pool's devices before a stripe is mapped (the mapper only maps).
  static Mapping map_striped(const std::string& spec, const OpenOptions& opt);
  // destroy's one way in, plain and striped: the pool opened without attaching (nullptr: it holds
  // no valid pool and opt.remove_invalid allows that), then the one refusal unless
  // opt.ignore_attached: PoolInUseError naming the attached processes.
  static std::unique_ptr<Pool> open_for_destroy(const std::string& spec, const DestroyOptions& opt);
  void validate_striping(const format::PoolHeader& h, const char* base);
  bool devices_replaced() const;
  bool devices_intact() const;
  uint64_t lock_offset(uint32_t idx) const { return node_table_.lock_offset(idx); }  // node_table.h

  // The region's bounds-checked accessors (region.h), under the names the protocol files use.
  format::NodeSlot* node_slot(uint32_t idx) const { return region_.node_slot(idx); }
  char* node_area(uint32_t idx) const { return region_.node_area(idx); }
  format::NodeAreaFixed* node_fixed(uint32_t idx) const { return region_.node_fixed(idx); }
  uint64_t* pins(uint32_t idx) const { return region_.pins(idx); }
  format::NamespaceEntry* ns_entry(uint32_t id) const { return region_.ns_entry(id); }
  format::IndexEntry* entry(uint64_t slot) const { return region_.entry(slot); }
  uint64_t* access(uint64_t slot) const { return region_.access(slot); }
  uint64_t* chunk_word(uint64_t chunk) const { return region_.chunk_word(chunk); }
  uint64_t* block_desc(uint64_t chunk, uint32_t block) const { return region_.block_desc(chunk, block); }
  char* block_payload(const NsHandle& ns, uint64_t chunk, uint32_t block) const {
    return region_.block_payload(ns.geo, chunk, block);
  }
  uint64_t chunk_stride() const { return region_.chunk_stride(); }
  format::SharedWords* shared() const { return region_.shared(); }

  bool owner_closed(uint8_t node) override;  // of a FREE node slot (pool.cpp; Index::Peers)
  bool snapshot(uint64_t slot, uint64_t word, format::IndexEntry* out) const {
    return region_.snapshot(slot, word, out);
  }
  // The allocator (allocator.h) asks the store back only to steal a chunk (Allocator::Peers: the
  // namespaces, and the index's half of draining, Index::evict_owner).
  std::vector<NsHandle> namespace_handles() override { return namespaces_.handles(); }
  bool evict_owner(uint64_t chunk, uint32_t block, uint64_t desc, uint64_t fenced) override {
    return index_.evict_owner(chunk, block, desc, fenced);
  }
  bool entry_points_back(uint64_t slot, uint64_t chunk, uint32_t block) override {
    return index_.entry_points_back(slot, chunk, block);
  }
  void count(format::Counter c, uint64_t v = 1);
  // The node table's reads (node_table.h): attached now in the incarnation whose epoch ends in
  // `epoch8`; can no longer finish what it started.
  bool incarnation_alive(uint8_t node, uint8_t epoch8) const {
    return node_table_.incarnation_alive(node, epoch8);
  }
  bool writer_gone(uint8_t node) override { return node_table_.gone(node, node_id_, node_word_); }

  std::string path_;
  Mapping map_;
  // The mapped pool: base, the header validated at open and copied out of shared memory (F1),
  // the geometry derived from it, the accessors and the coherence layer (region.h).
  Region region_;
  // The region's parts under the short names every protocol file uses (one owner: region_).
  // hdr_ is null while closed; coh_ is reassigned once (setup_arbiter: the multihost arbiter).
  Coherence& coh_ = region_.coh();
  const format::PoolHeader* const& hdr_ = region_.header_ref();
  const uint64_t& slot_mask_ = region_.slot_mask();
  const uint64_t& desc_bytes_ = region_.desc_bytes();
  bool read_only_ = false;
  uint32_t pid_ = 0;
  uint64_t fork_generation_ = 0;
  EmulatedHost emu_{};  // set for a simulated host only
  int want_slot_ = -1;  // OpenOptions::host_slot
  // liveness: the judge of the node table (node_table.h), and its identity and lock under the
  // names pool.cpp uses (one owner: node_table_).
  NodeTable node_table_{region_};
  uint64_t& host_id_ = node_table_.host_id();
  liveness::LockFile& lock_ = node_table_.lock_file();
  uint32_t& domain_ = node_table_.domain();
  // This process's node slot, heartbeat, reaping and host slot (attachment.h: nodes.cpp,
  // host_slot.cpp); what it owns, under the names the store's files use (one owner: attachment_).
  Attachment attachment_{region_, node_table_, path_, *this};
  const uint32_t& node_id_ = attachment_.node_id();  // 1-based; 0 = not attached
  const uint64_t& node_word_ = attachment_.node_word();
  const bool& observer_ = attachment_.observer();  // opened with attach=false: no namespaces
  std::atomic<bool>& fenced_ = attachment_.fenced();
  const std::unique_ptr<Bakery>& bakery_ = attachment_.bakery();  // multihost: our row's lock
  const bool& row_less_ = attachment_.row_less();                 // multihost observer, no row yet
  std::atomic<uint64_t>& reaped_unreported_ = attachment_.reaped_unreported();
  // Namespaces::Peers and Checker::Peers: a row-less observer takes a row before it writes.
  void become_writer() override { attachment_.become_writer(); }
  uint64_t reap_pass(uint64_t* undecided) { return attachment_.reap_pass(undecided); }
  // Checker::Peers (store/check.h): what `pool check` asks of the attachment.
  uint64_t reap_for_check(uint64_t* undecided) override { return reap_pass(undecided); }
  void beat_while_watching() override {
    if (emu_.base) heartbeat_tick();  // an emulated host beats from its own thread
  }
  uint64_t take_reclaimed() override { return reaped_unreported_.exchange(0, std::memory_order_relaxed); }
  uint64_t intent_cap_per_node() override { return intent_cap(); }
  bool check_lock_area(LockReport& l) override;  // LockCheck (lock_check.h) with our view (pool.cpp)
  // Attachment::Peers: a dead node's store state released by its owners, in order (pool.cpp).
  void release_of_node(uint8_t node) override;
  uint64_t pin_high_water() const override { return index_.pin_high_water(); }

  Allocator allocator_{region_, *this};  // blocks, chunks, placement; its cursors (allocator.h)
  // quotas: the table's reader (quotas.h); tenants and limits are set under the namespace-table
  // lock (Namespaces), and a put's charge and a block's release are Index's
  Quotas quotas_{region_};
  // The namespace table (namespaces.h): open, list, its lock; tenants and limits set under it.
  Namespaces namespaces_{region_, quotas_, path_, node_id_, read_only_, observer_, *this};
  // The prefix index (index.h): lookup, insert, pins, eviction; its victim queues and lease pins.
  Index index_{region_, allocator_, quotas_, node_id_, node_word_, *this};
  // The device transfers (transfer.h): reserve/commit/abort, verified loads; this node's intents.
  DeviceTransfers transfers_{region_, index_, allocator_, quotas_, node_id_, *this};
  uint64_t last_reap_ns() const override { return attachment_.last_reap_ns(); }  // Index::Peers
  // admin RPC (rpc_admin.cpp): this node's mailbox responder thread (Attachment::Peers: started
  // once we have a node, stopped before its slot is freed)
  void start_admin_responder() override {
    if (admin_.present() && node_id_ && !read_only_)
      admin_.start({node_id_, node_word_, pid_, host_id_, &fenced_, attachment_.intact()});
  }
  void stop_admin_responder() override { admin_.stop(); }
  AdminMailbox admin_{region_};
};

}  // namespace cxlkv
