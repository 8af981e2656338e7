// Shared-memory RPC (rpc.h): the ring single-threaded (ordering, slot reuse, seq wraparound), a
// scribbled region rejected, round trips between two processes with every payload checked (both
// backends), the benchmark's transports, and the admin mailbox's ping.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "rpc.h"
#include "rpc_bench.h"
#include "test_util.h"

namespace cxlkv::test {
namespace {

// A MAP_SHARED anonymous region: survives fork, so parent and child share the channel.
struct Region {
  explicit Region(size_t n) : bytes(n) {
    base = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) std::abort();
  }
  ~Region() { ::munmap(base, bytes); }
  void* base;
  size_t bytes;
};

const Backend kBackends[] = {Backend::coherent, Backend::flush};

void fill(uint8_t* p, uint64_t seq, uint32_t n) {
  for (uint32_t k = 0; k < n; ++k) p[k] = uint8_t(seq * 37 + k);
}

TEST(Rpc, SingleThreadedOrderingAndEcho) {
  for (Backend b : kBackends) {
    Region r(4096);
    rpc::Channel client = rpc::Channel::format(r.base, r.bytes, 4, b);
    rpc::Channel server = rpc::Channel::attach(r.base, r.bytes);
    ASSERT_EQ(server.slots(), 4u);
    std::vector<uint64_t> answered(4, 0);
    uint8_t in[rpc::kInlineBytes], out[rpc::kInlineBytes];
    uint64_t seq;
    uint32_t op, len;
    // Nothing posted: nothing pending.
    server.refresh_requests(0, 4);
    for (uint32_t s = 0; s < 4; ++s)
      EXPECT_EQ(server.poll_request(s, answered[s], &seq, &op, out, &len), rpc::Poll::kEmpty);
    // A batch of 3 (one fence), payload lengths 0, 10, 48.
    const uint32_t lens[3] = {0, 10, 48};
    for (uint32_t s = 0; s < 3; ++s) {
      fill(in, 100 + s, lens[s]);
      client.post(s, 100 + s, 7 + s, in, lens[s]);
      EXPECT_FALSE(client.idle(s));
    }
    client.end_batch();
    EXPECT_TRUE(client.idle(3));
    server.refresh_requests(0, 4);
    for (uint32_t s = 0; s < 3; ++s) {
      ASSERT_EQ(server.poll_request(s, answered[s], &seq, &op, out, &len), rpc::Poll::kReady);
      EXPECT_EQ(seq, 100 + s);
      EXPECT_EQ(op, 7 + s);
      ASSERT_EQ(len, lens[s]);
      fill(in, 100 + s, lens[s]);
      EXPECT_EQ(std::memcmp(in, out, len), 0);
      // The answer is not visible before respond(); then it is, under exactly this seq.
      client.refresh_responses(s, 1);
      uint32_t st;
      EXPECT_EQ(client.poll_response(s, seq, &st, out, &len), rpc::Poll::kEmpty);
      server.respond(s, seq, 0, in, lens[s]);
      answered[s] = seq;
    }
    EXPECT_EQ(server.poll_request(3, answered[3], &seq, &op, out, &len), rpc::Poll::kEmpty);
    server.end_batch();
    client.refresh_responses(0, 3);
    for (uint32_t s = 0; s < 3; ++s) {
      uint32_t st;
      EXPECT_EQ(client.poll_response(s, 99, &st, out, &len), rpc::Poll::kEmpty)
          << "an older seq must not match";
      ASSERT_EQ(client.poll_response(s, 100 + s, &st, out, &len), rpc::Poll::kReady);
      EXPECT_EQ(st, 0u);
      EXPECT_EQ(len, lens[s]);
      EXPECT_TRUE(client.idle(s));
    }
    // Answered requests are not served again.
    server.refresh_requests(0, 4);
    for (uint32_t s = 0; s < 4; ++s)
      EXPECT_EQ(server.poll_request(s, answered[s], &seq, &op, out, &len), rpc::Poll::kEmpty);
  }
}

TEST(Rpc, SlotReuseAndSeqWraparound) {
  for (Backend b : kBackends) {
    Region r(4096);
    rpc::Channel c = rpc::Channel::format(r.base, r.bytes, 2, b);
    std::vector<uint64_t> answered(2, 0), seqs(2, 0);
    uint8_t in[rpc::kInlineBytes], out[rpc::kInlineBytes];
    uint64_t seq;
    uint32_t op, len, st;
    auto round = [&](uint32_t s, uint64_t want) {
      fill(in, want, 16);
      c.post(s, want, 1, in, 16);
      c.end_batch();
      c.refresh_requests(0, 2);
      ASSERT_EQ(c.poll_request(s, answered[s], &seq, &op, out, &len), rpc::Poll::kReady);
      ASSERT_EQ(seq, want);
      ASSERT_EQ(std::memcmp(in, out, 16), 0);
      c.respond(s, seq, 0, out, len);
      c.end_batch();
      answered[s] = seq;
      c.refresh_responses(0, 2);
      ASSERT_EQ(c.poll_response(s, want, &st, out, &len), rpc::Poll::kReady);
    };
    for (uint64_t i = 1; i <= 5000; ++i) round(uint32_t(i % 2), ++seqs[i % 2]);
    // A restarted client resumes above anything it finds; at the top of the range it wraps to 1,
    // never to 0 (0 = never used), and the server still sees that as new.
    EXPECT_EQ(c.resume_seq(0), seqs[0] + 1);
    round(1, ~0ull);
    EXPECT_EQ(c.resume_seq(1), 1u);
    round(1, c.resume_seq(1));
    EXPECT_EQ(answered[1], 1u);
    EXPECT_THROW(c.post(0, 0, 1, in, 0), ArgumentError);
  }
}

TEST(Rpc, ScribbledRegionIsRejected) {
  Region r(4096);
  auto* h = static_cast<rpc::ChannelHeader*>(r.base);
  rpc::Channel c = rpc::Channel::format(r.base, r.bytes, 4, Backend::coherent);
  // Header: every field that steers an address or a loop is checked at attach.
  EXPECT_THROW(rpc::Channel::attach(r.base, 32), CorruptError);
  auto with = [&](auto mutate) {
    rpc::ChannelHeader saved = *h;
    mutate();
    EXPECT_THROW(rpc::Channel::attach(r.base, r.bytes), CorruptError);
    *h = saved;
  };
  with([&] { h->magic ^= 1; });
  with([&] { h->version = 99; });
  with([&] { h->slots = 0; });
  with([&] { h->slots = rpc::kMaxSlots + 1; });
  with([&] { h->slots = 64; });  // 64 slots do not fit 4096 bytes
  with([&] { h->backend = 77; });
  EXPECT_NO_THROW(rpc::Channel::attach(r.base, r.bytes));
  // Lines: a length beyond the line is reported, never copied; slot indexes are bounded.
  uint8_t out[rpc::kInlineBytes];
  uint64_t seq;
  uint32_t op, len;
  c.req(1)->seq = 5;
  c.req(1)->len = rpc::kInlineBytes + 1;
  c.refresh_requests(0, 4);
  EXPECT_EQ(c.poll_request(1, 0, &seq, &op, out, &len), rpc::Poll::kBadLine);
  EXPECT_EQ(seq, 5u) << "a bad request still names its seq, so the server can answer it once";
  c.resp(2)->len = 0xFFFFFFFFu;
  c.resp(2)->seq = 9;
  EXPECT_EQ(c.poll_response(2, 9, &op, out, &len), rpc::Poll::kBadLine);
  EXPECT_THROW(c.req(4), CorruptError);
  EXPECT_THROW(c.resp(~0u), CorruptError);
  EXPECT_THROW(c.refresh_requests(3, 2), ArgumentError);
  EXPECT_THROW(c.refresh_responses(0, 0), ArgumentError);
  EXPECT_THROW(c.post(0, 1, 1, out, rpc::kInlineBytes + 1), ArgumentError);
  EXPECT_THROW(rpc::Channel::format(r.base, r.bytes, 64, Backend::coherent), ArgumentError);
}

// The child echoes every request with each payload byte complemented, until op 2.
void serve_complement(void* base, size_t bytes) {
  rpc::Channel ch = rpc::Channel::attach(base, bytes);
  std::vector<uint64_t> answered(ch.slots(), 0);
  uint8_t buf[rpc::kInlineBytes];
  rpc::Backoff backoff;
  for (;;) {
    ch.refresh_requests(0, ch.slots());
    bool served = false, stop = false;
    for (uint32_t s = 0; s < ch.slots(); ++s) {
      uint64_t seq;
      uint32_t op, len;
      rpc::Poll p = ch.poll_request(s, answered[s], &seq, &op, buf, &len);
      if (p == rpc::Poll::kEmpty) continue;
      if (p == rpc::Poll::kBadLine) ::_exit(3);
      for (uint32_t k = 0; k < len; ++k) buf[k] = uint8_t(~buf[k]);
      ch.respond(s, seq, op, buf, len);
      answered[s] = seq;
      served = true;
      stop |= op == 2;
    }
    if (served) {
      ch.end_batch();
      backoff.reset();
    } else {
      backoff.wait();
    }
    if (stop) ::_exit(0);
  }
}

TEST(Rpc, TwoProcessRoundTripsVerifyEveryPayload) {
  for (Backend b : kBackends) {
    constexpr uint32_t kSlots = 32;
    Region r(4096 * 4);
    rpc::Channel c = rpc::Channel::format(r.base, r.bytes, kSlots, b);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) serve_complement(r.base, r.bytes);
    std::vector<uint64_t> seqs(kSlots, 0);
    uint8_t in[rpc::kInlineBytes], out[rpc::kInlineBytes];
    uint64_t checked = 0;
    auto batch = [&](uint32_t n, uint32_t op) {
      for (uint32_t s = 0; s < n; ++s) {
        fill(in, ++seqs[s] * 1000 + s, rpc::kInlineBytes);
        c.post(s, seqs[s], op, in, (seqs[s] + s) % (rpc::kInlineBytes + 1));
      }
      c.end_batch();
      std::vector<bool> done(n, false);
      uint32_t left = n;
      rpc::Backoff backoff;
      while (left) {
        c.refresh_responses(0, n);
        for (uint32_t s = 0; s < n; ++s) {
          uint32_t st, len;
          if (done[s] || c.poll_response(s, seqs[s], &st, out, &len) != rpc::Poll::kReady) continue;
          ASSERT_EQ(st, op);
          ASSERT_EQ(len, (seqs[s] + s) % (rpc::kInlineBytes + 1));
          fill(in, seqs[s] * 1000 + s, rpc::kInlineBytes);
          for (uint32_t k = 0; k < len; ++k)
            ASSERT_EQ(out[k], uint8_t(~in[k])) << "slot " << s << " seq " << seqs[s];
          done[s] = true, --left, ++checked;
        }
        backoff.wait();
      }
    };
    for (int i = 0; i < 2000; ++i) batch(1, 1);      // depth 1
    for (int i = 0; i < 300; ++i) batch(kSlots, 1);  // depth 32, one fence per batch
    batch(1, 2);                                     // stop
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "server status " << status;
    EXPECT_EQ(checked, 2000u + 300u * kSlots + 1);
  }
}

