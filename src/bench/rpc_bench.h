// `cxlkv bench rpc`: round trips between two real processes (a forked server, this process as
// the client), the same echo protocol over every transport so the numbers compare:
//   rpc   the shared-memory channel (rpc.h) in a mapped file, busy polling on both sides
//   line  the floor: one word bounced between two cache lines by plain stores and loads
//   tcp   TCP loopback, TCP_NODELAY, blocking send/recv
//   uds   a Unix stream socket (socketpair), blocking send/recv
//   tcp_spin, uds_spin  the same sockets, but both sides poll recv(MSG_DONTWAIT) with the rpc
//         channel's bounded spin instead of sleeping in the kernel: busy polling on both paths,
//         so the comparison is of the transports, not of wake-up latency
// One message = 64 bytes (a cache line): for rpc a Line with 48 payload bytes, for sockets a
// 64-byte frame with the same 48 payload bytes. The server echoes the payload; the client checks
// every byte (a wrong echo fails the run). Depth 1: each round trip timed on its own (p50/p99).
// Depth D: D requests posted at once (rpc: D slots, one fence; sockets: one send of D frames),
// then all D answers awaited; messages/s over the whole phase, and the batch round trip's p50.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "coherence.h"

namespace cxlkv::rpcbench {

struct Options {
  uint32_t iterations = 20000;          // timed depth-1 round trips
  uint32_t warmup = 2000;               // untimed round trips before each phase
  uint32_t depth = 128;                 // the deep queue depth
  uint32_t batches = 2000;              // timed batches at `depth`
  Backend backend = Backend::coherent;  // rpc channel discipline
  std::string dir = "/dev/shm";         // where the rpc channel file lives (unlinked at once)
  bool pin = true;                      // server and client on two different CPUs if allowed
  double phase_timeout_s = 60;          // a stuck peer fails the run instead of hanging it
};

struct Result {
  std::string transport;
  double p50_ns = 0, p99_ns = 0, msgs_per_s_qd1 = 0;
  double batch_p50_ns = 0, msgs_per_s_deep = 0;
  int server_cpu = -1, client_cpu = -1;
  std::vector<std::pair<const char*, double>> fields() const;
};

// transport: "rpc", "line", "tcp", "uds", "tcp_spin" or "uds_spin". Throws cxlkv::Error when a phase fails or
// times out.
Result run(const std::string& transport, const Options& opt);

}  // namespace cxlkv::rpcbench
