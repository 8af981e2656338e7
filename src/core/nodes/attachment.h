// Attachment: this process's place in the node table and, on the multihost backend, in the lock
// area. Owns its node slot (attach, detach, the heartbeat and the fence it feeds), the reaping of
// dead peers and the orchestration of their reclaim (nodes.cpp), and its host slot: the row, the
// tier-1 identity, the one-host-per-row rule and the row-less observer's upgrade (host_slot.cpp).
// Judging a slot is NodeTable's (node_table.h), which it is handed; what a dead node held in the
// store (entries, blocks, the namespace-table lock) is released by the store, asked through Peers.
//
// Invariants it keeps (format.h L1-L5 beside NodeSlot; docs/ARCHITECTURE.md §11 "Host slots"):
// - Our slot's kernel lock is taken before the slot is claimed and dropped only after it is FREE
//   (L1), so no judge of this kernel sees our slot CLAIMED or ALIVE without it.
// - One reclaim at a time per lock descriptor (NodeTable::mu()); every reclaim step is idempotent,
//   so a reclaimer that dies half-way is itself reclaimed and the work redone.
// - A row belongs to one host id: a live node of another host on ours refuses the attach
//   (HostSlotBusyError), or moves a probing attachment on.
// Pool forwards to it (pool.h) and owns the rest of the attachment (mapping, store, admin RPC).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "arbiter.h"
#include "lock_check.h"
#include "node_table.h"
#include "region.h"

namespace cxlkv {

class Attachment {
 public:
  // What the attachment asks of the rest of the pool (Pool implements it).
  class Peers {
   public:
    // Release what dead node `node` (1-based; its slot is RECLAIMING by us) held in the store:
    // index entries it was writing or evicting, chunks and blocks it claimed, the namespace-table
    // lock and namespaces it was creating (Index, Allocator, Namespaces ::release_of_node, in order).
    virtual void release_of_node(uint8_t node) = 0;
    // How many of our pin slots may be in use (Index::pin_high_water): cleared at detach.
    virtual uint64_t pin_high_water() const = 0;
    // False once the mapped file shrank (its pages are gone: nothing to clean there).
    virtual bool mapping_intact() const = 0;
    // This attachment now has a node (answer `pool ping`), or is about to lose it (stop answering).
    virtual void start_admin_responder() = 0;
    virtual void stop_admin_responder() = 0;

   protected:
    ~Peers() = default;
  };

  // Who this attachment is, set once at open (Pool::validate_and_attach). model, emulated_slot:
  // a simulated host of the emulator (src/sim): no heartbeat thread, no lock file, its row given.
  struct Identity {
    uint32_t pid = 0;
    bool emulated = false;
    CacheModel* model = nullptr;
    int emulated_slot = 0;
    int want_slot = -1;  // OpenOptions::host_slot
  };

  // path: the pool's path, for messages. table: the judge of the node table (its identity and lock
  // already set when open() runs).
  Attachment(Region& region, NodeTable& table, const std::string& path, Peers& peers)
      : region_(region), table_(table), path_(path), peers_(peers) {}

  void set_identity(const Identity& id) { id_ = id; }
  // After the header was adopted (read-write pools only): an observer (attach=false) on the multihost
  // backend takes no row yet (row-less); otherwise the row (multihost), a reap of the dead, a node
  // slot (attach) and the settled row.
  void open(bool attach);
  // Stops the heartbeat and frees our slot (after FREE, its lock); nothing for an observer without one.
  void detach_node();
  // Forgets the attachment without one more store into the pool (fenced: peers reclaim it by lease).
  void abandon();
  // The heartbeat handle forgotten (close of a forked child: the thread is the parent's).
  void forget_heartbeat() { heartbeat_ = 0; }

  // --- who we are --------------------------------------------------------------------------
  const uint32_t& node_id() const { return node_id_; }  // 1-based; 0 = not attached
  const uint64_t& node_word() const { return node_word_; }
  const bool& observer() const { return observer_; }  // opened with attach=false
  std::atomic<bool>& fenced() { return fenced_; }     // reclaimed while alive (L3), or fenced itself
  const std::function<bool()>* intact() const { return &intact_; }
  const bool& row_less() const { return row_less_; }                 // a multihost observer without a row yet
  const std::unique_ptr<Bakery>& bakery() const { return bakery_; }  // null without a row
  uint32_t host_slot() const { return host_slot_; }
  std::atomic<uint64_t>& reaped_unreported() { return reaped_unreported_; }  // since the last check
  uint64_t last_reap_ns() const { return last_reap_ns_.load(std::memory_order_relaxed); }

  // --- heartbeat and healing -------------------------------------------------------------------
  // One heartbeat of an emulated host (the heartbeat thread does it for real attachments).
  bool heartbeat_tick();
  // One pass of an emulated host's row healing (Bakery::heal_own_row): the stripes reset.
  uint32_t heal_lock_row();

