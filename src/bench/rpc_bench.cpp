// `cxlkv bench rpc`: see rpc_bench.h for what is measured and why it is comparable.
#include "rpc_bench.h"
#include "percentile.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "errors.h"
#include "rpc.h"

namespace cxlkv::rpcbench {

namespace {

constexpr uint32_t kOpEcho = 1, kOpStop = 2;
constexpr uint32_t kPayload = rpc::kInlineBytes;
constexpr uint32_t kPrefetchAhead = 8;  // request lines fetched ahead of the server's sweep

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

// The payload of message `seq`: every byte depends on seq, so a stale or misrouted echo fails.
void fill(uint8_t* p, uint64_t seq) {
  for (uint32_t k = 0; k < kPayload; ++k) p[k] = uint8_t(seq * 131 + k * 7 + 0x5A);
}
bool matches(const uint8_t* p, uint64_t seq) {
  uint8_t want[kPayload];
  fill(want, seq);
  return std::memcmp(p, want, kPayload) == 0;
}

[[noreturn]] void fail(const std::string& what) { throw Error("bench rpc: " + what); }

void pin_self(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  (void)::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
}

// The calling thread pinned to one CPU for the life of this object, then its old mask restored.
class PinGuard {
 public:
  explicit PinGuard(int cpu) {
    if (cpu < 0) return;
    saved_ok_ = ::pthread_getaffinity_np(::pthread_self(), sizeof saved_, &saved_) == 0;
    pin_self(cpu);
  }
  ~PinGuard() {
    if (saved_ok_) (void)::pthread_setaffinity_np(::pthread_self(), sizeof saved_, &saved_);
  }

 private:
  cpu_set_t saved_{};
  bool saved_ok_ = false;
};

// The forked server: killed and reaped if the client leaves early (timeout, failed check).
class Child {
 public:
  explicit Child(pid_t pid) : pid_(pid) {}
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // Waits for a clean exit (the server saw the stop message); false if it failed or hung.
  bool join(double timeout_s) {
    uint64_t deadline = now_ns() + uint64_t(timeout_s * 1e9);
    for (;;) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) && WEXITSTATUS(status) == 0;
      }
      if (now_ns() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  pid_t pid_;
};

// One transport's two halves. prepare() runs before fork; serve() in the child only.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual void prepare(uint32_t depth) = 0;
  virtual void in_child() {}
  virtual void in_parent() {}
  virtual void serve() = 0;
  // Posts n messages at once and waits for all n echoes, checking each. `deadline` in now_ns().
  virtual void round_trip(uint32_t n, uint64_t deadline) = 0;
  virtual void stop(uint64_t deadline) = 0;
};

// ---- shared-memory channel ---------------------------------------------------------------------
class RpcTransport : public Transport {
 public:
  RpcTransport(Backend b, std::string dir) : backend_(b), dir_(std::move(dir)) {}
  ~RpcTransport() override {
    if (region_) ::munmap(region_, bytes_);
  }
  void prepare(uint32_t depth) override {
    // A file of its own (any mappable file works), unlinked at once: both processes keep the
    // mapping (MAP_SHARED survives fork), nothing is left behind on a crash.
    std::string tmpl = dir_ + "/cxlkv-rpc-bench-XXXXXX";
    int fd = ::mkstemp(tmpl.data());
    if (fd < 0)
      throw OsError(errno,
                    "bench rpc: cannot create a channel file in " + dir_ + ": " + std::strerror(errno));
    ::unlink(tmpl.c_str());
    bytes_ = (sizeof(rpc::ChannelHeader) + rpc::body_bytes(depth) + 4095) / 4096 * 4096;
    if (::ftruncate(fd, off_t(bytes_)) != 0) {
      int e = errno;
      ::close(fd);
      throw OsError(e, "bench rpc: cannot size the channel file");
    }
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw OsError(errno, "bench rpc: cannot map the channel file");
    region_ = p;
    ch_ = rpc::Channel::format(region_, bytes_, depth, backend_);
    seqs_.assign(depth, 0);
  }
  void serve() override {
    rpc::Channel ch = rpc::Channel::attach(region_, bytes_);  // validated like any attacher
    const uint32_t n = ch.slots();
    std::vector<uint64_t> answered(n);
    for (uint32_t c = 0; c < n; ++c) answered[c] = ch.answered_seq(c);
    rpc::Backoff backoff;
    uint8_t buf[rpc::kInlineBytes];
    for (;;) {
      ch.refresh_requests(0, n);
      uint32_t served = 0;
      bool stop = false;
      for (uint32_t c = 0; c < n; ++c) {
        uint64_t seq;
        uint32_t op, len;
        if (c + kPrefetchAhead < n) __builtin_prefetch(ch.req(c + kPrefetchAhead));
        rpc::Poll p = ch.poll_request(c, answered[c], &seq, &op, buf, &len);
        if (p == rpc::Poll::kEmpty) continue;
        if (p == rpc::Poll::kBadLine)
          ch.respond(c, seq, 1, nullptr, 0);
        else
          ch.respond(c, seq, 0, buf, len);  // the echo
        answered[c] = seq;
        ++served;
        stop |= p == rpc::Poll::kReady && op == kOpStop;
      }
      if (served) {
        ch.end_batch();  // one fence for the whole sweep
        backoff.reset();
      } else {
        backoff.wait();
      }
      if (stop) return;
    }
  }
  void round_trip(uint32_t n, uint64_t deadline) override {
    uint8_t buf[rpc::kInlineBytes];
    for (uint32_t s = 0; s < n; ++s) {
      fill(buf, ++seqs_[s]);
      ch_.post(s, seqs_[s], kOpEcho, buf, kPayload);
    }
    ch_.end_batch();  // one fence for the batch
    wait(n, deadline);
  }
  void stop(uint64_t deadline) override {
    ch_.post(0, ++seqs_[0], kOpStop, nullptr, 0);
    ch_.end_batch();
    wait(1, deadline, /*stopping=*/true);
  }

