#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

namespace cxlkv {

namespace {
using Clock = std::chrono::steady_clock;
double pct(std::vector<uint32_t>& v, double p) {
  if (v.empty()) return 0;
  size_t k = std::min(v.size() - 1, size_t(p * double(v.size())));
  std::nth_element(v.begin(), v.begin() + long(k), v.end());
  return v[k];
}
Key make_key(uint64_t seed, uint64_t i) {
  Key k{};
  uint64_t a = xxh3(&i, 8, seed), b = xxh3(&i, 8, seed + 1), c = xxh3(&i, 8, seed + 2), d = xxh3(&i, 8, seed + 3);
  std::memcpy(k.data(), &a, 8), std::memcpy(k.data() + 8, &b, 8);
  std::memcpy(k.data() + 16, &c, 8), std::memcpy(k.data() + 24, &d, 8);
  return k;
}
}  // namespace

IndexBenchResult bench_index(Pool& pool, const NsHandle& ns, uint64_t inserts, uint64_t lookups,
                             uint64_t payload_bytes, uint64_t seed, double seconds) {
  IndexBenchResult r;
  std::vector<char> payload(std::min<uint64_t>(payload_bytes, ns.block_bytes), 'x');
  Piece piece{payload.data(), payload.size()};
  std::vector<Key> keys(inserts);
  for (uint64_t i = 0; i < inserts; ++i) keys[i] = make_key(seed, i);

  std::vector<uint32_t> ins_ns;
  ins_ns.reserve(inserts);
  auto t0 = Clock::now();
  for (uint64_t i = 0; i < inserts; ++i) {
    auto a = Clock::now();
    if (pool.put(ns, keys[i], &piece, 1, 0)) ++r.inserts;
    ins_ns.push_back(uint32_t(std::min<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - a).count(), UINT32_MAX)));
  }
  double ins_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.inserts_per_s = ins_s > 0 ? double(inserts) / ins_s : 0;
  r.insert_p50_ns = pct(ins_ns, 0.50);
  r.insert_p99_ns = pct(ins_ns, 0.99);

  // Keep only keys that are resident (eviction may have dropped some if the pool is small).
  std::vector<Key> present;
  for (auto& k : keys) if (pool.contains(ns, k)) present.push_back(k);
  if (present.empty()) return r;
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> order(std::max<uint64_t>(lookups, 1));
  for (auto& o : order) o = uint32_t(rng() % present.size());

  // Latency: one clock read per op (its ~20 ns overhead is included and small).
  std::vector<uint32_t> lat;
  lat.reserve(order.size());
  uint64_t found = 0;
  for (uint32_t o : order) {
    auto a = Clock::now();
    found += pool.contains(ns, present[o]);
    lat.push_back(uint32_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - a).count()));
  }
  double sum = 0;
  for (auto v : lat) sum += v;
  r.lookup_mean_ns = sum / double(lat.size());
  r.lookup_p50_ns = pct(lat, 0.50);
  r.lookup_p99_ns = pct(lat, 0.99);

  // Throughput: back-to-back lookups for `seconds`.
  uint64_t done = 0;
  auto start = Clock::now();
  double el = 0;
  while (el < seconds) {
    for (uint32_t o : order) found += pool.contains(ns, present[o]);
    done += order.size();
    el = std::chrono::duration<double>(Clock::now() - start).count();
  }
  r.lookups = done;
  r.lookups_per_s = double(done) / el;
  (void)found;
  return r;
}

}  // namespace cxlkv
