// Attachment (attachment.h), multihost: the host slot (row of the lock area) of an attachment, its
// tier-1 identity, and the rule that one row belongs to one host. See docs/ARCHITECTURE.md §11
// "Host slots" and arbiter.h.
//
// Every process of one host id shares one row: the processes of a row share it through the tier-1
// word of each stripe (a CAS inside one coherence domain); two host ids on one row would be two
// coherence domains CASing one word and writing one line, so that is never allowed.
//
// Which row: CXLKV_HOST_SLOT or OpenOptions::host_slot name one (configuration: a live node of
// another host there is HostSlotBusyError). Otherwise the row is probed: the row of a live
// host-mate if there is one, else the first row from host_id % lock_hosts with no live node of
// another host id. Every attachment, observers included, publishes its row in its node slot
// (NodeSlot::host_slot), so the next prober sees it; of two hosts that probe the same free row at
// the same instant, the one that checks later (after both published themselves) sees the other
// and moves on. A configured row stays configuration: a prober that squats it makes the configured
// host's attach fail (HostSlotBusyError) until the prober detaches, so a pod that configures rows
// configures them for every process (admin shells included).
//
// Observers (`pool check`, `stats`, the exporter, `top`: attach=false) take no row and no node slot
// while they only read: reads need no lock, and an observer holding a row would make a host
// configured onto it fail (HostSlotBusyError), one holding a node slot would fill the node table
// (NodeTableFullError). A row cannot be held invisibly (another host could probe it: two coherence
// domains on one tier-1 word), so a row-less observer makes no arbitrated write at all: its
// Coherence has a RowLessArbiter that refuses them. When it must write (a dead node to reclaim,
// `pool reap`, `check --repair`) it becomes a writer: a probed row and a node slot if one is free,
// published like any attachment's, for the rest of its open. Reclaiming frees at least the slot it
// takes; the row is visible, so a host configured onto it meanwhile is refused until the command
// exits (the one window left: seconds, and only while a dead node is being cleaned up). An observer on
// a full node table has no node slot: it takes a row with a live host-mate, else a row with no live
// node (nobody can attach while the table is full).
#include <cstdlib>
#include <string>

#include "attachment.h"
#include "errors.h"

namespace cxlkv {

using namespace format;

namespace {
// The row named by configuration, or -1 (probe).
int configured_slot(int want, uint32_t hosts) {
  if (want < 0) {
    const char* e = std::getenv("CXLKV_HOST_SLOT");
    if (!e) return -1;
    char* end = nullptr;
    long v = std::strtol(e, &end, 10);
    if (!*e || *end || v < 0 || v >= long(hosts))
      throw ArgumentError("CXLKV_HOST_SLOT must be in 0.." + std::to_string(hosts - 1));
    want = int(v);
  }
  if (uint32_t(want) >= hosts) throw ArgumentError("host slot must be in 0.." + std::to_string(hosts - 1));
  return want;
}
}  // namespace

RowUse Attachment::row_use() {
  RowUse use;
  use.mate.assign(hdr_->lock_hosts, false);
  use.other.assign(hdr_->lock_hosts, 0);
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    if (i + 1 == node_id_) continue;
    NodeSlot* s = node_slot(i);
    const uint64_t w = coh_.read(&s->state);
    if (node_state(w) != kNodeAlive) continue;
    coh_.invalidate(s, sizeof *s);
    const uint64_t row1 = s->host_slot, host = s->host_id, flags = s->flags;
    if (row1 == 0 || row1 > hdr_->lock_hosts) continue;
    {
      std::lock_guard<std::mutex> g(reap_mu_);
      if (judge(i, w).verdict == NodeInfo::kDead) continue;  // undecided counts as live
    }
    if (host == host_id_ && (flags & kNodeSharesHostSlot))
      use.mate[row1 - 1] = true;
    else if (!use.other[row1 - 1])
      use.other[row1 - 1] = i + 1;
  }
  return use;
}

