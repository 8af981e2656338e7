// The admin channel: every attached node answers requests in its node area's mailbox (format.h,
// kCompatAdminMailbox) from a small responder thread; `pool ping NODE` is its first user.
//
// The responder sleeps between sweeps while idle (kIdleSleep: an admin channel must cost nothing
// when nobody talks) and busy-polls with a bounded spin for kHotWindow after each answer, so the
// first ping pays up to one idle sleep and the next ones the channel's true round trip.
#include <pthread.h>
#include <sched.h>
#include <sys/random.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <thread>

#include "errors.h"
#include "rpc_admin.h"

namespace cxlkv {

using namespace format;

namespace {
constexpr uint32_t kOpPing = 1;
constexpr uint32_t kStatusOk = 0, kStatusUnknownOp = 1, kStatusBadRequest = 2;
constexpr auto kIdleSleep = std::chrono::milliseconds(5);  // 200 wake-ups/s per attached process
constexpr uint64_t kHotWindowNs = 50'000'000;
constexpr uint32_t kSweepsPerHealthCheck = 256;

struct PingRequest {
  uint64_t nonce;
  uint32_t client_node;
  uint32_t pad;
};
struct PingReply {
  uint64_t nonce;
  uint32_t node, epoch;
  uint64_t pid, host_id;
};
static_assert(sizeof(PingReply) <= rpc::kInlineBytes);
static_assert(admin_mailbox_bytes(kMaxNodes) == rpc::body_bytes(kMaxNodes),
              "format.h's mailbox size is rpc's");

uint64_t mono_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}
}  // namespace

// Shared by the mailbox and its responder thread; the thread never touches the pool after `exited`.
struct AdminResponder {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;  // the thread is in its loop: from here on it allocates nothing
  bool stop = false;
  bool exited = false;
};

rpc::Channel AdminMailbox::channel(uint32_t idx) const {
  // node_area bounds-checks idx; Pool::validate_and_attach checked the mailbox fits node_area_bytes.
  const PoolHeader* h = region_.header();
  return rpc::Channel(region_.node_area(idx) + admin_mailbox_off(h->pin_slots), h->max_nodes, region_.coh());
}

