// Where a one-thread pool store's time goes against glibc's memcpy (issue 16 item 3): the core's
// fused copy+checksum (Checksum::update_copy) gathering 64 fragments of 32 KiB per 2 MiB block,
// with and without the next-fragment hint, against one memcpy of the same bytes and the same
// gather done by memcpy. Private anonymous memory with MADV_HUGEPAGE on both sides, so only the
// loop differs. Usage: copy_micro [MiB=1024] [repeats=7] (scripts/bench_copy_micro.sh builds it).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "checksum.h"
#include "copy_kernels.h"

namespace {
constexpr size_t kFragment = 32 << 10, kFragments = 64, kBlock = kFragment * kFragments;
constexpr size_t kHuge = 2 << 20;

char* huge_buffer(size_t n) {
  void* p = mmap(nullptr, n + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  char* a = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~uintptr_t(kHuge - 1));
  madvise(a, n, MADV_HUGEPAGE);
  std::memset(a, 1, n);  // fault every page in now
  return a;
}

volatile uint64_t g_sink;
}  // namespace

int main(int argc, char** argv) {
  const size_t n = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024) << 20;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 7;
  const size_t blocks = n / kBlock;
  char* src = huge_buffer(n);  // layer-major, as a paged KV cache: fragment f of block b at f*blocks+b
  char* dst = huge_buffer(n);  // pool-like: block b's fragments back to back
  for (size_t i = 0; i < n; i += 8) *reinterpret_cast<uint64_t*>(src + i) = i * 0x9E3779B97F4A7C15ull;
  auto frag = [&](size_t b, size_t f) { return src + (f * blocks + b) * kFragment; };

  auto fused = [&](bool hint) {
    for (size_t b = 0; b < blocks; ++b) {
      cxlkv::Checksum c;
      for (size_t f = 0; f < kFragments; ++f) {
        const bool more = f + 1 < kFragments;
        c.update_copy(dst + b * kBlock + f * kFragment, frag(b, f), kFragment,
                      hint && more ? frag(b, f + 1) : nullptr, hint && more ? kFragment : 0);
      }
      g_sink = c.digest();
    }
    cxlkv::kernels::store_fence();
  };
  struct Variant {
    const char* name;
    std::function<void()> run;
  };
  const std::vector<Variant> variants = {
      {"memcpy, one contiguous copy", [&] { std::memcpy(dst, src, n); }},
      {"memcpy per fragment (gather)",
       [&] {
         for (size_t b = 0; b < blocks; ++b)
           for (size_t f = 0; f < kFragments; ++f)
             std::memcpy(dst + b * kBlock + f * kFragment, frag(b, f), kFragment);
       }},
      {"update_copy, no hint", [&] { fused(false); }},
      {"update_copy, next-fragment hint", [&] { fused(true); }},
  };
  std::vector<std::vector<double>> gbps(variants.size());
  for (int r = 0; r < repeats; ++r)  // interleaved, so drift hits every variant alike
    for (size_t v = 0; v < variants.size(); ++v) {
      const auto t0 = std::chrono::steady_clock::now();
      variants[v].run();
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      gbps[v].push_back(double(n) / dt.count() / 1e9);
    }
  std::printf("%zu MiB, %zu blocks of 64 x 32 KiB, medians of %d, copy kernel %s\n", n >> 20, blocks, repeats,
              cxlkv::checksum_copy_kernel_name());
  double base = 0;
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(gbps[v].begin(), gbps[v].end());
    const double med = gbps[v][gbps[v].size() / 2];
    if (v == 0) base = med;
    std::printf("  %-34s %6.2f GB/s  %.2fx memcpy\n", variants[v].name, med, med / base);
  }
}
