// Copy engine: gather per-layer KV fragments of a paged KV cache into one contiguous pool block,
// and scatter them back. A block's fragments are described generically (base, block stride,
// bytes), which covers vLLM's CUDA layout ([2, num_blocks, ...] per layer: two fragments per
// layer) and its CPU layout ([num_blocks, ...]: one per layer) alike. Large batches are split
// over a few threads of a persistent pool; stores use streaming stores (see Coherence).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "copy_threads.h"
#include "errors.h"

namespace cxlkv {

namespace {
constexpr uint64_t kParallelBytes = 4ull << 20;  // below this a batch runs on the calling thread

// Copy threads: a persistent pool (started on first use, grown to threads_ - 1 workers), so a
// batch does not pay a thread start-up (~30-60 us on a VM) for each of its parts: that is 1-2% of
// a 4 MiB batch copied by two threads, and it was paid on every store and load. One batch at a
// time uses the pool; a concurrent batch of another caller thread, or any batch in a forked child
// (the workers did not survive the fork), starts its own threads as before.
class Workers {
 public:
  static Workers& get() {
    static Workers* w = new Workers;  // never destroyed: workers may be parked in wait() at exit
    return *w;
  }
  unsigned size() const { return threads_.load(std::memory_order_relaxed); }
  void set_size(unsigned n) { threads_.store(std::max(1u, n), std::memory_order_relaxed); }
  // Runs fn(part) for part in [0, parts) on up to `parts` threads, the caller included. fn must
  // not throw (run_batch catches inside it).
  void run(unsigned parts, const std::function<void(unsigned)>& fn) {
    if (parts <= 1) {
      fn(0);
      return;
    }
    std::unique_lock<std::mutex> batch(batch_mu_, std::defer_lock);
    if (::getpid() != pid_ || !batch.try_lock()) {
      spawn(parts, fn);
      return;
    }
    uint64_t gen;
    {
      std::lock_guard<std::mutex> g(mu_);
      while (workers_.size() + 1 < parts) workers_.emplace_back([this] { work(); });
      gen = ++gen_;
      job_ = &fn;
      parts_ = parts;
      left_ = parts;
      next_.store(gen << 32, std::memory_order_release);
    }
    cv_work_.notify_all();
    do_parts(gen, parts, &fn);
    std::unique_lock<std::mutex> l(mu_);
    cv_done_.wait(l, [&] { return left_ == 0; });
  }

 private:
  Workers() : pid_(::getpid()) {
    unsigned hw = std::thread::hardware_concurrency();
    unsigned n = std::min(8u, hw ? hw : 1u);
    if (const char* e = std::getenv("CXLKV_COPY_THREADS")) n = unsigned(std::max(1, std::atoi(e)));
    threads_.store(n);
  }
  static void spawn(unsigned parts, const std::function<void(unsigned)>& fn) {
    std::vector<std::thread> ts;
    ts.reserve(parts - 1);
    for (unsigned p = 1; p < parts; ++p) ts.emplace_back(fn, p);
    fn(0);
    for (auto& t : ts) t.join();
  }
  // Claims parts of batch `gen` ([gen : 32][next part : 32], so a worker that wakes late never
  // claims a part of a later batch with the earlier batch's fn) and runs them.
  void do_parts(uint64_t gen, unsigned parts, const std::function<void(unsigned)>* fn) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      if ((v >> 32) != gen || uint32_t(v) >= parts) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      (*fn)(uint32_t(v));
      std::lock_guard<std::mutex> g(mu_);
      if (--left_ == 0) cv_done_.notify_one();
    }
  }
  void work() {
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> l(mu_);
      cv_work_.wait(l, [&] { return gen_ != seen; });
      seen = gen_;
      const std::function<void(unsigned)>* fn = job_;
      unsigned parts = parts_;
      l.unlock();
      do_parts(seen, parts, fn);
    }
  }

  const pid_t pid_;
  std::atomic<unsigned> threads_{1};
  std::mutex batch_mu_;  // held by the one batch that uses the pool
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::vector<std::thread> workers_;
  uint64_t gen_ = 0;
  const std::function<void(unsigned)>* job_ = nullptr;
  unsigned parts_ = 0, left_ = 0;
  std::atomic<uint64_t> next_{0};
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

void set_copy_threads(unsigned n) { Workers::get().set_size(n); }

unsigned copy_thread_count() { return Workers::get().size(); }

void run_on_copy_threads(unsigned parts, const std::function<void(unsigned)>& fn) {
  Workers::get().run(parts, fn);
}

size_t store_blocks(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
                    const int64_t* block_ids, uint32_t start_depth, const PutBlock& put) {
  check_fragments(ns, frags);
  return run_batch(n, ns.block_bytes, [&](size_t i) {
    auto p = pieces_for(frags, block_ids[i]);
    return put(keys[i], p.data(), p.size(), uint16_t(std::min<size_t>(start_depth + i, 0xFFFF)));
  });
}

size_t load_blocks(const NsHandle& ns, const Key* keys, size_t n, const std::vector<Fragment>& frags,
                   const int64_t* block_ids, const GetBlock& get) {
  check_fragments(ns, frags);
  return run_batch(n, ns.block_bytes, [&](size_t i) {
    auto p = pieces_for(frags, block_ids[i]);
    // An entry shorter than the namespace's blocks (a put of fewer bytes: a stray or foreign
    // writer) would fill only the front of the block and leave the rest as it was: a miss.
    uint64_t len = 0;
    return get(keys[i], p.data(), p.size(), &len) && len == ns.block_bytes;
  });
}

}  // namespace cxlkv