uint32_t Attachment::probe_row(const std::vector<bool>& avoid) {
  const uint32_t n = hdr_->lock_hosts;
  RowUse use = row_use();
  for (uint32_t r = 0; r < n; ++r)
    if (use.mate[r] && !use.other[r] && !avoid[r]) return r;
  for (uint32_t d = 0; d < n; ++d) {
    const uint32_t r = uint32_t((host_id_ + d) % n);
    if (!use.other[r] && !avoid[r]) return r;
  }
  throw HostSlotBusyError("pool " + path_ + ": every one of its " + std::to_string(n) +
                          " host slots is used by a live node of another host; detach one, or create "
                          "the pool with more --lock-hosts");
}

void Attachment::setup_arbiter(int want, bool observer) {
  const PoolHeader& h = *hdr_;
  const int configured = configured_slot(want, h.lock_hosts);
  std::vector<bool> avoid(h.lock_hosts, false);
  // An admin command (observer) is never refused for a collision it can avoid: a configured row
  // that another host uses is only an attacher's error.
  probing_ = configured < 0 || (observer && row_use().other[uint32_t(configured)]);
  make_bakery(probing_ ? probe_row(avoid) : uint32_t(configured));
  // Before this attachment touches a tier-1 word of the row: is the row our host's?
  check_host_slot_unique();
  bakery_->adopt_participant();
}

void Attachment::make_bakery(uint32_t row) {
  const PoolHeader& h = *hdr_;
  if (bakery_) {  // moving to another row: give the old participant byte back
    if (participant1_) liveness::unlock(lock_, participant_offset(participant1_ - 1));
    participant1_ = 0;
  }
  host_slot_ = row;
  last_beat_ns_.store(liveness::mono_ns(), std::memory_order_release);
  Bakery::Config c;
  c.base = region_.base();
  c.hosts = h.lock_hosts;
  c.slot = host_slot_;
  c.max_nodes = h.max_nodes;
  c.nodes = reinterpret_cast<NodeSlot*>(region_.base() + h.node_table_off);
  c.lease_ns = uint64_t(h.lease_ms) * 1'000'000;
  c.coh = Coherence(Backend::multihost, id_.model);
  c.fenced = &fenced_;
  c.last_beat = &last_beat_ns_;
  c.pool_bytes = h.pool_bytes;
  c.pool = "pool " + path_;
  c.host_id = host_id_;
  if (id_.emulated) c.tick = [this] { heartbeat_tick(); };
  // Tier-1 identity: a byte of the lock file, locked for this attachment's life, so that a
  // host-mate can tell at once that a tier-1 holder's process is gone (the kernel released it).
  // Random start: a dead holder's byte is rarely the next one taken (adopt_participant clears
  // what it left anyway).
  if (lock_.lock_id) {
    const uint32_t start =
        uint32_t(liveness::mono_ns() ^ (uint64_t(id_.pid) * 0x9E3779B97F4A7C15ull)) % kParticipants;
    for (uint32_t i = 0; i < kParticipants; ++i) {
      const uint32_t p = (start + i) % kParticipants;
      if (liveness::lock_held_by_other(lock_, participant_offset(p))) continue;
      if (liveness::try_lock(lock_, participant_offset(p))) {
        c.lock = &lock_;
        c.participant_base = participant_offset(0);
        c.participant1 = p + 1;
        participant1_ = p + 1;
        break;
      }
    }
  }
  bakery_ = std::make_unique<Bakery>(std::move(c));
  coh_ = Coherence(Backend::multihost, id_.model, bakery_.get());
}

