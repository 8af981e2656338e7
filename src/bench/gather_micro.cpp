// Where a token-row gather's time goes (issue 15, Performance): variants of the gather loop of
// src/core/transfer/token_rows.cpp on the token block layout, in a /dev/shm mapping (as the pool) and in
// private memory, against a packed memcpy of the same bytes. A profiling tool, not part of the
// product: build with scripts/bench_gather_micro.sh, run with [row_bytes] [context] [layers] [k]
// [repeats] [all]; each line is the median of the repeats ("all": the older variants as well).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checksum.h"
#include "token_rows.h"

using namespace cxlkv;
using namespace cxlkv::tokens;

namespace {

// The row check of token format 1 (before row_check.h): XXH3-64 of the row, mixed with the seed;
// libxxhash's build for baseline x86-64 (SSE2) and xxh3_vec (the CPU's widest stripe loop). The
// blocks here are sealed with format 2's check, so the variants that use these compare against
// other values (the same memory traffic and arithmetic; their mismatches are not reported).
uint64_t row_check_sse2(const void* row, size_t n, uint64_t seed) { return check_mix(xxh3(row, n) ^ seed); }
uint64_t row_check_v1(const void* row, size_t n, uint64_t seed) { return check_mix(xxh3_vec(row, n) ^ seed); }

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double median_s(F&& f, int reps, double* best = nullptr) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    double a = now();
    f();
    t.push_back(now() - a);
  }
  std::sort(t.begin(), t.end());
  if (best) *best = t[0];
  return t[t.size() / 2];
}

