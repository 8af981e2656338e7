// Run-time selection of x86 extensions. The build never uses -march=native, so a wheel built on
// one machine runs on any x86-64; the fast paths are chosen here, once, from CPUID.
#pragma once

namespace cxlkv {

struct CpuFeatures {
  bool sse2 = false;
  bool avx2 = false;
  bool avx512f = false;
  bool avx512bw = false;    // byte-masked loads/stores (the fused copy+hash kernel's edges)
  bool avx512vbmi = false;  // two-register byte permute (its realignment to the hash's stripes)
  bool clflushopt = false;
  bool clwb = false;
};

const CpuFeatures& cpu_features();
// "avx512" / "avx2" / "sse2" / "portable": the streaming-store kernel in use.
const char* nt_copy_kernel_name();

}  // namespace cxlkv
