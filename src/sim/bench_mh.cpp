// `cxlkv-sim --bench`: what the multihost discipline costs on this machine, against the coherent
// baseline measured in the same run. Prints one JSON object.
//   backends: put / get latency (p50, 4 KiB blocks, one process) per backend, ratio to coherent
//   bakery:   lock + unlock latency (p50) of the cross-host lock vs the number of host rows it
//             scans (uncontended: one host), and with `threads` hosts competing (each a thread
//             with its own row, on real memory with clflush)
#include "bench_mh.h"
#include "percentile.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "arbiter.h"
#include "liveness.h"
#include "pool.h"

namespace cxlkv::sim {

namespace {
using Clock = std::chrono::steady_clock;
uint64_t ns_since(Clock::time_point t) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count());
}
uint64_t p50(std::vector<uint64_t> v) { return uint64_t(percentile(v, 0.5)); }

struct OpCost {
  uint64_t put_p50, get_p50;
};

OpCost bench_backend(Backend b, int n) {
  std::string path = "/dev/shm/cxlkv-bench-mh-" + std::to_string(::getpid());
  CreateOptions c;
  c.size = 64ull << 20;
  c.backend = b;
  if (b == Backend::multihost) c.lock_hosts = 4;  // the other backends have no lock area
  auto p = Pool::create(path, c, false);
  ::unlink(path.c_str());
  Layout l;
  l.name = "bench";
  l.model_id = "bench";
  l.block_bytes = 4096;
  auto ns = p->open_namespace(l);
  std::vector<char> buf(4096, 'b'), out(4096);
  std::vector<uint64_t> put_ns, get_ns;
  for (int i = 0; i < n; ++i) {
    Key k{};
    std::memcpy(k.data(), &i, sizeof i);
    Piece src{buf.data(), buf.size()};
    auto t = Clock::now();
    p->put(ns, k, &src, 1, 0);
    put_ns.push_back(ns_since(t));
  }
  for (int i = 0; i < n; ++i) {
    Key k{};
    std::memcpy(k.data(), &i, sizeof i);
    Piece dst{out.data(), out.size()};
    uint64_t len;
    auto t = Clock::now();
    p->get(ns, k, &dst, 1, &len);
    get_ns.push_back(ns_since(t));
  }
  p->close();
  return {p50(put_ns), p50(get_ns)};
}

// A bare lock area plus node table on real memory, shared by `threads` bakeries (one row each).
struct LockBench {
  std::vector<char> mem;
  std::vector<format::NodeSlot> nodes;
  std::atomic<bool> fenced{false};
  std::atomic<uint64_t> beat{0};
};

uint64_t bench_lock(uint32_t hosts, uint32_t threads, int iters, double* per_sec) {
  LockBench lb;
  lb.mem.assign(format::kLockAreaOff + size_t(format::kLockStripes) * hosts * 64 + 4096, 0);
  lb.nodes.resize(4);
  std::vector<std::vector<uint64_t>> lat(threads);
  std::vector<std::thread> ts;
  std::atomic<bool> go{false};
  auto t0 = Clock::now();
  for (uint32_t t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      Bakery::Config c;
      c.base = lb.mem.data();
      c.hosts = hosts;
      c.slot = t;
      c.max_nodes = 4;
      c.nodes = lb.nodes.data();
      c.lease_ns = 3600ull * 1'000'000'000;
      c.coh = Coherence(Backend::multihost);
      c.fenced = &lb.fenced;
      c.last_beat = &lb.beat;
      Bakery bk(std::move(c));
      char* word = lb.mem.data() + format::kLockAreaOff +
                   size_t(format::kLockStripes) * hosts * 64;  // one stripe for all
      while (!go.load()) std::this_thread::yield();
      lat[t].reserve(size_t(iters));
      for (int i = 0; i < iters; ++i) {
        lb.beat.store(liveness::mono_ns());
        auto s = Clock::now();
        bk.lock(word);
        bk.unlock(word);
        lat[t].push_back(ns_since(s));
      }
    });
  }
  t0 = Clock::now();
  go = true;
  for (auto& t : ts) t.join();
  double secs = double(ns_since(t0)) / 1e9;
  std::vector<uint64_t> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  *per_sec = double(all.size()) / secs;
  return p50(all);
}
}  // namespace

std::string bench_multihost(int ops) {
  std::ostringstream s;
  OpCost coh = bench_backend(Backend::coherent, ops);
  OpCost fl = bench_backend(Backend::flush, ops);
  OpCost mh = bench_backend(Backend::multihost, ops);
  auto ratio = [](uint64_t a, uint64_t b) { return b ? double(a) / double(b) : 0.0; };
  s << "{\"bench\": \"multihost\", \"ops\": " << ops << ", \"block_bytes\": 4096, \"backends\": {"
    << "\"coherent\": {\"put_p50_ns\": " << coh.put_p50 << ", \"get_p50_ns\": " << coh.get_p50 << "}, "
    << "\"flush\": {\"put_p50_ns\": " << fl.put_p50 << ", \"get_p50_ns\": " << fl.get_p50 << "}, "
    << "\"multihost\": {\"put_p50_ns\": " << mh.put_p50 << ", \"get_p50_ns\": " << mh.get_p50 << "}}, "
    << "\"multihost_vs_coherent\": {\"put\": " << ratio(mh.put_p50, coh.put_p50)
    << ", \"get\": " << ratio(mh.get_p50, coh.get_p50) << "}, \"lock\": [";
  bool first = true;
  for (uint32_t hosts : {1u, 2u, 4u, 8u, 16u}) {
    for (uint32_t threads : {1u, 2u, 4u}) {
      if (threads > hosts) continue;
      double rate = 0;
      uint64_t lat = bench_lock(hosts, threads, threads == 1 ? 20000 : 5000, &rate);
      s << (first ? "" : ", ") << "{\"hosts\": " << hosts << ", \"competing\": " << threads
        << ", \"lock_unlock_p50_ns\": " << lat << ", \"acquires_per_s\": " << uint64_t(rate) << "}";
      first = false;
    }
  }
  s << "], \"note\": \"real memory of one machine (clflush of local DRAM); machine shared\"}";
  return s.str();
}

}  // namespace cxlkv::sim
