#include "copy_kernels.h"

#include <atomic>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cxlkv::kernels {

namespace {
constexpr size_t kLine = 64;

#if defined(__x86_64__)
// Streams whole 64-byte lines; dst must be 64-byte aligned, n a multiple of 64.
__attribute__((target("avx512f"))) void stream_lines_avx512(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(s + i));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), v);
  }
}
__attribute__((target("avx2"))) void stream_lines_avx2(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
}
void stream_lines_sse2(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    for (size_t j = 0; j < 64; j += 16) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + j));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + j), v);
    }
  }
}
__attribute__((target("clwb"))) void wb_clwb(const char* p, const char* end) {
  for (; p < end; p += kLine) _mm_clwb(const_cast<char*>(p));
}
__attribute__((target("clflushopt"))) void wb_clflushopt(const char* p, const char* end) {
  for (; p < end; p += kLine) _mm_clflushopt(const_cast<char*>(p));
}
void wb_clflush(const char* p, const char* end) {
  for (; p < end; p += kLine) _mm_clflush(p);
}
#endif

using LineKernel = void (*)(char*, const char*, size_t);

LineKernel pick_line_kernel() {
#if defined(__x86_64__)
  const auto& f = cpu_features();
  if (f.avx512f) return stream_lines_avx512;
  if (f.avx2) return stream_lines_avx2;
  if (f.sse2) return stream_lines_sse2;
#endif
  return nullptr;
}
}  // namespace

void stream_copy(void* dst, const void* src, size_t n) {
  static const LineKernel kernel = pick_line_kernel();
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (!kernel || n < 256) {
    std::memcpy(d, s, n);
    return;
  }
  size_t head = (kLine - (reinterpret_cast<uintptr_t>(d) & (kLine - 1))) & (kLine - 1);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t body = n & ~(kLine - 1);
  kernel(d, s, body);
  std::memcpy(d + body, s + body, n - body);
}

void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_release);
#endif
}

void full_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

void writeback_lines_nofence(const void* p, size_t n) {
#if defined(__x86_64__)
  const char* b = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~(kLine - 1));
  const char* e = static_cast<const char*>(p) + n;
  const auto& f = cpu_features();
  if (f.clwb)
    wb_clwb(b, e);
  else if (f.clflushopt)
    wb_clflushopt(b, e);
  else
    wb_clflush(b, e);
#else
  (void)p, (void)n;
#endif
}

void writeback_lines(const void* p, size_t n) {
  writeback_lines_nofence(p, n);
#if defined(__x86_64__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

void flush_lines_sync(const void* p, size_t n) {
#if defined(__x86_64__)
  const char* b = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~(kLine - 1));
  const char* e = static_cast<const char*>(p) + n;
  wb_clflush(b, e);
  _mm_mfence();
#else
  (void)p, (void)n;
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

void evict_lines(const void* p, size_t n) {
#if defined(__x86_64__)
  const char* b = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~(kLine - 1));
  const char* e = static_cast<const char*>(p) + n;
  if (cpu_features().clflushopt)
    wb_clflushopt(b, e);
  else
    wb_clflush(b, e);
  _mm_mfence();
#else
  (void)p, (void)n;
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace cxlkv::kernels
