// AdminMailbox: one attachment's use of the per-node admin mailboxes (format.h,
// kCompatAdminMailbox; rpc_admin.cpp): the responder thread that answers in its own node area,
// and `pool ping NODE`, a request into another node's. Owns the responder and the one-ping-at-a-time
// lock; the mailbox bytes are the pool's, reached through the region's bounds-checked accessors.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "region.h"
#include "rpc.h"

namespace cxlkv {

// `pool ping NODE`: the outcome and the responder's identity as it reported it.
struct PingResult {
  enum Outcome { kAnswered, kNotAttached, kTimeout, kBadReply } outcome = kTimeout;
  uint64_t rtt_ns = 0;
  uint32_t node = 0, epoch = 0;
  uint64_t pid = 0, host_id = 0;
  std::string detail;  // one line for the non-answered outcomes
};
struct AdminResponder;  // rpc_admin.cpp: shared by the mailbox and its thread

class AdminMailbox {
 public:
  explicit AdminMailbox(const Region& region) : region_(region) {}

  // Who answers, and when it must stop: this node (1-based) in the incarnation `node_word` (its
  // slot's state word; the thread stops once the slot says otherwise), the identity it reports, and
  // the attachment's health flags, which outlive the thread (it stops before they go).
  struct Identity {
    uint32_t node = 0;
    uint64_t node_word = 0;
    uint64_t pid = 0, host_id = 0;
    const std::atomic<bool>* fenced = nullptr;
    const std::function<bool()>* intact = nullptr;
  };
  bool present() const {
    const format::PoolHeader* h = region_.header();
    return h && (h->compat & format::kCompatAdminMailbox);
  }
  // Starts the responder thread (returns once it is in its loop: fork-safe from then on).
  void start(const Identity& me);
  void stop();    // and wait until the thread no longer touches the pool
  void forget();  // a forked child's copy: the thread is not in this process (never joined)
  // One round trip into node `node`'s mailbox, from our request slot `self` (our node id); waits at
  // most timeout_ms. Throws ArgumentError (no node of ours, node out of range) or VersionError (a
  // pool without mailboxes; `path` names it).
  PingResult ping(uint32_t self, uint32_t node, uint64_t timeout_ms, const std::string& path);

 private:
  rpc::Channel channel(uint32_t idx) const;

  const Region& region_;
  std::shared_ptr<AdminResponder> responder_;
  std::mutex ping_mu_;
};

}  // namespace cxlkv