 private:
  // The server answers in slot order, so the last slot's answer comes last: the client polls
  // that one line until it is there, then collects the others (all ready by then; their loads
  // overlap). Polling lines the server is still writing would pull them away from it (cache-line
  // ping-pong). Each slot is still checked on its own seq, so an out-of-order server stays correct.
  void wait(uint32_t n, uint64_t deadline, bool stopping = false) {
    uint8_t buf[rpc::kInlineBytes];
    for (uint32_t k = 0; k < n; ++k) {
      const uint32_t s = k == 0 ? n - 1 : k - 1;
      rpc::Backoff backoff;
      for (uint64_t spin = 0;; ++spin) {
        ch_.refresh_responses(s, 1);
        uint32_t status, len;
        rpc::Poll p = ch_.poll_response(s, seqs_[s], &status, buf, &len);
        if (p != rpc::Poll::kEmpty) {
          if (p != rpc::Poll::kReady || status != 0 ||
              (!stopping && (len != kPayload || !matches(buf, seqs_[s]))))
            fail("rpc slot " + std::to_string(s) + ": wrong echo for seq " + std::to_string(seqs_[s]));
          break;
        }
        backoff.wait();
        if ((spin & 1023) == 1023 && now_ns() > deadline) fail("rpc: the server did not answer in time");
      }
    }
  }
  Backend backend_;
  std::string dir_;
  void* region_ = nullptr;
  size_t bytes_ = 0;
  rpc::Channel ch_;
  std::vector<uint64_t> seqs_;
};

// ---- the floor: one word bounced between two cache lines, no protocol --------------------------
// What any shared-memory round trip on this machine costs at least (two cache-line transfers
// between the CPUs): the rpc channel's overhead is its p50 minus this one. "Deep" rounds are n
// sequential bounces (nothing to pipeline without slots).
class LineTransport : public Transport {
 public:
  ~LineTransport() override {
    if (region_) ::munmap(region_, 4096);
  }
  void prepare(uint32_t) override {
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw OsError(errno, "bench rpc: mmap");
    region_ = static_cast<uint64_t*>(p);
  }
  void serve() override {
    uint64_t seen = 0;
    rpc::Backoff backoff;
    for (;;) {
      uint64_t v = std::atomic_ref<uint64_t>(region_[0]).load(std::memory_order_acquire);
      if (v == seen) {
        backoff.wait();
        continue;
      }
      backoff.reset();
      seen = v;
      std::atomic_ref<uint64_t>(region_[8]).store(v, std::memory_order_release);  // the next line
      if (v == ~0ull) return;
    }
  }
  void round_trip(uint32_t n, uint64_t deadline) override {
    for (uint32_t i = 0; i < n; ++i) bounce(++seq_, deadline);
  }
  void stop(uint64_t deadline) override { bounce(~0ull, deadline); }