  // --- reaping (nodes.cpp) -------------------------------------------------------------------
  // Reclaims the nodes judged dead; returns how many. undecided (may be null): counts the nodes of
  // another kernel not judged yet (no lease of observation), which a caller may watch longer.
  uint64_t reap_pass(uint64_t* undecided);
  uint64_t reap_dead_nodes() { return reap_pass(nullptr); }
  // Pool::reap_node (pool.h) states it.
  NodeInfo reap_node(uint32_t id, bool force, bool* reclaimed, uint64_t wait_ms);
  bool any_dead_node() { return table_.any_dead(node_id_, node_word_); }

  // --- host slots (host_slot.cpp) ------------------------------------------------------------
  // A row-less observer that must write: a row and, if one is free, a node slot.
  void become_writer();
  // Which rows have a live node now (lock_check.h).
  RowUse row_use();
  // `pool check`'s reader of the lock area: our Bakery, or for a row-less observer one that owns
  // no row (its slot is lock_hosts) and is only read through.
  Bakery& lock_view();

 private:
  // observer: take a node slot only if one is free now (never wait, never fail).
  void attach_node(bool observer = false);
  NodeInfo judge(uint32_t idx, uint64_t word) { return table_.judge(idx, word, node_id_, node_word_); }
  bool reclaim_judged(uint32_t idx, uint64_t word, const NodeInfo& n, bool force);
  void reclaim_node(uint32_t idx, uint64_t word);
  uint64_t lock_offset(uint32_t idx) const { return table_.lock_offset(idx); }
  void setup_arbiter(int want_slot, bool observer);
  void make_bakery(uint32_t row);
  uint32_t check_host_slot_unique();
  void settle_host_slot(bool observer);
  uint32_t probe_row(const std::vector<bool>& avoid);
  void release_dead_rows(uint32_t idx, uint64_t reclaiming_word);
  uint64_t participant_offset(uint32_t i) const {
    return (1ull << 49) + (table_.host_id() & 0xFFFFF) * kParticipants + i;
  }
  static constexpr uint32_t kParticipants = 4096;  // tier-1 participant bytes per host id

  Region& region_;
  NodeTable& table_;
  const std::string& path_;
  Peers& peers_;
  // The region's parts under the short names the protocol files use (one owner: region_).
  Coherence& coh_ = region_.coh();
  const format::PoolHeader* const& hdr_ = region_.header_ref();
  // The judge's identity and lock under the names the protocol files use (one owner: table_).
  const uint64_t& host_id_ = table_.host_id();
  liveness::LockFile& lock_ = table_.lock_file();
  const uint32_t& domain_ = table_.domain();
  std::mutex& reap_mu_ = table_.mu();  // one reclaim at a time per lock descriptor
  format::NodeSlot* node_slot(uint32_t idx) const { return region_.node_slot(idx); }
  char* node_area(uint32_t idx) const { return region_.node_area(idx); }
  format::NodeAreaFixed* node_fixed(uint32_t idx) const { return region_.node_fixed(idx); }
  uint64_t* pins(uint32_t idx) const { return region_.pins(idx); }
  Identity id_{};
  uint32_t node_id_ = 0;
  uint64_t node_word_ = 0;
  bool observer_ = false;
  uint64_t heartbeat_ = 0;           // handle with the process heartbeat thread
  std::atomic<bool> fenced_{false};  // this node was reclaimed while alive (L3), or fenced itself
  std::function<bool()> intact_ = [this] { return peers_.mapping_intact(); };  // for the heartbeat
  // multihost (arbiter.h): the cross-host lock and fence; the time before the last published beat
  std::unique_ptr<Bakery> bakery_;
  std::atomic<uint64_t> last_beat_ns_{0};
  std::atomic<bool> beating_{false};  // heartbeat_tick re-entry guard
  uint32_t host_slot_ = 0;
  bool probing_ = false;       // the row was probed, not configured: it may move (settle_host_slot)
  uint32_t participant1_ = 0;  // tier-1 participant byte + 1 this attachment holds (0: none)
  // multihost observer with no row yet: it reads only (row_less_arbiter_ refuses every arbitrated
  // write) until become_writer() takes a row and a node slot (host_slot.cpp, "Observers").
  bool row_less_ = false;
  std::unique_ptr<Arbiter> row_less_arbiter_;
  std::mutex writer_mu_;  // become_writer: one upgrade
  std::unique_ptr<Bakery> lock_reader_;
  std::atomic<uint64_t> reaped_unreported_{0};  // reclaims since open or the last check (F20)
  std::atomic<uint64_t> last_reap_ns_{0};       // when reap_pass last started
  // multihost, after each beat: reset what no host-mate holds in our own lock row (a stray write,
  // a fenced holder's ticket). The heartbeat stops before bakery_ changes or goes (detach_node).
  std::function<void()> chores_ = [this] {
    if (bakery_) bakery_->heal_own_row();
  };
};

}  // namespace cxlkv
