// Node table: attaching, detaching, telling dead peers apart, and reclaiming what they held.
//
// A process that dies without close() leaves: its node slot, pins in its area, index entries in
// WRITING/EVICTING owned by it, block descs it claimed, a CARVING chunk, maybe the ns_lock or a
// CREATING namespace. Whoever notices first (attach, a failed allocation, `pool check`) claims the
// dead slot (ALIVE -> RECLAIMING, one winner), undoes each of those, and frees the slot. Every
// step is idempotent, so a reclaimer that dies half-way is itself reclaimed and the work redone.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "pool.h"

namespace cxlkv {

using namespace format;

namespace {
uint64_t proc_start_time(uint32_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return 0;
  size_t p = s.rfind(')');
  if (p == std::string::npos) return 0;
  const char* c = s.c_str() + p + 2;
  for (int field = 3; field < 22 && *c; ++field) {
    c = std::strchr(c, ' ');
    if (!c) return 0;
    ++c;
  }
  return std::strtoull(c, nullptr, 10);
}
}  // namespace

void Pool::attach_node() {
  for (int round = 0; round < 2; ++round) {
    for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
      NodeSlot* s = node_slot(i);
      uint64_t w = coh_.read(&s->state);
      if (node_state(w) != kNodeFree) continue;
      uint64_t claimed = make_node_word(kNodeClaimed, pid_, node_epoch(w) + 1);
      if (!coh_.claim(&s->state, w, claimed)) continue;
      // We own the slot: its area is ours to reset.
      auto* fx = node_fixed(i);
      uint64_t hw = coh_.read(&fx->pin_hw);
      if (hw > hdr_->pin_slots) hw = hdr_->pin_slots;
      std::memset(pins(i), 0, hw * 8);
      // Counters are kept across attachments: they accumulate per slot (one writer at a time),
      // so `pool stats` still counts the work of processes that have exited.
      coh_.publish(&fx->pin_hw, 0);
      coh_.flush(node_area(i), sizeof(NodeAreaFixed) + hw * 8);
      s->pid = pid_;
      s->start_time = proc_start_time(pid_);
      s->host_id = host_id_;
      s->heartbeat_ns = now_unix_ns();
      s->attach_unix_ns = s->heartbeat_ns;
      coh_.flush(s, sizeof *s);
      node_word_ = make_node_word(kNodeAlive, pid_, node_epoch(claimed));
      coh_.publish(&s->state, node_word_);
      node_id_ = i + 1;
      return;
    }
    if (round == 0 && reap_dead_nodes() == 0) break;
  }
  throw NodeTableFullError("pool " + path_ + ": all " + std::to_string(hdr_->max_nodes) +
                           " node slots are taken by live processes");
}

void Pool::detach_node() {
  if (!node_id_) return;
  uint32_t i = node_id_ - 1;
  // Pins of a clean close are already released by their leases; clear any left behind.
  uint64_t hw = std::min<uint64_t>(pin_hw_, hdr_->pin_slots);
  for (uint64_t p = 0; p < hw; ++p) coh_.publish(&pins(i)[p], 0);
  coh_.publish(&node_fixed(i)->pin_hw, 0);
  uint64_t w = node_word_;
  coh_.claim(&node_slot(i)->state, w, make_node_word(kNodeFree, 0, node_epoch(node_word_)));
  node_id_ = 0;
}

bool Pool::node_is_dead(uint32_t idx, uint64_t w) {
  uint8_t st = node_state(w);
  if (st == kNodeFree) return false;
  uint32_t pid = node_pid(w);
  NodeSlot* s = node_slot(idx);
  coh_.invalidate(s, sizeof *s);
  if (st == kNodeAlive && s->host_id != host_id_) return false;  // another host: not judged here
  if (pid == 0) return true;
  if (::kill(pid_t(pid), 0) != 0 && errno == ESRCH) return true;
  if (st == kNodeAlive && s->start_time != 0) {
    uint64_t t = proc_start_time(pid);
    if (t != 0 && t != s->start_time) return true;  // pid reused by another process
  }
  return false;
}

bool Pool::incarnation_alive(uint8_t node, uint8_t epoch8) {
  if (node == 0 || node > hdr_->max_nodes) return false;
  uint64_t w = coh_.read(&node_slot(node - 1)->state);
  uint8_t st = node_state(w);
  return (st == kNodeAlive || st == kNodeClaimed) && uint8_t(node_epoch(w)) == epoch8;
}