 private:
  void bounce(uint64_t v, uint64_t deadline) {
    std::atomic_ref<uint64_t>(region_[0]).store(v, std::memory_order_release);
    rpc::Backoff backoff;
    for (uint64_t spin = 0; std::atomic_ref<uint64_t>(region_[8]).load(std::memory_order_acquire) != v;
         ++spin) {
      backoff.wait();
      if ((spin & 1023) == 1023 && now_ns() > deadline) fail("line: the peer did not answer in time");
    }
  }
  uint64_t* region_ = nullptr;
  uint64_t seq_ = 0;
};

// ---- sockets: 64-byte frames, echoed as a byte stream ----------------------------------------
struct Frame {
  uint64_t seq;
  uint32_t op, len;
  uint8_t payload[kPayload];
};
static_assert(sizeof(Frame) == 64);

void send_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(std::string("send: ") + std::strerror(errno));
    c += w, n -= size_t(w);
  }
}
// spin: poll with MSG_DONTWAIT and the same bounded spin as the rpc channel, instead of sleeping
// in the kernel until data arrives (the socket analogue of busy polling).
void recv_all(int fd, void* p, size_t n, bool spin) {
  char* c = static_cast<char*>(p);
  rpc::Backoff backoff;
  while (n) {
    ssize_t r = ::recv(fd, c, n, spin ? MSG_DONTWAIT : 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && spin && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      backoff.wait();
      continue;
    }
    backoff.reset();
    if (r <= 0)
      fail(r == 0 ? "the server closed the connection" : std::string("recv: ") + std::strerror(errno));
    c += r, n -= size_t(r);
  }
}

class SocketTransport : public Transport {
 public:
  SocketTransport(bool tcp, bool spin) : tcp_(tcp), spin_(spin) {}
  ~SocketTransport() override {
    for (int fd : {client_, server_, listener_})
      if (fd >= 0) ::close(fd);
  }
  void prepare(uint32_t depth) override {
    frames_.resize(depth);
    if (!tcp_) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        throw OsError(errno, "bench rpc: socketpair");
      client_ = sv[0], server_ = sv[1];
      return;
    }
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener_ < 0) throw OsError(errno, "bench rpc: socket");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listener_, 1) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &al) != 0)
      throw OsError(errno, "bench rpc: cannot listen on 127.0.0.1");
    client_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    // Completes from the listen backlog; the child accepts after fork.
    if (client_ < 0 || ::connect(client_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      throw OsError(errno, "bench rpc: cannot connect to 127.0.0.1");
    nodelay(client_);
  }
  void in_child() override {
    ::close(client_), client_ = -1;
    if (tcp_) {
      server_ = ::accept(listener_, nullptr, nullptr);
      ::close(listener_), listener_ = -1;
      if (server_ < 0) fail("accept failed");
      nodelay(server_);
    }
  }
  void in_parent() override {
    if (server_ >= 0) ::close(server_), server_ = -1;
    if (listener_ >= 0) ::close(listener_), listener_ = -1;
  }
  void serve() override {
    std::vector<char> buf(64 * 1024);
    rpc::Backoff backoff;
    for (;;) {
      ssize_t r = ::recv(server_, buf.data(), buf.size(), spin_ ? MSG_DONTWAIT : 0);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && spin_ && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        backoff.wait();
        continue;
      }
      backoff.reset();
      if (r <= 0) return;  // the client shut down its side: done
      send_all(server_, buf.data(), size_t(r));
    }
  }
  void round_trip(uint32_t n, uint64_t) override {
    for (uint32_t s = 0; s < n; ++s) {
      Frame& f = frames_[s];
      f.seq = ++seq_;
      f.op = kOpEcho, f.len = kPayload;
      fill(f.payload, f.seq);
    }
    send_all(client_, frames_.data(), n * sizeof(Frame));  // the batch in one send, like one fence
    recv_all(client_, frames_.data(), n * sizeof(Frame), spin_);
    for (uint32_t s = 0; s < n; ++s)
      if (frames_[s].seq != seq_ - n + 1 + s || !matches(frames_[s].payload, frames_[s].seq))
        fail(std::string(tcp_ ? "tcp" : "uds") + ": wrong echo for seq " + std::to_string(seq_ - n + 1 + s));
  }
  void stop(uint64_t) override { ::shutdown(client_, SHUT_WR); }

 private:
  static void nodelay(int fd) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  bool tcp_, spin_;
  int listener_ = -1, client_ = -1, server_ = -1;
  uint64_t seq_ = 0;
  std::vector<Frame> frames_;
};