void AdminMailbox::start(const Identity& id) {
  auto st = std::make_shared<AdminResponder>();
  responder_ = st;
  rpc::Channel ch = channel(id.node - 1);
  const uint64_t* state_word = &region_.node_slot(id.node - 1)->state;
  PingReply me{0, id.node, node_epoch(id.node_word), id.pid, id.host_id};
  const uint64_t expected_word = id.node_word;
  const std::atomic<bool>* fenced = id.fenced;
  const std::function<bool()>* intact = id.intact;
  Coherence coh = region_.coh();
  // Detached: a forked child that inherits this Pool has no such thread and must not join one.
  // Everything the thread needs is allocated here, and attach returns only once the thread is in
  // its loop: a fork() right after open (a worker pool, a test) must never copy a heap lock held
  // by a thread that is still starting (ASan's allocator is not fork-safe; a child hung on it).
  const uint32_t n = ch.slots();
  std::vector<uint64_t> answered(n);
  for (uint32_t c = 0; c < n; ++c) answered[c] = ch.answered_seq(c);
  std::thread([st, ch, state_word, me, expected_word, fenced, intact, coh, n,
               answered = std::move(answered)]() mutable {
    ::pthread_setname_np(::pthread_self(), "cxlkv-admin");
    {
      std::lock_guard<std::mutex> g(st->mu);
      st->started = true;
    }
    st->cv.notify_all();
    rpc::Backoff backoff;
    uint64_t hot_until = 0;
    uint8_t buf[rpc::kInlineBytes];
    for (uint32_t sweep = 0;; ++sweep) {
      {
        std::unique_lock<std::mutex> g(st->mu);
        if (st->stop) break;
        if (mono_ns() >= hot_until) {
          st->cv.wait_for(g, kIdleSleep);
          if (st->stop) break;
        }
      }
      // Stop answering once this node is fenced (L3) or the pool file shrank under us.
      if (sweep % kSweepsPerHealthCheck == 0 || mono_ns() >= hot_until) {
        if (fenced->load(std::memory_order_acquire) || !(*intact)() || coh.read(state_word) != expected_word)
          break;
      }
      ch.refresh_requests(0, n);
      uint32_t served = 0;
      for (uint32_t c = 0; c < n; ++c) {
        uint64_t seq;
        uint32_t op, len;
        rpc::Poll p = ch.poll_request(c, answered[c], &seq, &op, buf, &len);
        if (p == rpc::Poll::kEmpty) continue;
        uint32_t status = kStatusOk;
        PingReply r = me;
        if (p == rpc::Poll::kBadLine) {
          status = kStatusBadRequest;
        } else if (op != kOpPing) {
          status = kStatusUnknownOp;
        } else if (len != sizeof(PingRequest)) {
          status = kStatusBadRequest;
        } else {
          PingRequest q;
          std::memcpy(&q, buf, sizeof q);
          r.nonce = q.nonce;
        }
        ch.respond(c, seq, status, &r, status == kStatusOk ? sizeof r : 0);
        answered[c] = seq;
        ++served;
      }
      if (served) {
        ch.end_batch();  // one fence for every answer of this sweep
        hot_until = mono_ns() + kHotWindowNs;
        backoff.reset();
      } else if (mono_ns() < hot_until) {
        backoff.wait();
      }
    }
    std::lock_guard<std::mutex> g(st->mu);
    st->exited = true;
    st->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> g(st->mu);
  st->cv.wait(g, [&] { return st->started; });
}

void AdminMailbox::forget() { responder_.reset(); }

void AdminMailbox::stop() {
  auto st = std::move(responder_);
  if (!st) return;
  std::unique_lock<std::mutex> g(st->mu);
  st->stop = true;
  st->cv.notify_all();
  st->cv.wait(g, [&] { return st->exited; });
}

PingResult AdminMailbox::ping(uint32_t self, uint32_t node, uint64_t timeout_ms, const std::string& path) {
  const PoolHeader* h = region_.header();
  if (!self) throw ArgumentError("ping needs an attached pool: our node id names our request slot");
  if (node == 0 || node > h->max_nodes)
    throw ArgumentError("node " + std::to_string(node) + " out of range 1.." + std::to_string(h->max_nodes));
  if (!present())
    throw VersionError("pool " + path +
                       " has no admin mailbox (created by an older cxlkv); re-create it to use ping");
  std::lock_guard<std::mutex> g(ping_mu_);  // one request at a time in our slot
  PingResult res;
  res.node = node;
  uint64_t word = region_.coh().read(&region_.node_slot(node - 1)->state);
  if (node_state(word) != kNodeAlive) {
    res.outcome = PingResult::kNotAttached;
    res.detail = "node " + std::to_string(node) + " is not attached (slot " +
                 (node_state(word) == kNodeFree ? "free" : "not alive") + ")";
    return res;
  }
  rpc::Channel ch = channel(node - 1);
  const uint32_t slot = self - 1;
  PingRequest q{};
  if (::getrandom(&q.nonce, sizeof q.nonce, 0) != sizeof q.nonce) q.nonce = mono_ns();
  q.client_node = self;
  const uint64_t seq = ch.resume_seq(slot);
  const uint64_t t0 = mono_ns(), deadline = t0 + timeout_ms * 1'000'000;
  ch.post(slot, seq, kOpPing, &q, sizeof q);
  ch.end_batch();
  rpc::Backoff backoff;
  uint8_t buf[rpc::kInlineBytes];
  for (;;) {
    ch.refresh_responses(slot, 1);
    uint32_t status, len;
    rpc::Poll p = ch.poll_response(slot, seq, &status, buf, &len);
    if (p != rpc::Poll::kEmpty) {
      res.rtt_ns = mono_ns() - t0;
      PingReply r{};
      if (p == rpc::Poll::kReady && status == kStatusOk && len == sizeof r) std::memcpy(&r, buf, sizeof r);
      if (p != rpc::Poll::kReady || status != kStatusOk || len != sizeof r || r.nonce != q.nonce ||
          r.node != node) {
        res.outcome = PingResult::kBadReply;
        res.detail = "node " + std::to_string(node) + " answered with a malformed reply (status " +
                     std::to_string(p == rpc::Poll::kReady ? status : 0xFFFFFFFFu) + ", " +
                     std::to_string(len) + " bytes)";
        return res;
      }
      res.outcome = PingResult::kAnswered;
      res.epoch = r.epoch;
      res.pid = r.pid;
      res.host_id = r.host_id;
      return res;
    }
    if (mono_ns() >= deadline) break;
    backoff.wait();
  }
  res.outcome = PingResult::kTimeout;
  res.detail = "node " + std::to_string(node) + " did not answer within " + std::to_string(timeout_ms) +
               " ms (attached but not responding: stopped, hung, or on a host that cannot see our writes)";
  return res;
}

}  // namespace cxlkv