uint64_t Pool::reap_dead_nodes() {
  uint64_t reaped = 0;
  last_reap_ns_.store(now_unix_ns(), std::memory_order_relaxed);
  for (uint32_t i = 0; i < hdr_->max_nodes; ++i) {
    if (node_id_ == i + 1) continue;
    uint64_t w = coh_.read(&node_slot(i)->state);
    if (!node_is_dead(i, w)) continue;
    uint64_t mine = make_node_word(kNodeReclaiming, pid_, node_epoch(w));
    if (!coh_.claim(&node_slot(i)->state, w, mine)) continue;
    reclaim_node(i, mine);
    ++reaped;
  }
  if (reaped) count(kReclaimedNodes, reaped);
  return reaped;
}

void Pool::reclaim_node(uint32_t idx, uint64_t reclaiming_word) {
  const uint8_t dead = uint8_t(idx + 1);
  // 1. Pins: the dead node reads nothing any more.
  auto* fx = node_fixed(idx);
  uint64_t hw = std::min<uint64_t>(coh_.read(&fx->pin_hw), hdr_->pin_slots);
  for (uint64_t p = 0; p < hw; ++p) coh_.publish(&pins(idx)[p], 0);
  coh_.publish(&fx->pin_hw, 0);
  // 2. Index entries it was writing or evicting: free their block, then tombstone the slot.
  for (uint64_t slot = 0; slot <= slot_mask_; ++slot) {
    IndexEntry* e = entry(slot);
    uint64_t w = coh_.read(&e->state);
    uint8_t st = entry_state(w);
    if ((st != kWriting && st != kEvicting) || entry_node(w) != dead) continue;
    coh_.invalidate(e, sizeof *e);
    uint64_t chunk = e->chunk;
    uint32_t block = e->block;
    if (chunk < hdr_->chunk_count && block < desc_bytes_ / 8) {
      uint64_t* d = block_desc(chunk, block);
      uint64_t dw = coh_.read(d);
      if (block_state(dw) == kBlockUsed && block_slot(dw) == slot) coh_.claim(d, dw, 0);
    }
    coh_.claim(&e->state, w, make_entry_word(kTombstone, 0, entry_gen(w), entry_tag(w)));
  }
  // 3. Chunks it was carving or draining; block descs it claimed that no entry points back to.
  for (uint64_t c = 0; c < hdr_->chunk_count; ++c) {
    uint64_t* cw = chunk_word(c);
    uint64_t w = coh_.read(cw);
    if (chunk_state(w) == kChunkCarving && chunk_node(w) == dead) {
      coh_.claim(cw, w, 0);
      continue;
    }
    if (chunk_state(w) == kChunkDraining && chunk_node(w) == dead) {
      // Undo a half-done drain: unfence, and the chunk goes back to its namespace.
      for (uint32_t b = 0; b < desc_bytes_ / 8; ++b) {
        uint64_t* d = block_desc(c, b);
        uint64_t dw = coh_.read(d);
        if (block_state(dw) == kBlockFenced && block_node(dw) == dead) coh_.claim(d, dw, 0);
      }
      uint64_t back = make_chunk_word(kChunkActive, 0, chunk_ns(w));
      if (!coh_.claim(cw, w, back)) continue;
      w = back;
    }
    if (chunk_state(w) != kChunkActive) continue;
    uint32_t nblocks = uint32_t(desc_bytes_ / 8);
    for (uint32_t b = 0; b < nblocks; ++b) {
      uint64_t* d = block_desc(c, b);
      uint64_t dw = coh_.read(d);
      if (block_state(dw) != kBlockUsed || block_node(dw) != dead) continue;
      uint64_t slot = block_slot(dw);
      if (slot <= slot_mask_) {
        IndexEntry* e = entry(slot);
        uint64_t ew = coh_.read(&e->state);
        uint8_t st = entry_state(ew);
        coh_.invalidate(e, sizeof *e);
        if ((st == kReady || st == kWriting || st == kEvicting || st == kCondemned) && e->chunk == c && e->block == b) continue;
      }
      coh_.claim(d, dw, 0);
    }
  }
  // 4. Namespace-table lock and half-created namespaces.
  uint64_t lw = coh_.read(&shared()->ns_lock.word);
  if (lw == dead) coh_.claim(&shared()->ns_lock.word, lw, 0);
  for (uint32_t id = 1; id <= hdr_->max_namespaces; ++id) {
    NamespaceEntry* ne = ns_entry(id);
    uint64_t w = coh_.read(&ne->state);
    if (ns_state(w) == kNsCreating && ns_node(w) == dead) coh_.claim(&ne->state, w, 0);
  }
  // 5. The slot itself.
  uint64_t w = reclaiming_word;
  coh_.claim(&node_slot(idx)->state, w, make_node_word(kNodeFree, 0, node_epoch(reclaiming_word)));
}

}  // namespace cxlkv