std::unique_ptr<Transport> make(const std::string& name, const Options& opt) {
  if (name == "rpc") return std::make_unique<RpcTransport>(opt.backend, opt.dir);
  if (name == "line") return std::make_unique<LineTransport>();
  if (name == "tcp") return std::make_unique<SocketTransport>(true, false);
  if (name == "uds") return std::make_unique<SocketTransport>(false, false);
  if (name == "tcp_spin") return std::make_unique<SocketTransport>(true, true);
  if (name == "uds_spin") return std::make_unique<SocketTransport>(false, true);
  throw ArgumentError("unknown transport '" + name + "' (rpc, line, tcp, uds, tcp_spin, uds_spin)");
}

// Two CPUs this process may run on, server first; (-1, -1) if there is only one.
std::pair<int, int> pick_cpus() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return {-1, -1};
  int found[2] = {-1, -1}, k = 0;
  for (int c = 0; c < CPU_SETSIZE && k < 2; ++c)
    if (CPU_ISSET(c, &set)) found[k++] = c;
  return k == 2 ? std::pair<int, int>{found[0], found[1]} : std::pair<int, int>{-1, -1};
}

struct Phase {
  double p50 = 0, p99 = 0, msgs_per_s = 0;
};

// One server process, `rounds` timed round trips of `n` messages each.
Phase run_phase(const std::string& name, const Options& opt, uint32_t n, uint32_t rounds, int scpu,
                int ccpu) {
  auto t = make(name, opt);
  t->prepare(n);
  pid_t pid = ::fork();
  if (pid < 0) throw OsError(errno, "bench rpc: fork");
  if (pid == 0) {  // the server: C++ only, never back into the caller's runtime
    int rc = 0;
    try {
      pin_self(scpu);
      t->in_child();
      t->serve();
    } catch (...) {
      rc = 1;
    }
    ::_exit(rc);
  }
  Child child(pid);
  t->in_parent();
  PinGuard pin(ccpu);
  const uint64_t deadline = now_ns() + uint64_t(opt.phase_timeout_s * 1e9);
  for (uint32_t i = 0; i < opt.warmup; ++i) t->round_trip(n, deadline);
  std::vector<uint64_t> lat(rounds);
  const uint64_t start = now_ns();
  for (uint32_t i = 0; i < rounds; ++i) {
    uint64_t t0 = now_ns();
    t->round_trip(n, deadline);
    lat[i] = now_ns() - t0;
  }
  const uint64_t elapsed = now_ns() - start;
  t->stop(deadline);
  if (!child.join(10)) fail(name + ": the server process did not exit cleanly");
  Phase ph;
  ph.msgs_per_s = elapsed ? double(rounds) * n * 1e9 / double(elapsed) : 0;
  ph.p50 = percentile(lat, 0.50);
  ph.p99 = percentile(lat, 0.99);
  return ph;
}

}  // namespace

std::vector<std::pair<const char*, double>> Result::fields() const {
  return {{"p50_ns", p50_ns},
          {"p99_ns", p99_ns},
          {"msgs_per_s_qd1", msgs_per_s_qd1},
          {"batch_p50_ns", batch_p50_ns},
          {"msgs_per_s_deep", msgs_per_s_deep}};
}

Result run(const std::string& transport, const Options& opt) {
  if (opt.iterations == 0 || opt.batches == 0 || opt.depth == 0 || opt.depth > rpc::kMaxSlots)
    throw ArgumentError("bench rpc: iterations, batches and depth (<= " + std::to_string(rpc::kMaxSlots) +
                        ") must be positive");
  (void)make(transport, opt);  // reject an unknown name before forking anything
  Result r;
  r.transport = transport;
  if (opt.pin) std::tie(r.server_cpu, r.client_cpu) = pick_cpus();
  Phase one = run_phase(transport, opt, 1, opt.iterations, r.server_cpu, r.client_cpu);
  Phase deep = run_phase(transport, opt, opt.depth, opt.batches, r.server_cpu, r.client_cpu);
  r.p50_ns = one.p50, r.p99_ns = one.p99, r.msgs_per_s_qd1 = one.msgs_per_s;
  r.batch_p50_ns = deep.p50, r.msgs_per_s_deep = deep.msgs_per_s;
  return r;
}

}  // namespace cxlkv::rpcbench