// Refuses this attachment (HostSlotBusyError) when a live node of ANOTHER host id uses our row, or
// a node of our host id from a build that does not share rows (format 2.2: no kNodeSharesHostSlot;
// it competes without tier 1). Returns the node it collides with for a probing attachment that
// moves on (probing_), 0 when the row is ours.
uint32_t Attachment::check_host_slot_unique() {
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    if (i + 1 == node_id_) continue;
    NodeSlot* s = node_slot(i);
    uint64_t w = coh_.read(&s->state);
    if (node_state(w) != kNodeAlive) continue;
    coh_.invalidate(s, sizeof *s);
    if (s->host_slot != host_slot_ + 1) continue;
    const uint64_t other_host = s->host_id;
    if (other_host == host_id_ && (s->flags & kNodeSharesHostSlot)) continue;  // a host-mate
    {
      std::lock_guard<std::mutex> g(reap_mu_);
      if (judge(i, w).verdict == NodeInfo::kDead) continue;
    }
    uint32_t other = i + 1;
    // A prober moves on. Of two nodes that collide, the one that checks later sees the other (each
    // checks after publishing itself ALIVE), so at least one of them moves; both may.
    if (probing_ && other_host != host_id_) return other;
    detach_node();
    throw HostSlotBusyError("pool " + path_ + ": host slot " + std::to_string(host_slot_) +
                            " is used by node " + std::to_string(other) +
                            (other_host == host_id_ ? " of an older cxlkv build that cannot share it"
                                                    : " of another host (host id differs)") +
                            "; give every host of a multihost pool its own slot (CXLKV_HOST_SLOT), or "
                            "leave it unset to let cxlkv pick a free one");
  }
  return 0;
}

// A row-less observer that must write: a row and, if one is free, a node slot (see the top).
void Attachment::become_writer() {
  std::lock_guard<std::mutex> g(writer_mu_);
  if (!row_less_) return;
  try {
    setup_arbiter(id_.emulated ? id_.emulated_slot : id_.want_slot, true);
  } catch (...) {
    // No row to be had (every one used by another host): still an observer that reads only, its
    // arbitrated writes refused as before, never made without the cross-host lock.
    if (participant1_) liveness::unlock(lock_, participant_offset(participant1_ - 1));
    participant1_ = 0;
    bakery_.reset();
    coh_ = Coherence(Backend::multihost, id_.model, row_less_arbiter_.get());
    throw;
  }
  row_less_ = false;
  attach_node(true);
  settle_host_slot(true);
}

uint32_t Attachment::heal_lock_row() {
  // As the heartbeat thread: only for an attachment that beats (a node), never once fenced.
  if (!bakery_ || !node_id_ || fenced_.load(std::memory_order_acquire)) return 0;
  return bakery_->heal_own_row();
}

Bakery& Attachment::lock_view() {
  if (bakery_) return *bakery_;
  if (!lock_reader_) {
    const PoolHeader& h = *hdr_;
    Bakery::Config c;
    c.base = region_.base();
    c.hosts = h.lock_hosts;
    c.slot = h.lock_hosts;  // no row of ours: every row is judged as another host's
    c.max_nodes = h.max_nodes;
    c.nodes = reinterpret_cast<NodeSlot*>(region_.base() + h.node_table_off);
    c.lease_ns = uint64_t(h.lease_ms) * 1'000'000;
    c.coh = Coherence(Backend::multihost, id_.model);
    c.pool_bytes = h.pool_bytes;
    c.pool = "pool " + path_;
    c.host_id = host_id_;
    lock_reader_ = std::make_unique<Bakery>(std::move(c));
  }
  return *lock_reader_;
}

// Attached (or, for an observer, done trying): settles the row. A probing attachment that finds
// another host on its row moves to the next free row and attaches again, at most once per row.
void Attachment::settle_host_slot(bool observer) {
  std::vector<bool> avoid(hdr_->lock_hosts, false);
  for (uint32_t tries = 0; tries <= hdr_->lock_hosts; ++tries) {
    if (check_host_slot_unique() == 0) return;
    avoid[host_slot_] = true;
    detach_node();
    make_bakery(probe_row(avoid));
    check_host_slot_unique();
    bakery_->adopt_participant();
    attach_node(observer);
  }
  throw HostSlotBusyError("pool " + path_ + ": no host slot stayed free while attaching; try again");
}

// Reclaim of node idx (its slot claimed RECLAIMING by us): if it is a host-mate on our row, give
// back the stripes whose tier-1 word it still holds, so that no host waits a lease for its ticket.
void Attachment::release_dead_rows(uint32_t idx, uint64_t reclaiming_word) {
  NodeSlot* s = node_slot(idx);
  coh_.invalidate(s, sizeof *s);
  if (s->host_slot != host_slot_ + 1 || s->host_id != host_id_) return;
  bakery_->release_dead(idx + 1, node_epoch(reclaiming_word));
}

}  // namespace cxlkv
