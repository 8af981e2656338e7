#include "cpu_features.h"

#include <cstdlib>
#include <cstring>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace cxlkv {

static CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  f.sse2 = true;  // baseline of x86-64
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.clflushopt = (b >> 23) & 1;
    f.clwb = (b >> 24) & 1;
  }
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vbmi = __builtin_cpu_supports("avx512vbmi");
#endif
  // CXLKV_CPU=portable|sse2|avx2 caps the kernels (to test fallbacks on a big machine).
  if (const char* cap = std::getenv("CXLKV_CPU")) {
    if (!std::strcmp(cap, "portable")) f = CpuFeatures{};
    if (!std::strcmp(cap, "sse2")) f.avx2 = f.avx512f = f.avx512bw = f.avx512vbmi = false;
    if (!std::strcmp(cap, "avx2")) f.avx512f = f.avx512bw = f.avx512vbmi = false;
  }
  return f;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const char* nt_copy_kernel_name() {
  const auto& f = cpu_features();
  if (f.avx512f) return "avx512";
  if (f.avx2) return "avx2";
  if (f.sse2) return "sse2";
  return "portable";
}

}  // namespace cxlkv
