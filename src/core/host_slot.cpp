// multihost: the host slot (row of the lock area) of an attachment, its tier-1 identity, and the
// rule that one row belongs to one host. See docs/ARCHITECTURE.md §11 "Host slots" and arbiter.h.
//
// Every process of one host id takes the same row: default host_id % lock_hosts, CXLKV_HOST_SLOT
// or OpenOptions::host_slot override it. The processes of a row share it through the tier-1 word
// of each stripe (a CAS inside one coherence domain); two host ids on one row would be two
// coherence domains CASing one word and writing one line, so the second is refused.
#include <cstdlib>
#include <string>

#include "pool.h"

namespace cxlkv {

using namespace format;

void Pool::setup_arbiter(int want, bool observer) {
  (void)observer;  // observers share their host's row like every process of the host
  const PoolHeader& h = *hdr_;
  if (want < 0) {
    if (const char* e = std::getenv("CXLKV_HOST_SLOT")) {
      char* end = nullptr;
      long v = std::strtol(e, &end, 10);
      if (!*e || *end || v < 0 || v >= long(h.lock_hosts))
        throw ArgumentError("CXLKV_HOST_SLOT must be in 0.." + std::to_string(h.lock_hosts - 1));
      want = int(v);
    } else {
      want = int(host_id_ % h.lock_hosts);
    }
  }
  if (uint32_t(want) >= h.lock_hosts)
    throw ArgumentError("host slot must be in 0.." + std::to_string(h.lock_hosts - 1));
  host_slot_ = uint32_t(want);
  last_beat_ns_.store(liveness::mono_ns(), std::memory_order_release);
  Bakery::Config c;
  c.base = region_.base();
  c.hosts = h.lock_hosts;
  c.slot = host_slot_;
  c.max_nodes = h.max_nodes;
  c.nodes = reinterpret_cast<NodeSlot*>(region_.base() + h.node_table_off);
  c.lease_ns = uint64_t(h.lease_ms) * 1'000'000;
  c.coh = Coherence(Backend::multihost, emu_.model);
  c.fenced = &fenced_;
  c.last_beat = &last_beat_ns_;
  c.pool_bytes = h.pool_bytes;
  c.pool = "pool " + path_;
  if (emu_.base) c.tick = [this] { heartbeat_tick(); };
  // Tier-1 identity: a byte of the lock file, locked for this attachment's life, so that a
  // host-mate can tell at once that a tier-1 holder's process is gone (the kernel released it).
  // Random start: a dead holder's byte is rarely the next one taken (adopt_participant clears
  // what it left anyway).
  if (lock_.lock_id) {
    const uint32_t start =
        uint32_t(liveness::mono_ns() ^ (uint64_t(pid_) * 0x9E3779B97F4A7C15ull)) % kParticipants;
    for (uint32_t i = 0; i < kParticipants; ++i) {
      const uint32_t p = (start + i) % kParticipants;
      if (liveness::lock_held_by_other(lock_, participant_offset(p))) continue;
      if (liveness::try_lock(lock_, participant_offset(p))) {
        c.lock = &lock_;
        c.participant_base = participant_offset(0);
        c.participant1 = p + 1;
        break;
      }
    }
  }
  bakery_ = std::make_unique<Bakery>(std::move(c));
  coh_ = Coherence(Backend::multihost, emu_.model, bakery_.get());
  // Before this attachment touches a tier-1 word of the row: is the row our host's? (Attaching
  // nodes check again once attached, which catches some races of two attaching at once.)
  check_host_slot_unique();
  bakery_->adopt_participant();
}

// Refuses this attachment (HostSlotBusyError) when a live node of ANOTHER host id uses our row, or
// a node of our host id from a build that does not share rows (format 2.2: no kNodeSharesHostSlot;
// it competes without tier 1). Two attachers of different hosts racing for one row at the same
// moment are not caught: host slots are configuration (docs/ARCHITECTURE.md).
void Pool::check_host_slot_unique() {
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
    detach_node();
    throw HostSlotBusyError("pool " + path_ + ": host slot " + std::to_string(host_slot_) +
                            " is used by node " + std::to_string(other) +
                            (other_host == host_id_ ? " of an older cxlkv build that cannot share it"
                                                    : " of another host (host id differs)") +
                            "; give every host of a multihost pool its own slot (CXLKV_HOST_SLOT)");
  }
}

// Reclaim of node idx (its slot claimed RECLAIMING by us): if it is a host-mate on our row, give
// back the stripes whose tier-1 word it still holds, so that no host waits a lease for its ticket.
void Pool::release_dead_rows(uint32_t idx, uint64_t reclaiming_word) {
  NodeSlot* s = node_slot(idx);
  coh_.invalidate(s, sizeof *s);
  if (s->host_slot != host_slot_ + 1 || s->host_id != host_id_) return;
  bakery_->release_dead(idx + 1, node_epoch(reclaiming_word));
}

}  // namespace cxlkv