TEST(Rpc, BenchmarkTransportsRunTiny) {
  rpcbench::Options o;
  o.iterations = 200, o.warmup = 20, o.depth = 8, o.batches = 50;
  for (const char* t : {"rpc", "line", "tcp", "uds", "tcp_spin", "uds_spin"}) {
    rpcbench::Result r = rpcbench::run(t, o);
    EXPECT_GT(r.p50_ns, 0) << t;
    EXPECT_GE(r.p99_ns, r.p50_ns) << t;
    EXPECT_GT(r.msgs_per_s_deep, 0) << t;
  }
  o.backend = Backend::flush;
  EXPECT_GT(rpcbench::run("rpc", o).p50_ns, 0);
  EXPECT_THROW(rpcbench::run("carrier-pigeon", o), ArgumentError);
}

class AdminPing : public PoolTest {};

TEST_F(AdminPing, AnswersAttachedNodesOnly) {
  for (Backend b : kBackends) {
    auto o = opts(8 * MiB);
    o.backend = b;
    auto a = Pool::create(path_, o, false);
    auto bp = Pool::open(path_);
    ASSERT_TRUE(a->has_admin_mailbox());
    for (int i = 0; i < 3; ++i) {
      PingResult r = a->ping(bp->node_id(), 2000);
      ASSERT_EQ(r.outcome, PingResult::kAnswered) << r.detail;
      EXPECT_EQ(r.node, bp->node_id());
      EXPECT_EQ(r.pid, uint64_t(::getpid()));
      EXPECT_GT(r.rtt_ns, 0u);
    }
    EXPECT_EQ(bp->ping(a->node_id(), 2000).outcome, PingResult::kAnswered);
    EXPECT_EQ(a->ping(a->node_id(), 2000).outcome, PingResult::kAnswered) << "a node answers itself";
    uint32_t gone = bp->node_id();
    bp.reset();  // detached: its responder stopped, its slot FREE
    PingResult r = a->ping(gone, 200);
    EXPECT_EQ(r.outcome, PingResult::kNotAttached) << r.detail;
    EXPECT_EQ(a->ping(o.max_nodes, 200).outcome, PingResult::kNotAttached);
    EXPECT_THROW(a->ping(0, 10), ArgumentError);
    EXPECT_THROW(a->ping(o.max_nodes + 1, 10), ArgumentError);
    EXPECT_TRUE(a->check().ok);
    a.reset();
    ::unlink(path_.c_str());
  }
}

TEST_F(AdminPing, StoppedProcessTimesOut) {
  auto a = create(opts(8 * MiB));
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto c = Pool::open(path_);
    uint32_t id = c->node_id();
    if (::write(ready[1], &id, sizeof id) != sizeof id) ::_exit(2);
    for (;;) ::pause();
  }
  uint32_t id = 0;
  ASSERT_EQ(::read(ready[0], &id, sizeof id), ssize_t(sizeof id));
  PingResult r = a->ping(id, 5000);
  EXPECT_EQ(r.outcome, PingResult::kAnswered) << r.detail;
  EXPECT_EQ(r.pid, uint64_t(pid));
  ::kill(pid, SIGSTOP);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, WUNTRACED), pid);  // stopped for sure, not just signalled
  ASSERT_TRUE(WIFSTOPPED(status));
  r = a->ping(id, 200);
  EXPECT_EQ(r.outcome, PingResult::kTimeout) << r.detail;
  ::kill(pid, SIGCONT);
  r = a->ping(id, 5000);
  EXPECT_EQ(r.outcome, PingResult::kAnswered) << "a resumed node answers again: " << r.detail;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  ::close(ready[0]), ::close(ready[1]);
}

}  // namespace
}  // namespace cxlkv::test
