// Where a token-row gather's time goes (issues 15 and 24): the product's gather (tokens::gather_rows
// on a real pool in /dev/shm, blocks put and pinned as token_store.py does) beside its parts (the
// row copies alone, the copies and the stored checks, the check alone on rows in L1) and a packed
// memcpy of the same bytes, all in one process with the same threads. A profiling tool, not part of
// the product: build and run with scripts/bench_gather_micro.sh [row_bytes] [context] [layers] [k]
// [repeats]; each line is the median (and best) of the repeats. The copy threads are the product's
// (CXLKV_COPY_THREADS); the memcpy is split over as many. Older variants (format 1's XXH3 loops,
// prefetch and lag schedules: BENCHMARKS.md, "Token-row gather") are in this file's git history.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "copy_threads.h"
#include "dtype.h"
#include "errors.h"
#include "layout.h"
#include "pool.h"
#include "token_rows.h"

using namespace cxlkv;
using namespace cxlkv::tokens;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs f once to warm up, then reps times; prints the median and the best.
template <class F>
void run(const char* name, size_t bytes, int reps, F&& f) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double a = now();
    f();
    t.push_back(now() - a);
  }
  std::sort(t.begin(), t.end());
  const double med = t[t.size() / 2];
  std::printf("%-50s %7.3f ms  %6.2f GB/s  (best %.3f ms)\n", name, med * 1e3, bytes / med / 1e9, t[0] * 1e3);
}

