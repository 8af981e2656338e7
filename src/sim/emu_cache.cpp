// The non-coherent cache emulator (emu_cache.h).
#include "emu_cache.h"

#include <execinfo.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace cxlkv::sim {

using namespace format;

namespace {
inline uint64_t load_word(const char* p) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(const_cast<char*>(p)))
      .load(std::memory_order_relaxed);
}
inline void store_word(char* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(p)).store(v, std::memory_order_relaxed);
}
}  // namespace

Memory::Memory(std::vector<char> image, const PoolHeader& h) : bytes_(std::move(image)) {
  access_lo_ = h.access_off >> 6;
  access_hi_ = (h.access_off + h.index_slots * 8 + 63) >> 6;
  area_off_ = h.node_area_off, area_bytes_ = h.node_area_bytes, nodes_ = h.max_nodes;
  h_ = h;
  for (auto& x : holder) x.store(-1);
}

std::string Memory::region(uint64_t line) const {
  uint64_t off = line << 6;
  auto in = [&](uint64_t a, uint64_t n) { return off >= a && off < a + n; };
  const char* r = "payload";
  uint64_t base = 0;
  uint64_t stride = chunk_desc_bytes(h_.chunk_bytes) + h_.chunk_bytes;
  if (off < kSharedWordsOff)
    r = "header";
  else if (off < kLockAreaOff)
    r = "shared words", base = kSharedWordsOff;
  else if (off < h_.node_table_off)
    r = "lock area", base = kLockAreaOff;
  else if (off < h_.node_area_off)
    r = "node table", base = h_.node_table_off;
  else if (off < h_.ns_table_off)
    r = "node areas", base = h_.node_area_off;
  else if (off < h_.index_off)
    r = "namespace table", base = h_.ns_table_off;
  else if (in(h_.index_off, h_.index_slots * 64))
    r = "index", base = h_.index_off;
  else if (off < h_.chunk_map_off)
    r = "access hints", base = h_.access_off;
  else if (off < h_.arena_off)
    r = "chunk map", base = h_.chunk_map_off;
  else if ((off - h_.arena_off) % stride < chunk_desc_bytes(h_.chunk_bytes))
    r = "block descs", base = h_.arena_off;
  else
    base = h_.arena_off;
  return std::string(r) + " +" + std::to_string(off - base);
}

void Memory::report(const std::string& what) {
  std::lock_guard<std::mutex> g(reports_mu);
  if (reports.size() < 6) reports.push_back(what);
}

bool Memory::payload(uint64_t line) const {
  uint64_t off = line << 6;
  if (off < h_.arena_off) return false;
  uint64_t stride = chunk_desc_bytes(h_.chunk_bytes) + h_.chunk_bytes;
  return (off - h_.arena_off) % stride >= chunk_desc_bytes(h_.chunk_bytes);
}

bool Memory::excluded(uint64_t line) const {
  if (line >= access_lo_ && line < access_hi_) return true;
  uint64_t off = line << 6;
  if (off < area_off_ || off >= area_off_ + area_bytes_ * nodes_) return false;
  uint64_t in = (off - area_off_) % area_bytes_;
  return in >= offsetof(NodeAreaFixed, counters) && in < sizeof(NodeAreaFixed);
}

// The host's second thread: runs `fn` once per step() while the stepping thread waits, so the
// two never run at once (the mutex hands the private cache over, with happens-before).
struct EmuCache::Chores {
  std::mutex mu;
  std::condition_variable cv;
  bool go = false, quit = false;
  std::function<void()> fn;
  std::thread thread{[this] { loop(); }};  // last: the fields above exist before it starts

  void loop() {
    std::unique_lock<std::mutex> g(mu);
    for (;;) {
      cv.wait(g, [&] { return go || quit; });
      if (quit) return;
      if (fn) fn();  // the stepping thread waits for `go` to fall, under this mutex
      go = false;
      cv.notify_all();
    }
  }
  void step() {
    std::unique_lock<std::mutex> g(mu);
    go = true;
    cv.notify_all();
    cv.wait(g, [&] { return !go; });
  }
  ~Chores() {
    {
      std::lock_guard<std::mutex> g(mu);
      quit = true;
    }
    cv.notify_all();
    thread.join();
  }
};

EmuCache::EmuCache(Memory& m, int host, uint64_t seed, const EmuConfig& cfg)
    : m_(m), host_(host), cfg_(cfg), priv_(m.size()), clean_(m.size()), rng_(seed) {
  reboot();
}

EmuCache::~EmuCache() = default;

void EmuCache::set_chores(std::function<void()> fn, uint64_t interval_ns) {
  if (!fn && !chores_) return;
  if (!chores_) chores_ = std::make_unique<Chores>();
  std::lock_guard<std::mutex> g(chores_->mu);
  chores_->fn = std::move(fn);
  chores_interval_ns_ = interval_ns;
}

