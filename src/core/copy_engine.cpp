// Copy engine: gather per-layer KV fragments of a paged KV cache into one contiguous pool block,
// and scatter them back. A block's fragments are described generically (base, block stride,
// bytes), which covers vLLM's CUDA layout ([2, num_blocks, ...] per layer: two fragments per
// layer) and its CPU layout ([num_blocks, ...]: one per layer) alike. Large batches are split
// over a few threads (spawned per batch: ~30 us, against >= 4 MiB of copying); stores use
// streaming stores (see Coherence).
#include <algorithm>
#include <condition_variable>
#include <functional>
#include <thread>

#include "pool.h"

namespace cxlkv {

namespace {
constexpr uint64_t kParallelBytes = 4ull << 20;  // below this a batch runs on the calling thread

class Workers {
 public:
  static Workers& get() {
    static Workers w;
    return w;
  }
  unsigned size() const { return threads_; }
  void set_size(unsigned n) { threads_ = std::max(1u, n); }
  // Runs fn(part) for part in [0, parts) on up to `parts` threads, the caller included.
  void run(unsigned parts, const std::function<void(unsigned)>& fn) {
    if (parts <= 1) { fn(0); return; }
    std::vector<std::thread> ts;
    ts.reserve(parts - 1);
    for (unsigned p = 1; p < parts; ++p) ts.emplace_back(fn, p);
    fn(0);
    for (auto& t : ts) t.join();
  }

 private:
  Workers() {
    unsigned hw = std::thread::hardware_concurrency();
    threads_ = std::min(8u, hw ? hw : 1u);
    if (const char* e = std::getenv("CXLKV_COPY_THREADS")) threads_ = std::max(1, std::atoi(e));
  }
  unsigned threads_;
};

// Runs op(i) -> bool for each key, in parallel for large batches; returns leading successes.
size_t run_batch(size_t n, uint64_t block_bytes, const std::function<bool(size_t)>& op) {
  AccessStamp outer;  // one access time for the whole batch, on every thread
  const uint64_t stamp = AccessStamp::current();
  std::vector<uint8_t> ok(n, 0);
  unsigned parts = 1;
  if (n > 1 && n * block_bytes >= kParallelBytes)
    parts = unsigned(std::min<size_t>(Workers::get().size(), n));
  std::exception_ptr err;
  std::mutex err_mu;
  Workers::get().run(parts, [&](unsigned p) {
    AccessStamp same(stamp);
    size_t lo = n * p / parts, hi = n * (p + 1) / parts;
    try {
      for (size_t i = lo; i < hi; ++i) ok[i] = op(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(err_mu);
      err = std::current_exception();
    }
  });
  if (err) std::rethrow_exception(err);
  size_t lead = 0;
  while (lead < n && ok[lead]) ++lead;
  return lead;
}

std::vector<Piece> pieces_for(const std::vector<Fragment>& frags, int64_t block_id) {
  std::vector<Piece> p;
  p.reserve(frags.size());
  for (const auto& f : frags)
    p.push_back(Piece{reinterpret_cast<char*>(f.base + block_id * f.block_stride), f.bytes});
  return p;
}

void check_fragments(const NsHandle& ns, const std::vector<Fragment>& frags) {
  uint64_t total = 0;
  for (const auto& f : frags) total += f.bytes;
  if (total != ns.block_bytes)
    throw ArgumentError("fragments add up to " + std::to_string(total) + " bytes per block, the namespace '" +
                        ns.name + "' stores blocks of " + std::to_string(ns.block_bytes) + " bytes");
}
}  // namespace

void Pool::set_copy_threads(unsigned n) { Workers::get().set_size(n); }

size_t Pool::store(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
                   const int64_t* block_ids, uint32_t start_depth) {
  check_fragments(ns, frags);
  return run_batch(n, ns.block_bytes, [&](size_t i) {
    auto p = pieces_for(frags, block_ids[i]);
    return put(ns, keys[i], p.data(), p.size(), uint16_t(std::min<size_t>(start_depth + i, 0xFFFF)));
  });
}

size_t Pool::load(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
                  const int64_t* block_ids) {
  check_fragments(ns, frags);
  return run_batch(n, ns.block_bytes, [&](size_t i) {
    auto p = pieces_for(frags, block_ids[i]);
    return get(ns, keys[i], p.data(), p.size(), nullptr);
  });
}

}  // namespace cxlkv