Key key_of(uint64_t chunk) {
  Key k{};
  std::memcpy(k.data(), &chunk, 8);
  k[31] = 0x6d;
  return k;
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t R = argc > 1 ? uint32_t(atoi(argv[1])) : 656;
  const uint64_t ctx = argc > 2 ? uint64_t(atoll(argv[2])) : 131072;
  const uint32_t L = argc > 3 ? uint32_t(atoi(argv[3])) : 4;
  const size_t k = argc > 4 ? size_t(atoll(argv[4])) : 2048;
  const int reps = argc > 5 ? std::max(1, atoi(argv[5])) : 9;
  constexpr uint32_t T = 64;
  constexpr uint64_t kSeq = 42;
  const TokenGeometry g = TokenGeometry::make(L, T, R);
  const uint64_t nb = ctx / T, bb = g.block_bytes();

  // A pool as large as the sequence's blocks and some room; blocks put and pinned.
  const std::string path = "/dev/shm/cxlkv-gather-micro-" + std::to_string(getpid());
  CreateOptions co;
  co.size = (nb * bb + (nb * bb) / 8 + (64ull << 20) + 0xFFFFF) & ~uint64_t(0xFFFFF);
  std::unique_ptr<Pool> pool;
  try {
    pool = Pool::create(path, co, false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pool: %s\n", e.what());
    return 1;
  }
  ::unlink(path.c_str());  // the mapping stays; nothing is left in /dev/shm whatever happens next
  Layout lay;
  lay.name = "gather-micro", lay.model_id = "gather-micro", lay.dtype = uint32_t(DType::bytes);
  lay.kind = format::kLayoutOpaque, lay.block_bytes = bb;
  const NsHandle ns = pool->open_namespace(lay);
  std::mt19937_64 rng(7);
  std::vector<char> block(bb);
  std::vector<Key> keys;
  for (uint64_t c = 0; c < nb; ++c) {
    for (auto& b : block) b = char(rng());
    seal_block(block.data(), g, kSeq, 0, c, T);
    keys.push_back(key_of(c));
    const Piece p{block.data(), bb};
    if (!pool->put(ns, keys.back(), &p, 1, 0)) std::abort();
  }
  auto pins = pool->acquire(ns, keys.data(), nb);
  const auto blocks = resolve_blocks(
      pool->arena_view(),
      [&](const Key& k, uint64_t* off, uint64_t* len) { return pool->locate(ns, k, off, len); }, ns, g,
      keys.data(), nb, kSeq, 0, 0);
  if (pins.size() != nb || blocks.size() != nb) std::abort();
  std::vector<uint64_t> offs(nb);
  for (uint64_t c = 0; c < nb; ++c) offs[c] = blocks[c].offset;

  // k random distinct positions per layer; packed rows [L][ctx][R] as large as the context's rows.
  std::vector<int64_t> idx(size_t(L) * k);
  std::vector<int64_t> all(ctx);
  std::iota(all.begin(), all.end(), 0);
  for (uint32_t l = 0; l < L; ++l) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + long(k), idx.begin() + long(l) * long(k));
  }
  const size_t rows = size_t(L) * k, out_bytes = rows * R;
  std::vector<char> packed(uint64_t(L) * ctx * R, 1), out(out_bytes);
  const size_t slices = packed.size() / out_bytes;
  size_t turn = 0;
  const unsigned threads = copy_thread_count();

  // The hand-written parts: every row's source and stored check, in the gather's order.
  auto for_each_row = [&](auto&& f) {
    for (size_t r = 0; r < rows; ++r) {
      const uint32_t layer = uint32_t(r / k);
      const uint64_t pos = uint64_t(idx[r]);
      const char* blk = pool->arena_bytes(offs[pos / T], bb);
      f(r, layer, pos, blk + g.row_off(layer, uint32_t(pos % T)),
        blk + g.check_off(layer, uint32_t(pos % T)));
    }
  };
  SeqRows s{&g, kSeq, 0, nb * T, offs.data(), offs.size()};

  std::printf(
      "row %u B, context %lu, %u layers, k %zu: %.1f MB gathered, pool %.0f MB, %u copy thread(s), "
      "row check kernel %s, token format %u\n",
      R, (unsigned long)ctx, L, k, out_bytes / 1e6, co.size / 1e6, threads, row_check_kernel_name(),
      kTokenBlockVersion);
  run("packed memcpy (same threads)", out_bytes, reps, [&] {
    const char* src = packed.data() + (turn++ % slices) * out_bytes;
    run_on_copy_threads(threads, [&](unsigned p) {
      const size_t a = out_bytes * p / threads, b = out_bytes * (p + 1) / threads;
      std::memcpy(out.data() + a, src + a, b - a);
    });
  });
  run("pool rows: copy only (1 thread)", out_bytes, reps, [&] {
    for_each_row([&](size_t r, uint32_t, uint64_t, const char* row, const char*) {
      std::memcpy(out.data() + r * R, row, R);
    });
  });
  run("pool rows: copy + read stored checks (1 thread)", out_bytes, reps, [&] {
    uint64_t x = 0;
    for_each_row([&](size_t r, uint32_t, uint64_t, const char* row, const char* check) {
      std::memcpy(out.data() + r * R, row, R);
      uint64_t w;
      std::memcpy(&w, check, 8);
      x += w;
    });
    if (x == 1) std::puts("");
  });
  run("pool rows: one pass per row, copy_row_check (1 thread)", out_bytes, reps, [&] {
    size_t bad = 0;
    uint64_t ls = layer_seed(kSeq, 0, 0);
    for_each_row([&](size_t r, uint32_t layer, uint64_t pos, const char* row, const char* check) {
      if (r % k == 0) ls = layer_seed(kSeq, 0, layer);
      uint64_t w;
      std::memcpy(&w, check, 8);
      bad += copy_row_check(out.data() + r * R, row, R, row_seed(ls, pos)) != w;
    });
    if (bad) std::printf("!! %zu rows failed\n", bad);
  });
  run("the check alone: 32 rows in L1, rechecked", out_bytes, reps, [&] {
    uint64_t x = 0;
    const size_t span = std::min<size_t>(32, rows);
    for (size_t r = 0; r < rows; ++r) x += row_check(out.data() + (r % span) * R, R, r);
    if (x == 1) std::puts("");
  });
  run("the product: gather_rows (copy threads)", out_bytes, reps, [&] {
    const GatherResult res = gather_rows(pool->arena_view(), s, 0, L, idx.data(), k, true, out.data());
    if (res.status != GatherResult::kOk) std::printf("!! gather failed at row %zu\n", res.bad_pos);
  });
  pool->release(pins);
  return 0;
}