void EmuCache::run_chores() {
  in_tick_ = true;  // the chores' own coherence points neither beat nor step again
  struct Reset {
    bool& b;
    ~Reset() { b = false; }
  } reset{in_tick_};
  ++chore_runs_;
  chores_->step();
}

void EmuCache::reboot() {
  crashed_ = crash_armed_ = false;
  fault_armed_.clear();
  force_crash_.store(false, std::memory_order_relaxed);
  ticker_ = nullptr;
  set_chores(nullptr, 0);
  pause_ms_ = 0;
  for (uint64_t l = 0; l < priv_.size() / 64; ++l) fetch_line(l);
}

bool EmuCache::dirty(uint64_t line) const {
  return std::memcmp(priv_.data() + line * 64, clean_.data() + line * 64, 64) != 0;
}

void EmuCache::fetch_line(uint64_t line) {
  std::lock_guard<std::mutex> g(m_.line_mu(line));
  const char* src = m_.bytes() + line * 64;
  for (int w = 0; w < 8; ++w) {
    uint64_t v = load_word(src + w * 8);
    std::memcpy(priv_.data() + line * 64 + w * 8, &v, 8);
  }
  std::memcpy(clean_.data() + line * 64, priv_.data() + line * 64, 64);
}

void EmuCache::wb_line(uint64_t line) {
  std::lock_guard<std::mutex> g(m_.line_mu(line));
  char* dst = m_.bytes() + line * 64;
  const char* pv = priv_.data() + line * 64;
  const char* cl = clean_.data() + line * 64;
  bool clobbered = false;
  for (int w = 0; w < 8; ++w) {
    uint64_t mem = load_word(dst + w * 8), c, p;
    std::memcpy(&c, cl + w * 8, 8);
    std::memcpy(&p, pv + w * 8, 8);
    // Another host changed this word since we fetched the line, and we put another value back.
    if (mem != c && mem != p) clobbered = true;
    store_word(dst + w * 8, p);
  }
  if (clobbered && !m_.excluded(line) && !m_.payload(line)) {
    m_.counters.lost_update.fetch_add(1, std::memory_order_relaxed);
    m_.report("lost update by host " + std::to_string(host_) + " at " + m_.region(line));
    if (std::getenv("CXLKV_SIM_TRACE")) {
      void* bt[32];
      int n = backtrace(bt, 32);
      backtrace_symbols_fd(bt, n, 2);
    }
  }
  std::memcpy(clean_.data() + line * 64, pv, 64);
  m_.counters.writebacks.fetch_add(1, std::memory_order_relaxed);
}

void EmuCache::note(uint64_t line) { recent_[recent_n_++ % recent_.size()] = line; }

uint64_t EmuCache::dirty_checked_lines() {
  uint64_t n = 0;
  for (uint64_t l = 0; l < priv_.size() / 64; ++l)
    if (!m_.excluded(l) && dirty(l)) ++n;
  return n;
}

void EmuCache::resolve_dirty_lines() {
  for (uint64_t l = 0; l < priv_.size() / 64; ++l) {
    if (!dirty(l)) continue;
    if (rng_() & 1)
      wb_line(l);
    else
      fetch_line(l);
  }
}

