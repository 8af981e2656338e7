#include "bench.h"
#include "percentile.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include <sys/mman.h>

namespace cxlkv {

namespace {
using Clock = std::chrono::steady_clock;
Key make_key(uint64_t seed, uint64_t i) {
  Key k{};
  uint64_t a = xxh3(&i, 8, seed), b = xxh3(&i, 8, seed + 1), c = xxh3(&i, 8, seed + 2),
           d = xxh3(&i, 8, seed + 3);
  std::memcpy(k.data(), &a, 8), std::memcpy(k.data() + 8, &b, 8);
  std::memcpy(k.data() + 16, &c, 8), std::memcpy(k.data() + 24, &d, 8);
  return k;
}
// p50 of single dependent 64-byte reads at random lines of an anonymous mapping of `bytes`
// (base pages, like the pool's shared mapping): the latency one index probe cannot beat.
double line_read_p50(uint64_t bytes, uint64_t hops, uint64_t seed) {
  const uint64_t lines = std::max<uint64_t>(bytes / 64, 2);
  void* m = ::mmap(nullptr, lines * 64, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return 0;
  ::madvise(m, lines * 64, MADV_NOHUGEPAGE);
  auto* base = static_cast<uint64_t*>(m);
  // Sattolo's shuffle: one cycle through every line, so each hop is a fresh random line.
  std::vector<uint32_t> next(lines);
  for (uint64_t i = 0; i < lines; ++i) next[i] = uint32_t(i);
  std::mt19937_64 rng(seed);
  for (uint64_t i = lines - 1; i > 0; --i) std::swap(next[i], next[rng() % i]);
  for (uint64_t i = 0; i < lines; ++i) base[i * 8] = next[i];
  std::vector<uint32_t> lat;
  lat.reserve(hops);
  uint64_t at = 0;
  for (uint64_t h = 0; h < hops; ++h) {
    auto a = Clock::now();
    at = *static_cast<volatile uint64_t*>(base + at * 8);
    lat.push_back(uint32_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - a).count()));
  }
  ::munmap(m, lines * 64);
  return percentile(lat, 0.50);
}
}  // namespace

std::vector<std::pair<const char*, double>> IndexBenchResult::fields() const {
  return {{"inserts", double(inserts)},
          {"lookups", double(lookups)},
          {"lookup_p50_ns", lookup_p50_ns},
          {"lookup_p99_ns", lookup_p99_ns},
          {"lookup_mean_ns", lookup_mean_ns},
          {"insert_p50_ns", insert_p50_ns},
          {"insert_p99_ns", insert_p99_ns},
          {"lookups_per_s", lookups_per_s},
          {"inserts_per_s", inserts_per_s},
          {"line_read_p50_ns", line_read_p50_ns},
          {"prefix256_match_ns_per_key", prefix256_match_ns_per_key},
          {"prefix256_acquire_ns_per_key", prefix256_acquire_ns_per_key},
          {"lookup_vs_line_read", lookup_vs_line_read},
          {"prefix256_vs_line_read", prefix256_vs_line_read}};
}

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
    ins_ns.push_back(uint32_t(std::min<int64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - a).count(), UINT32_MAX)));
  }
  double ins_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.inserts_per_s = ins_s > 0 ? double(inserts) / ins_s : 0;
  r.insert_p50_ns = percentile(ins_ns, 0.50);
  r.insert_p99_ns = percentile(ins_ns, 0.99);

  // Keep only keys that are resident (eviction may have dropped some if the pool is small).
  std::vector<Key> present;
  for (auto& k : keys)
    if (pool.contains(ns, k)) present.push_back(k);
  if (present.empty()) return r;
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> order(std::max<uint64_t>(lookups, 1));
  for (auto& o : order) o = uint32_t(rng() % present.size());

  // Latency: one clock read per op (its ~20 ns overhead is included and small). The keys are
  // laid out in lookup order first: a caller has its key in hand (it just hashed it), so
  // fetching it from a random place of a 3 MB key array is not part of a lookup's cost.
  std::vector<Key> in_order(order.size());
  for (size_t i = 0; i < order.size(); ++i) in_order[i] = present[order[i]];
  std::vector<uint32_t> lat;
  lat.reserve(order.size());
  uint64_t found = 0;
  for (const Key& k : in_order) {
    auto a = Clock::now();
    found += pool.contains(ns, k);
    lat.push_back(uint32_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - a).count()));
  }
  double sum = 0;
  for (auto v : lat) sum += v;
  r.lookup_mean_ns = sum / double(lat.size());
  r.lookup_p50_ns = percentile(lat, 0.50);
  r.lookup_p99_ns = percentile(lat, 0.99);
  r.line_read_p50_ns =
      line_read_p50(pool.header().index_slots * sizeof(format::IndexEntry), order.size(), seed);
  if (r.line_read_p50_ns > 0) r.lookup_vs_line_read = r.lookup_p50_ns / r.line_read_p50_ns;

  // Batched prefix match of 256 random present keys per call (independent home lines, as the
  // hashes of a real prefix are): p50 over calls, per key.
  constexpr size_t kPrefix = 256;
  if (present.size() >= kPrefix) {
    std::vector<uint32_t> per_match, per_acquire;
    std::vector<Key> batch(kPrefix);
    const size_t calls = std::max<size_t>(order.size() / kPrefix, 16);
    for (size_t c = 0; c < calls; ++c) {
      for (auto& k : batch) k = present[rng() % present.size()];
      auto a = Clock::now();
      size_t m = pool.match_prefix(ns, batch.data(), kPrefix);
      auto b = Clock::now();
      for (auto& k : batch) k = present[rng() % present.size()];
      auto c0 = Clock::now();
      auto pins = pool.acquire(ns, batch.data(), kPrefix);
      auto c1 = Clock::now();
      pool.release(pins);
      if (m == kPrefix)
        per_match.push_back(uint32_t(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count()));
      if (pins.size() == kPrefix)
        per_acquire.push_back(
            uint32_t(std::chrono::duration_cast<std::chrono::nanoseconds>(c1 - c0).count()));
    }
    r.prefix256_match_ns_per_key = percentile(per_match, 0.50) / kPrefix;
    r.prefix256_acquire_ns_per_key = percentile(per_acquire, 0.50) / kPrefix;
    if (r.line_read_p50_ns > 0) r.prefix256_vs_line_read = r.prefix256_match_ns_per_key / r.line_read_p50_ns;
  }

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