char* map_shm(size_t bytes) {
  std::string path = "/dev/shm/cxlkv-gather-micro-" + std::to_string(getpid());
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ftruncate(fd, off_t(bytes)) != 0) std::abort();
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  unlink(path.c_str());
  if (p == MAP_FAILED) std::abort();
  return static_cast<char*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t R = argc > 1 ? uint32_t(atoi(argv[1])) : 656;
  const uint64_t ctx = argc > 2 ? uint64_t(atoll(argv[2])) : 131072;
  const uint32_t L = argc > 3 ? uint32_t(atoi(argv[3])) : 4;
  const size_t k = argc > 4 ? size_t(atoll(argv[4])) : 2048;
  const int reps = argc > 5 ? atoi(argv[5]) : 9;
  const bool all = argc > 6 && std::string(argv[6]) == "all";  // the older variants too
  const uint32_t T = 64;
  TokenGeometry g = TokenGeometry::make(L, T, R);
  const uint64_t nb = ctx / T, bb = g.block_bytes();
  // The pool has 8 MiB chunks of blocks; the layout here is blocks back to back (same scatter).
  char* shm = map_shm(nb * bb);
  std::vector<char> priv_blocks(nb * bb);
  std::mt19937_64 rng(7);
  std::vector<char> rowsbuf(bb);
  for (uint64_t c = 0; c < nb; ++c) {
    for (auto& b : rowsbuf) b = char(rng());
    seal_block(rowsbuf.data(), g, 42, 0, c, T);
    std::memcpy(shm + c * bb, rowsbuf.data(), bb);
    std::memcpy(priv_blocks.data() + c * bb, rowsbuf.data(), bb);
  }
  // Private packed rows [L][ctx][R]: what numpy fancy indexing would gather from.
  std::vector<char> packed_rows(uint64_t(L) * ctx * R, 1);
  std::vector<int64_t> idx(size_t(L) * k);
  for (uint32_t l = 0; l < L; ++l) {
    std::vector<int64_t> all(ctx);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + k, idx.begin() + l * k);
  }
  const size_t out_bytes = size_t(L) * k * R;
  std::vector<char> out(out_bytes);
  std::vector<uint64_t> offs(nb);
  for (uint64_t c = 0; c < nb; ++c) offs[c] = c * bb;
  const size_t slices = packed_rows.size() / out_bytes;
  size_t turn = 0;

  auto gather = [&](const char* base, int prefetch, bool read_hash, int hash_mode) {
    constexpr size_t kAhead = 16;
    uint64_t bad = 0;
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst = out.data() + size_t(l) * k * R;
      auto pf = [&](int64_t pos) {
        const char* blk = base + offs[uint64_t(pos) / T];
        const uint32_t t = uint32_t(uint64_t(pos) % T);
        const char* row = blk + g.row_off(l, t);
        if (prefetch & 1)
          for (uint64_t o = 0; o < R; o += 64) __builtin_prefetch(row + o);
        if (prefetch & 2) __builtin_prefetch(blk + g.hash_off(l, t));
      };
      if (prefetch)
        for (size_t i = 0; i < std::min(k, kAhead); ++i) pf(ix[i]);
      for (size_t i = 0; i < k; ++i, dst += R) {
        if (prefetch && i + kAhead < k) pf(ix[i + kAhead]);
        const uint64_t pos = uint64_t(ix[i]);
        const char* blk = base + offs[pos / T];
        const uint32_t t = uint32_t(pos % T);
        std::memcpy(dst, blk + g.row_off(l, t), R);
        uint64_t want = 0;
        if (read_hash) std::memcpy(&want, blk + g.hash_off(l, t), 8);
        if (hash_mode == 1) bad += row_check_sse2(dst, R, row_seed(42, 0, l, pos)) != want;
        if (hash_mode == 2) bad += row_check_v1(dst, R, row_seed(42, 0, l, pos)) != want;
      }
    }
    (void)bad;  // format-1 checks against format-2 blocks: mismatches expected
  };

  // Copy a batch of rows (prefetched ahead), then hash the batch as delivered: the copy's misses
  // overlap each other instead of waiting behind the hash's arithmetic.
  auto gather_batched = [&](const char* base, size_t batch, bool fast, int pmode = 2, size_t lo = 0,
                            size_t hi = ~size_t(0), bool format2 = false, bool seeds_early = false) {
    hi = std::min(hi, k);
    constexpr size_t kAhead = 16;
    uint64_t bad = 0;
    std::vector<uint64_t> want(batch), seeds(batch);
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst0 = out.data() + size_t(l) * k * R;
      auto pf = [&](int64_t pos) {
        const char* blk = base + offs[uint64_t(pos) / T];
        const uint32_t t = uint32_t(uint64_t(pos) % T);
        const char* row = blk + g.row_off(l, t);
        if (pmode & 2)
          for (uint64_t o = 0; o < R; o += 64) __builtin_prefetch(row + o);
        if (pmode & 1) __builtin_prefetch(blk + g.hash_off(l, t));
      };
      for (size_t i = lo; i < std::min(hi, lo + kAhead); ++i) pf(ix[i]);
      for (size_t b0 = lo; b0 < hi; b0 += batch) {
        const size_t b1 = std::min(hi, b0 + batch);
        for (size_t i = b0; i < b1; ++i) {
          if (i + kAhead < hi) pf(ix[i + kAhead]);
          const uint64_t pos = uint64_t(ix[i]);
          const char* blk = base + offs[pos / T];
          const uint32_t t = uint32_t(pos % T);
          std::memcpy(dst0 + i * R, blk + g.row_off(l, t), R);
          std::memcpy(&want[i - b0], blk + g.hash_off(l, t), 8);
          if (seeds_early) seeds[i - b0] = row_seed(42, 0, l, pos);  // arithmetic beside the misses
        }
        for (size_t i = b0; i < b1; ++i) {
          const uint64_t seed = seeds_early ? seeds[i - b0] : row_seed(42, 0, l, uint64_t(ix[i]));
          const uint64_t h = format2 ? row_check(dst0 + i * R, R, seed)
                             : fast  ? row_check_v1(dst0 + i * R, R, seed)
                                     : row_check_sse2(dst0 + i * R, R, seed);
          bad += h != want[i - b0];
        }
      }
    }
    (void)bad;  // format-1 checks: see row_check_v1
  };

  // Software pipeline: prefetch row i + ahead, copy row i, hash row i - lag (still in L1).
  auto gather_lagged = [&](const char* base, size_t ahead, size_t lag, int hint) {
    uint64_t bad = 0;
    std::vector<uint64_t> want(k);
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst0 = out.data() + size_t(l) * k * R;
      auto pf = [&](int64_t pos) {
        const char* blk = base + offs[uint64_t(pos) / T];
        const uint32_t t = uint32_t(uint64_t(pos) % T);
        const char* row = blk + g.row_off(l, t);
        for (uint64_t o = 0; o < R; o += 64) {
          if (hint == 0)
            __builtin_prefetch(row + o, 0, 3);
          else
            __builtin_prefetch(row + o, 0, 2);
        }
        __builtin_prefetch(blk + g.hash_off(l, t));
      };
      if (ahead)
        for (size_t i = 0; i < std::min(k, ahead); ++i) pf(ix[i]);
      auto verify = [&](size_t i) {
        bad += row_check_v1(dst0 + i * R, R, row_seed(42, 0, l, uint64_t(ix[i]))) != want[i];
      };
      for (size_t i = 0; i < k; ++i) {
        if (ahead && i + ahead < k) pf(ix[i + ahead]);
        const uint64_t pos = uint64_t(ix[i]);
        const char* blk = base + offs[pos / T];
        const uint32_t t = uint32_t(pos % T);
        std::memcpy(dst0 + i * R, blk + g.row_off(l, t), R);
        std::memcpy(&want[i], blk + g.hash_off(l, t), 8);
        if (i >= lag) verify(i - lag);
      }
      for (size_t i = k > lag ? k - lag : 0; i < k; ++i) verify(i);
    }
    (void)bad;  // format-1 checks: see row_check_v1
  };

  // Batched, and while hashing batch b, prefetch batch b + 1 (row i of it beside hashed row i):
  // the hash's arithmetic then overlaps the next batch's misses. hint: 3 = L1, 2 = L2, 1 = L3.
  auto gather_overlap = [&](const char* base, size_t batch, int hint, size_t every, bool format2 = false) {
    uint64_t bad = 0;
    std::vector<uint64_t> want(batch);
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst0 = out.data() + size_t(l) * k * R;
      auto pf = [&](int64_t pos) {
        const char* blk = base + offs[uint64_t(pos) / T];
        const uint32_t t = uint32_t(uint64_t(pos) % T);
        const char* row = blk + g.row_off(l, t);
        for (uint64_t o = 0; o < R; o += 64) {
          if (hint == 3) __builtin_prefetch(row + o, 0, 3);
          if (hint == 2) __builtin_prefetch(row + o, 0, 2);
          if (hint == 1) __builtin_prefetch(row + o, 0, 1);
        }
        __builtin_prefetch(blk + g.hash_off(l, t), 0, 3);
      };
      for (size_t b0 = 0; b0 < k; b0 += batch) {
        const size_t b1 = std::min(k, b0 + batch);
        for (size_t i = b0; i < b1; ++i) {
          const uint64_t pos = uint64_t(ix[i]);
          const char* blk = base + offs[pos / T];
          const uint32_t t = uint32_t(pos % T);
          std::memcpy(dst0 + i * R, blk + g.row_off(l, t), R);
          std::memcpy(&want[i - b0], blk + g.hash_off(l, t), 8);
        }
        for (size_t i = b0; i < b1; ++i) {
          const size_t nxt = i + batch;
          if (hint && nxt < k && (i - b0) % every == 0)
            for (size_t e = 0; e < every && nxt + e < k; ++e) pf(ix[nxt + e]);
          const uint64_t seed = row_seed(42, 0, l, uint64_t(ix[i]));
          bad += (format2 ? row_check(dst0 + i * R, R, seed) : row_check_v1(dst0 + i * R, R, seed)) !=
                 want[i - b0];
        }
      }
    }
    if (bad && format2) std::printf("!! %lu rows failed\n", (unsigned long)bad);
  };

  // Format 2, one pass per row: read the stored check, then copy and check the row from the same
  // registers (copy_row_check). ahead > 0: the stored check of row i + ahead
  // is prefetched (its line is a miss of its own).
  auto gather_fused = [&](const char* base, size_t ahead, size_t rows_ahead = 0) {
    uint64_t bad = 0;
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst0 = out.data() + size_t(l) * k * R;
      for (size_t i = 0; i < k; ++i) {
        if (ahead && i + ahead < k) {
          const uint64_t p = uint64_t(ix[i + ahead]);
          __builtin_prefetch(base + offs[p / T] + g.hash_off(l, uint32_t(p % T)));
        }
        if (rows_ahead && i + rows_ahead < k) {  // the whole row, and its check, rows_ahead rows ahead
          const uint64_t p = uint64_t(ix[i + rows_ahead]);
          const char* row = base + offs[p / T] + g.row_off(l, uint32_t(p % T));
          for (uint64_t o = 0; o < R + 63; o += 64) __builtin_prefetch(row + std::min<uint64_t>(o, R - 1));
          __builtin_prefetch(base + offs[p / T] + g.hash_off(l, uint32_t(p % T)));
        }
        const uint64_t pos = uint64_t(ix[i]);
        const char* blk = base + offs[pos / T];
        const uint32_t t = uint32_t(pos % T);
        uint64_t want;
        std::memcpy(&want, blk + g.hash_off(l, t), 8);
        bad += copy_row_check(dst0 + i * R, blk + g.row_off(l, t), R, row_seed(42, 0, l, pos)) != want;
      }
    }
    if (bad) std::printf("!! %lu rows failed\n", (unsigned long)bad);
  };

  // Format 2, software-pipelined: memcpy row i (nothing but loads and stores in flight), then
  // check row i - lag from out (in L1 by then): the check's arithmetic of earlier rows fills the
  // time the later rows' misses take.
  auto gather_lagged2 = [&](const char* base, size_t lag) {
    uint64_t bad = 0;
    std::vector<uint64_t> want(k);
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst0 = out.data() + size_t(l) * k * R;
      auto verify = [&](size_t i) {
        bad += row_check(dst0 + i * R, R, row_seed(42, 0, l, uint64_t(ix[i]))) != want[i];
      };
      for (size_t i = 0; i < k; ++i) {
        const uint64_t pos = uint64_t(ix[i]);
        const char* blk = base + offs[pos / T];
        const uint32_t t = uint32_t(pos % T);
        std::memcpy(dst0 + i * R, blk + g.row_off(l, t), R);
        std::memcpy(&want[i], blk + g.hash_off(l, t), 8);
        if (i >= lag) verify(i - lag);
      }
      for (size_t i = k > lag ? k - lag : 0; i < k; ++i) verify(i);
    }
    if (bad) std::printf("!! %lu rows failed\n", (unsigned long)bad);
  };

  auto run = [&](const char* name, auto&& f) {
    double best_s = 0;
    double s = median_s(f, reps, &best_s);
    std::printf("%-52s %7.3f ms  %6.2f GB/s  (best %.3f ms)\n", name, s * 1e3, out_bytes / s / 1e9,
                best_s * 1e3);
    return s;
  };
  std::printf("row %u B, context %lu, %u layers, k %zu: %.1f MB gathered, pool %.0f MB\n", R,
              (unsigned long)ctx, L, k, out_bytes / 1e6, nb * bb / 1e6);
  run("packed memcpy (slice of context-sized buffer)",
      [&] { std::memcpy(out.data(), packed_rows.data() + (turn++ % slices) * out_bytes, out_bytes); });
  run("private packed rows, plain gather loop", [&] {
    for (uint32_t l = 0; l < L; ++l)
      for (size_t i = 0; i < k; ++i)
        std::memcpy(out.data() + (size_t(l) * k + i) * R,
                    packed_rows.data() + (uint64_t(l) * ctx + uint64_t(idx[size_t(l) * k + i])) * R, R);
  });
  run("shm: copy only", [&] { gather(shm, 0, false, 0); });
  run("shm: copy + read each row's stored check", [&] { gather(shm, 0, true, 0); });
  run("shm: format 1, batched 128 (the loop before)", [&] { gather_batched(shm, 128, true); });
  run("shm: format 2, one pass (copy_row_check)", [&] { gather_fused(shm, 0); });
  run("shm: format 2, one pass, check-line prefetch 8 ahead", [&] { gather_fused(shm, 8); });
  run("shm: format 2, batched 32, then checked (the loop now)",
      [&] { gather_batched(shm, 32, true, 2, 0, ~size_t(0), true); });
  run("shm: format 2, batched 32, seeds computed during the copies",
      [&] { gather_batched(shm, 32, true, 2, 0, ~size_t(0), true, true); });
  for (size_t b : {128})
    run(("shm: format 2, batched " + std::to_string(b) + ", then checked").c_str(),
        [&] { gather_batched(shm, b, true, 2, 0, ~size_t(0), true); });
  for (int hint : {2, 3})
    run(("shm: format 2, batched 32, next batch prefetched during checks, hint " + std::to_string(hint))
            .c_str(),
        [&] { gather_overlap(shm, 32, hint, 1, true); });
  for (size_t lag : {2, 8, 32})
    run(("shm: format 2, memcpy row i, check row i-" + std::to_string(lag)).c_str(),
        [&] { gather_lagged2(shm, lag); });
  for (size_t ra : {2, 4, 8})
    run(("shm: format 2, one pass, row prefetch " + std::to_string(ra) + " ahead").c_str(),
        [&] { gather_fused(shm, 0, ra); });
  run("hash only, format 1 row_check (out, L3-resident)", [&] {
    uint64_t x = 0;
    for (size_t i = 0; i < size_t(L) * k; ++i) x += row_check_v1(out.data() + i * R, R, i);
    if (x == 1) std::puts("");
  });
  run("hash only, format 2 row_check (out, L3-resident)", [&] {
    uint64_t x = 0;
    for (size_t i = 0; i < size_t(L) * k; ++i) x += row_check(out.data() + i * R, R, i);
    if (x == 1) std::puts("");
  });
  if (!all) {
    munmap(shm, nb * bb);
    return 0;
  }
  run("private blocks: copy only", [&] { gather(priv_blocks.data(), 0, false, 0); });
  run("shm: copy only", [&] { gather(shm, 0, false, 0); });
  run("shm: copy + row prefetch", [&] { gather(shm, 1, false, 0); });
  run("shm: copy + row prefetch + hash read", [&] { gather(shm, 1, true, 0); });
  run("shm: + hash-line prefetch", [&] { gather(shm, 3, true, 0); });
  run("shm: + row_check_sse2 (the loop before batching)", [&] { gather(shm, 1, true, 1); });
  run("shm: + row_check_sse2 + hash-line prefetch", [&] { gather(shm, 3, true, 1); });
  run("shm: + row_check + hash-line prefetch", [&] { gather(shm, 3, true, 2); });
  for (size_t b : {32, 128, 512}) {
    run(("shm: batched " + std::to_string(b) + ", row_check_sse2").c_str(),
        [&] { gather_batched(shm, b, false); });
    run(("shm: batched " + std::to_string(b) + ", row_check").c_str(), [&] { gather_batched(shm, b, true); });
  }
  for (size_t ahead : {0, 16})
    for (size_t lag : {4, 16})
      for (int hint : {0})
        run(("shm: lagged ahead " + std::to_string(ahead) + " lag " + std::to_string(lag) +
             (hint ? " L2" : " L1"))
                .c_str(),
            [&] { gather_lagged(shm, ahead, lag, hint); });
  for (int pm : {1, 3})
    for (size_t b : {128})
      run(("shm: batched " + std::to_string(b) + " pmode " + std::to_string(pm)).c_str(),
          [&] { gather_batched(shm, b, true, pm); });
  {
    // Two threads, each half the layers' rows (a persistent helper, as a real pool would keep).
    run("shm: batched 256, 2 threads (spawned per call)", [&] {
      std::thread th([&] { gather_batched(shm, 256, true, 1, k / 2, k); });
      gather_batched(shm, 256, true, 1, 0, k / 2);
      th.join();
    });
  }
  for (size_t b : {128})
    for (int hint : {1, 3})
      for (size_t every : {1})
        run(("shm: overlap batch " + std::to_string(b) + " hint " + std::to_string(hint) + " every " +
             std::to_string(every))
                .c_str(),
            [&] { gather_overlap(shm, b, hint, every); });
  run("shm: fused copy+hash (Checksum::update_copy)", [&] {
    constexpr size_t kAhead = 16;
    uint64_t bad = 0;
    for (uint32_t l = 0; l < L; ++l) {
      const int64_t* ix = idx.data() + size_t(l) * k;
      char* dst = out.data() + size_t(l) * k * R;
      auto pf = [&](int64_t pos) {
        const char* blk = shm + offs[uint64_t(pos) / T];
        const uint32_t t = uint32_t(uint64_t(pos) % T);
        for (uint64_t o = 0; o < R; o += 64) __builtin_prefetch(blk + g.row_off(l, t) + o);
        __builtin_prefetch(blk + g.hash_off(l, t));
      };
      for (size_t i = 0; i < std::min(k, kAhead); ++i) pf(ix[i]);
      for (size_t i = 0; i < k; ++i, dst += R) {
        if (i + kAhead < k) pf(ix[i + kAhead]);
        const uint64_t pos = uint64_t(ix[i]);
        const char* blk = shm + offs[pos / T];
        const uint32_t t = uint32_t(pos % T);
        Checksum c;
        c.update_copy(dst, blk + g.row_off(l, t), R);
        uint64_t want;
        std::memcpy(&want, blk + g.hash_off(l, t), 8);
        bad += check_mix(c.digest() ^ row_seed(42, 0, l, pos)) != want;
      }
    }
    (void)bad;  // format-1 checks: see row_check_v1
  });
  run("private blocks: verified, hash-line prefetch", [&] { gather(priv_blocks.data(), 3, true, 2); });
  run("hash only, row_check_sse2 (out, L3-resident)", [&] {
    // hash only: what hashing alone costs, out already in cache
    uint64_t x = 0;
    for (size_t i = 0; i < size_t(L) * k; ++i) x += row_check_sse2(out.data() + i * R, R, i);
    if (x == 1) std::puts("");
  });
  run("hash only, row_check_v1 (out, L3-resident)", [&] {
    uint64_t x = 0;
    for (size_t i = 0; i < size_t(L) * k; ++i) x += row_check_v1(out.data() + i * R, R, i);
    if (x == 1) std::puts("");
  });
  munmap(shm, nb * bb);
  return 0;
}