void EmuCache::at_point(const void* p, size_t n) {
  uint64_t first = line_of(p), last = line_of(static_cast<const char*>(p) + (n ? n - 1 : 0));
  for (uint64_t l = first; l <= last && l < first + 4; ++l) note(l);
  std::uniform_real_distribution<double> u(0, 1);
  if ((crash_armed_ && u(rng_) < 0.3) || force_crash_.load(std::memory_order_relaxed)) {
    // The host stops here: what its cache held reaches memory or not, line by line.
    crash_armed_ = false;
    resolve_dirty_lines();
    crashed_ = true;
    throw HostCrashed{};
  }
  if (pause_ms_ && u(rng_) < 0.3) {
    // A pause past the lease (a VM stall, SIGSTOP). Only where no checked line is dirty: the
    // protocol's stated assumption is that no pause falls between a store and its write-back.
    if (dirty_checked_lines() == 0) {
      // Cut short by force_crash(): the end of a run must not wait out a pause of a long lease.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(pause_ms_);
      while (std::chrono::steady_clock::now() < until && !force_crash_.load(std::memory_order_relaxed))
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      pause_ms_ = 0;
      ++pauses_;
    } else {
      m_.counters.pause_deferred.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (u(rng_) < cfg_.p_evict) {
    uint64_t lines = priv_.size() / 64;
    uint64_t l = (recent_n_ && u(rng_) < 0.7)
                     ? recent_[rng_() % std::min<uint64_t>(recent_n_, recent_.size())]
                     : rng_() % lines;
    if (l < lines) {
      if (dirty(l))
        wb_line(l);
      else
        fetch_line(l);
      m_.counters.evictions.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (u(rng_) < cfg_.p_yield) std::this_thread::yield();
  if (ticker_ && !in_tick_) {
    uint64_t now = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    if (now - last_tick_ns_ > tick_interval_ns_) {
      last_tick_ns_ = now;
      in_tick_ = true;
      struct Reset {
        bool& b;
        ~Reset() { b = false; }
      } reset{in_tick_};
      ticker_();
    }
  }
  // After the beat, as a heartbeat thread does: the chores (row healing), on the host's chores
  // thread while this one waits here, whatever it holds (a stripe, tier 1, its ticket).
  if (chores_ && chores_interval_ns_ && !in_tick_) {
    uint64_t now = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    if (now - last_chores_ns_ > chores_interval_ns_) {
      last_chores_ns_ = now;
      run_chores();
      if (crashed_) throw HostCrashed{};  // the host crashed inside its chores
    }
  }
}

void EmuCache::writeback(const void* p, size_t n, bool point) {
  if (crashed_) throw HostCrashed{};
  if (point) at_point(p, n);
  if (cfg_.sw.no_flush) return;
  uint64_t first = line_of(p), last = line_of(static_cast<const char*>(p) + (n ? n - 1 : 0));
  for (uint64_t l = first; l <= last && l < priv_.size() / 64; ++l)
    if (dirty(l)) wb_line(l);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void EmuCache::invalidate(const void* p, size_t n, bool point) {
  if (crashed_) throw HostCrashed{};
  if (point) at_point(p, n);
  if (cfg_.sw.no_invalidate) return;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  uint64_t first = line_of(p), last = line_of(static_cast<const char*>(p) + (n ? n - 1 : 0));
  for (uint64_t l = first; l <= last && l < priv_.size() / 64; ++l) {
    if (dirty(l) && !m_.excluded(l)) {
      m_.counters.invalidate_dirty.fetch_add(1, std::memory_order_relaxed);
      m_.report("dirty line dropped by host " + std::to_string(host_) + " at " + m_.region(l));
      if (std::getenv("CXLKV_SIM_TRACE")) {
        void* bt[32];
        int n = backtrace(bt, 32);
        backtrace_symbols_fd(bt, n, 2);
      }
    }
    fetch_line(l);
  }
}

void EmuCache::streamed(const void* p, size_t n) {
  if (crashed_) throw HostCrashed{};
  // Non-temporal stores are in flight already: they reach memory whatever happens next (the point
  // comes after them), and only the bytes written, never a stale rest of a cached line.
  uint64_t first = line_of(p), last = line_of(static_cast<const char*>(p) + (n ? n - 1 : 0));
  for (uint64_t l = first; l <= last && l < priv_.size() / 64; ++l) {
    std::lock_guard<std::mutex> g(m_.line_mu(l));
    char* dst = m_.bytes() + l * 64;
    for (int w = 0; w < 8; ++w) {
      uint64_t v;
      std::memcpy(&v, priv_.data() + l * 64 + w * 8, 8);
      store_word(dst + w * 8, v);
    }
    std::memcpy(clean_.data() + l * 64, priv_.data() + l * 64, 64);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  at_point(p, n);
}

void EmuCache::lock_entered(uint32_t k, const void* own_line) {
  int prev = m_.holder[k].exchange(host_);
  if (prev != -1) {
    m_.counters.lock_overlap.fetch_add(1, std::memory_order_relaxed);
    m_.report("lock overlap: hosts " + std::to_string(prev) + " and " + std::to_string(host_) +
              " in stripe " + std::to_string(k));
  }
  // The bakery's promise to the other hosts: while we are inside, memory shows our ticket (they
  // read our row there). A ticket number of 0 lets any of them in beside us.
  const uint64_t l = line_of(own_line);
  uint64_t number;
  {
    std::lock_guard<std::mutex> g(m_.line_mu(l));
    number = load_word(m_.bytes() + l * 64 + offsetof(LockLine, number));
  }
  if (number == 0) {
    m_.counters.lost_ticket.fetch_add(1, std::memory_order_relaxed);
    m_.report("lost ticket: host " + std::to_string(host_) + " inside stripe " + std::to_string(k) +
              " while memory shows its row empty");
  }
  std::uniform_real_distribution<double> u(0, 1);
  if (u(rng_) < cfg_.p_cs_yield) std::this_thread::yield();  // widen the section: overlaps show
}

void EmuCache::fault_point(const char* name) {
  if (crashed_) throw HostCrashed{};
  if (fault_armed_.empty() || fault_armed_ != name) return;
  fault_armed_.clear();
  resolve_dirty_lines();
  crashed_ = true;
  ++fault_crashes_;
  throw HostCrashed{};
}

void EmuCache::lock_left(uint32_t k) {
  int me = host_;
  m_.holder[k].compare_exchange_strong(me, -1);
}

}  // namespace cxlkv::sim
