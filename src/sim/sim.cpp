// The simulation and its checker (sim.h).
#include "sim.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "emu_cache.h"
#include "layout.h"
#include "pool.h"

namespace cxlkv::sim {

namespace {

using Clock = std::chrono::steady_clock;
using format::PoolHeader;
constexpr uint32_t kKeys = 256;  // keys of the main namespace
constexpr uint64_t kBlockBytes = 1024;
// The time budget of a run (SimOptions::seconds is the whole of it):
constexpr double kStopSeconds = 0.5;      // hosts finish their operation; stragglers are crashed
constexpr double kJoinSeconds = 0.15;     // ...and then end: a crashed straggler at its next call
constexpr double kCheckSeconds = 0.25;    // the final check itself, after its lease wait
constexpr double kMinWorkSeconds = 0.25;  // less workload than this proves nothing: refused
// Rows of the lock area past the hosts' own (0..hosts-1): one per attempt of the final checker,
// then the pool creator's. The creator's node can outlive its close (fenced: make_image), and a
// live node of another host id on the checker's row refuses the checker's attach.
constexpr int kCheckAttempts = 4;
constexpr int kCreatorRow = kCheckAttempts;  // past the hosts' rows

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

Key make_key(uint32_t ns_tag, uint32_t k, uint64_t v) {
  Key key{};
  std::memcpy(key.data(), "SIMK", 4);
  std::memcpy(key.data() + 4, &ns_tag, 4);
  std::memcpy(key.data() + 8, &k, 4);
  std::memcpy(key.data() + 12, &v, 8);
  return key;
}

// The payload of (ns, k, v): its length and bytes follow from the triple alone.
std::vector<char> payload(uint32_t ns_tag, uint32_t k, uint64_t v, uint64_t block_bytes) {
  uint64_t seed = mix((uint64_t(ns_tag) << 48) ^ (uint64_t(k) << 32) ^ v);
  uint64_t len = 64 + seed % (block_bytes - 63);
  std::vector<char> out(len);
  uint64_t s = seed;
  for (uint64_t i = 0; i < len; i += 8) {
    s = mix(s);
    std::memcpy(out.data() + i, &s, std::min<uint64_t>(8, len - i));
  }
  return out;
}

// What the checker knows of one key of the main namespace (its own bookkeeping, coherent).
struct KeyState {
  std::mutex mu;
  uint64_t cur_v = 0;                    // puts use this version
  uint32_t inflight = 0;                 // puts running now (any version)
  uint64_t last_put_end = 0;             // seq at which the last put returned
  std::map<uint64_t, uint64_t> removed;  // version -> seq at which its removal began
};

struct Shared {
  SimOptions o;
  std::unique_ptr<Memory> mem;
  EmuConfig cfg;
  std::vector<KeyState> keys{kKeys};
  std::atomic<uint64_t> seq{1};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ops{0}, verified{0}, misses{0}, crashes{0}, fenced{0}, attaches{0}, other{0},
      skips{0};
  std::atomic<uint64_t> wrong_payload{0}, stale_read{0}, healed{0}, observer_writes{0};
  std::mutex notes_mu;
  std::vector<std::string> notes;
  std::vector<std::unique_ptr<EmuCache>> caches;
  std::unique_ptr<std::atomic<bool>[]> done;
  void note(const std::string& s) {
    std::lock_guard<std::mutex> g(notes_mu);
    if (notes.size() < 8) notes.push_back(s);
  }
};

Layout main_layout() {
  Layout l;
  l.name = "sim";
  l.model_id = "sim-model";
  l.block_bytes = kBlockBytes;
  return l;
}
Layout aux_layout(uint32_t i) {
  Layout l;
  l.name = "aux-" + std::to_string(i);
  l.model_id = "sim-aux";
  l.block_bytes = 512u << i;
  return l;
}

// The emulated host's heartbeat chore, as a real attachment's heartbeat thread runs it after each
// beat: heal its own lock row (run on the host's chores thread, EmuCache::set_chores). A crash
// or fence inside it shows at the host's next coherence call.
std::function<void()> heal_chore(Shared& S, Pool* p) {
  return [&S, p] {
    try {
      S.healed += p->heal_lock_row();
    } catch (...) {
    }
  };
}

void host_loop(Shared& S, int h);
void host_main(Shared& S, int h) {
  host_loop(S, h);
  S.done[h].store(true);
}

void host_loop(Shared& S, int h) {
  EmuCache& cache = *S.caches[h];
  std::mt19937_64 rng(mix(S.o.seed * 1000003 + uint64_t(h)));
  std::uniform_real_distribution<double> u(0, 1);
  std::unique_ptr<Pool> pool;
  // The host's observer (`pool check`/`reap` of an admin on this host): opened without a node
  // slot or a row (RowLessArbiter), it reaps the dead; its first reclaim makes it a writer
  // (become_writer) on the host's row beside `pool`: a host-mate sharing the row's tier-1 words.
  std::unique_ptr<Pool> obs;
  bool obs_writer = false;
  NsHandle ns, aux[3];
  bool have_aux[3] = {};
  const uint64_t lease_ns = uint64_t(S.o.lease_ms) * 1'000'000;
  uint64_t last_beat = 0, last_reap = 0;
  auto now_ns = [] { return uint64_t(Clock::now().time_since_epoch().count()); };
  // Both attachments of the host beat and heal, as each one's heartbeat thread would.
  auto rearm = [&] {
    Pool* p = pool.get();
    Pool* q = obs.get();
    cache.set_ticker(
        [p, q] {
          if (p) p->heartbeat_tick();
          if (q) q->heartbeat_tick();
        },
        lease_ns / 8);
    auto heal_p = p ? heal_chore(S, p) : nullptr, heal_q = q ? heal_chore(S, q) : nullptr;
    cache.set_chores(
        [heal_p, heal_q] {
          if (heal_p) heal_p();
          if (heal_q) heal_q();
        },
        lease_ns / 8);
  };
  auto drop_obs = [&] {
    if (!obs) return;
    cache.set_ticker(nullptr, 0);
    cache.set_chores(nullptr, 0);
    obs->abandon();
    obs.reset();
    obs_writer = false;
    if (pool) rearm();
  };
  auto drop_pool = [&] {
    drop_obs();  // a crash takes the whole host
    cache.set_ticker(nullptr, 0);
    cache.set_chores(nullptr, 0);
    if (pool) {
      if (pool->bakery()) S.skips += pool->bakery()->skipped();
      pool->abandon();
      pool.reset();
    }
    for (bool& a : have_aux) a = false;
  };

  // Host h's view of the emulated memory: its worker and its row-less observer attach through it.
  auto this_host = [&] {
    EmulatedHost eh;
    eh.base = cache.base();
    eh.size = S.mem->size();
    eh.model = &cache;
    eh.host_id = mix(0xC0FFEE + uint64_t(h)) | 1;
    eh.host_slot = h;
    return eh;
  };

  while (!S.stop.load(std::memory_order_relaxed)) {
    try {
      if (!pool) {
        EmulatedHost eh = this_host();
        cache.set_ticker(nullptr, 0);
        pool = Pool::open_emulated(eh);
        rearm();
        ++S.attaches;
        ns = pool->open_namespace(main_layout());
        last_beat = now_ns();
      }
      if (!obs) {
        EmulatedHost eh = this_host();
        obs = Pool::open_emulated(eh, /*attach=*/false);
        rearm();
      }
      uint64_t t = now_ns();
      if (t - last_beat > lease_ns / 8) {
        pool->heartbeat_tick();
        obs->heartbeat_tick();
        last_beat = t;
      }
      if (t - last_reap > lease_ns / 2) {
        try {
          obs->reap_dead_nodes();  // first: the observer reclaims what it watched die
          if (!obs_writer && obs->holds_row()) {
            obs_writer = true;
            ++S.observer_writes;
            rearm();
          }
        } catch (const FencedError&) {  // the observer's own node (a writer) was judged dead
          drop_obs();
        }
        pool->reap_dead_nodes();
        last_reap = t;
      }
      const uint32_t k = uint32_t(rng() % kKeys);
      KeyState& ks = S.keys[k];
      const double r = u(rng);
      if (r < 0.40) {  // put
        uint64_t v;
        {
          std::lock_guard<std::mutex> g(ks.mu);
          v = ks.cur_v;
          ++ks.inflight;
        }
        struct Done {
          Shared& S;
          KeyState& ks;
          ~Done() {
            std::lock_guard<std::mutex> g(ks.mu);
            --ks.inflight;
            ks.last_put_end = S.seq.fetch_add(1);
          }
        } done{S, ks};
        auto p = payload(1, k, v, kBlockBytes);
        Piece src{p.data(), p.size()};
        pool->put_ex(ns, make_key(1, k, v), &src, 1, 0);
      } else if (r < 0.75) {  // get, verified; sometimes of a removed version (stale probe)
        uint64_t v;
        bool stale_candidate = false;
        {
          std::lock_guard<std::mutex> g(ks.mu);
          v = ks.cur_v;
          if (!ks.removed.empty() && u(rng) < 0.3) {
            auto it = ks.removed.begin();
            std::advance(it, rng() % ks.removed.size());
            v = it->first;
          }
          auto it = ks.removed.find(v);
          stale_candidate = it != ks.removed.end() && ks.inflight == 0 && ks.last_put_end < it->second;
        }
        std::vector<char> buf(kBlockBytes);
        Piece dst{buf.data(), buf.size()};
        uint64_t len = 0;
        if (pool->get(ns, make_key(1, k, v), &dst, 1, &len)) {
          auto want = payload(1, k, v, kBlockBytes);
          if (len != want.size() || std::memcmp(buf.data(), want.data(), len) != 0) {
            ++S.wrong_payload;
          } else {
            ++S.verified;
          }
          if (stale_candidate) ++S.stale_read;
        } else {
          ++S.misses;
        }
      } else if (r < 0.80) {  // match a short chain of current versions
        Key keys[4];
        for (uint32_t i = 0; i < 4; ++i) {
          KeyState& kk = S.keys[(k + i) % kKeys];
          std::lock_guard<std::mutex> g(kk.mu);
          keys[i] = make_key(1, (k + i) % kKeys, kk.cur_v);
        }
        pool->match_prefix(ns, keys, 4);
      } else if (r < 0.90) {  // remove the current version: no put of it starts afterwards
        uint64_t v, begin;
        {
          std::lock_guard<std::mutex> g(ks.mu);
          v = ks.cur_v++;
          begin = S.seq.fetch_add(1);
        }
        Key key = make_key(1, k, v);
        bool any = false;
        for (int i = 0; i < 8 && pool->remove(ns, key); ++i) any = true;
        if (any && !pool->contains(ns, key)) {
          std::lock_guard<std::mutex> g(ks.mu);
          ks.removed[v] = begin;
          if (ks.removed.size() > 8) ks.removed.erase(ks.removed.begin());
        }
      } else if (r < 0.95) {  // a lease (pins), held across a few more calls
        Key key;
        {
          std::lock_guard<std::mutex> g(ks.mu);
          key = make_key(1, k, ks.cur_v);
        }
        auto pins = pool->acquire(ns, &key, 1);
        pool->contains(ns, key);
        pool->release(pins);
      } else {  // another namespace: created under the namespace lock, steals chunks
        uint32_t i = uint32_t(rng() % 3);
        if (!have_aux[i]) {
          aux[i] = pool->open_namespace(aux_layout(i));
          have_aux[i] = true;
        }
        uint32_t ak = uint32_t(rng() % 64);
        auto p = payload(10 + i, ak, 0, aux[i].block_bytes);
        Piece src{p.data(), p.size()};
        Key key = make_key(10 + i, ak, 0);
        pool->put_ex(aux[i], key, &src, 1, 0);
        std::vector<char> buf(aux[i].block_bytes);
        Piece dst{buf.data(), buf.size()};
        uint64_t len = 0;
        if (pool->get(aux[i], key, &dst, 1, &len)) {
          if (len != p.size() || std::memcmp(buf.data(), p.data(), len) != 0)
            ++S.wrong_payload;
          else
            ++S.verified;
        }
      }
      ++S.ops;
    } catch (const HostCrashed&) {
      if (S.stop.load()) {  // forced at the end of the run: not a fault of the workload
        drop_pool();
        return;
      }
      ++S.crashes;
      drop_pool();
      cache.reboot();
    } catch (const FencedError&) {
      ++S.fenced;
      drop_pool();
    } catch (const HostSlotBusyError&) {  // our previous incarnation is not reclaimed yet
      drop_pool();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } catch (const NodeTableFullError&) {
      drop_pool();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } catch (const std::exception& e) {
      ++S.other;
      S.note(std::string("host ") + std::to_string(h) + ": " + e.what());
      drop_pool();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (obs) {
    cache.set_ticker(nullptr, 0);
    cache.set_chores(nullptr, 0);
    try {
      obs->close();
    } catch (const HostCrashed&) {
    } catch (const std::exception& e) {
      S.note(std::string("close of host ") + std::to_string(h) + "'s observer: " + e.what());
    }
    obs.reset();
  }
  if (pool) {
    cache.set_ticker(nullptr, 0);
    cache.set_chores(nullptr, 0);
    if (pool->bakery()) S.skips += pool->bakery()->skipped();
    try {
      pool->close();
    } catch (const HostCrashed&) {
    } catch (const std::exception& e) {
      S.note(std::string("close of host ") + std::to_string(h) + ": " + e.what());
    }
  }
}

std::vector<char> make_image(const SimOptions& o, PoolHeader* hdr) {
  std::string path = o.tmp_dir + "/cxlkv-sim-" + std::to_string(::getpid()) + "-" + std::to_string(o.seed) +
                     "-" + std::to_string(mix(uint64_t(Clock::now().time_since_epoch().count())) % 1000000);
  CreateOptions c;
  c.size = o.pool_bytes;
  c.chunk_bytes = 128 * 1024;
  c.index_slots = 1024;
  c.max_nodes = 64;
  c.pin_slots = 64;
  c.max_namespaces = 8;
  c.backend = o.backend == "flush" ? Backend::flush : Backend::multihost;
  c.lease_ms = o.lease_ms;
  // + the final checker's rows and the creator's; only the multihost backend has a lock area
  if (c.backend == Backend::multihost) c.lock_hosts = uint32_t(o.hosts + kCreatorRow + 1);
  {
    // The creator attaches on this machine (real memory) on a row of its own. Closing, it is
    // fenced if its heartbeat thread was starved past half a lease (a loaded machine): its node
    // then stays ALIVE in the image until a host judges it dead by lease and reclaims it. On a
    // row the checker uses, that node (another host id) made the checker's attach fail.
    OpenOptions oo;
    std::string prev = std::getenv("CXLKV_HOST_SLOT") ? std::getenv("CXLKV_HOST_SLOT") : "";
    ::setenv("CXLKV_HOST_SLOT", std::to_string(o.hosts + kCreatorRow).c_str(), 1);
    try {
      auto p = Pool::create(path, c, false);
      *hdr = p->header();
      if (o.creator_fenced)
        p->abandon();
      else
        p->close();
    } catch (...) {
      if (prev.empty())
        ::unsetenv("CXLKV_HOST_SLOT");
      else
        ::setenv("CXLKV_HOST_SLOT", prev.c_str(), 1);
      ::unlink(path.c_str());
      throw;
    }
    if (prev.empty())
      ::unsetenv("CXLKV_HOST_SLOT");
    else
      ::setenv("CXLKV_HOST_SLOT", prev.c_str(), 1);
  }
  std::vector<char> img(o.pool_bytes);
  std::ifstream f(path, std::ios::binary);
  f.read(img.data(), std::streamsize(img.size()));
  ::unlink(path.c_str());
  if (!f) throw Error("cannot read back the simulation's pool image " + path);
  return img;
}

}  // namespace

uint64_t SimResult::violations() const {
  uint64_t n = 0;
  for (auto& [k, v] : kinds) n += v;
  return n;
}

std::string SimResult::to_json(const SimOptions& o) const {
  std::ostringstream s;
  s << "{\"hosts\": " << o.hosts << ", \"seconds\": " << o.seconds << ", \"seed\": " << o.seed
    << ", \"break\": " << (o.brk.empty() ? "null" : "\"" + o.brk + "\"") << ", \"backend\": \"" << o.backend
    << "\", \"lease_ms\": " << o.lease_ms << ", \"ops\": " << ops
    << ", \"verified_reads\": " << verified_reads << ", \"misses\": " << misses
    << ", \"violations\": " << violations() << ", \"crashes\": " << crashes
    << ", \"fault\": " << (o.fault.empty() ? "null" : "\"" + o.fault + "\"")
    << ", \"fault_crashes\": " << fault_crashes << ", \"pauses\": " << pauses << ", \"fenced\": " << fenced
    << ", \"attaches\": " << attaches << ", \"lock_skips\": " << lock_skips
    << ", \"evictions\": " << evictions << ", \"pause_deferred\": " << pause_deferred
    << ", \"heal_passes\": " << heal_passes << ", \"healed\": " << healed
    << ", \"observer_writes\": " << observer_writes
    << ", \"check_incomplete\": " << (check_incomplete ? "true" : "false")
    << ", \"other_errors\": " << other_errors << ", \"violation_kinds\": {";
  bool first = true;
  for (auto& [k, v] : kinds) {
    s << (first ? "" : ", ") << "\"" << k << "\": " << v;
    first = false;
  }
  s << "}, \"notes\": [";
  for (size_t i = 0; i < notes.size(); ++i) {
    std::string n;
    for (char c : notes[i]) {
      if (c == '"' || c == '\\') n += '\\';
      n += (c >= 0x20 ? c : ' ');
    }
    s << (i ? ", " : "") << "\"" << n << "\"";
  }
  s << "]}";
  return s.str();
}

double reserved_seconds(const SimOptions& o) {
  // The checker's own attach may wait a lease behind a crashed host's lock ticket, then it
  // watches two leases so that every crashed host is dead by lease: three leases in all.
  return kStopSeconds + kJoinSeconds + (3.0 * o.lease_ms + 100) / 1000 + kCheckSeconds;
}
double min_seconds(const SimOptions& o) { return reserved_seconds(o) + kMinWorkSeconds; }

SimResult run_sim(const SimOptions& o) {
  const auto start = Clock::now();
  const int max_hosts = int(format::kMaxLockHosts) - (kCreatorRow + 1);  // 59
  if (o.hosts < 1 || o.hosts > max_hosts)
    throw ArgumentError("hosts must be in 1.." + std::to_string(max_hosts));
  if (o.seconds <= 0) throw ArgumentError("seconds must be positive");
  // --seconds bounds the whole run: a lease whose waits do not fit is refused now, not waited out.
  if (o.seconds < min_seconds(o)) {
    char msg[400];
    std::snprintf(msg, sizeof msg,
                  "--seconds %g is too short for --lease-ms %u: %.2f s of the run go to stopping the "
                  "hosts and to the final check (which may wait three leases for crashed hosts "
                  "to be judged dead); give --seconds >= %.2f or a shorter --lease-ms",
                  o.seconds, o.lease_ms, reserved_seconds(o), min_seconds(o));
    throw ArgumentError(msg);
  }
  const auto deadline = start + std::chrono::duration<double>(o.seconds);
  const auto end = deadline - std::chrono::duration<double>(reserved_seconds(o));
  Shared S;
  S.o = o;
  S.cfg.sw.no_flush = o.brk == "flush";
  S.cfg.sw.no_invalidate = o.brk == "invalidate";
  S.cfg.sw.no_lock_flush = o.brk == "lock";
  S.cfg.sw.heal_holders = o.brk == "heal";
  if (o.backend != "multihost" && o.backend != "flush")
    throw ArgumentError("backend must be multihost or flush");
  if (!o.brk.empty() && o.brk != "flush" && o.brk != "invalidate" && o.brk != "lock" && o.brk != "heal")
    throw ArgumentError("break must be one of flush, invalidate, lock, heal");
  format::PoolHeader hdr{};
  S.mem = std::make_unique<Memory>(make_image(o, &hdr), hdr);
  for (int h = 0; h < o.hosts; ++h)
    S.caches.push_back(std::make_unique<EmuCache>(*S.mem, h, mix(o.seed * 7919 + uint64_t(h)), S.cfg));

  S.done.reset(new std::atomic<bool>[size_t(o.hosts)]);
  for (int h = 0; h < o.hosts; ++h) S.done[h] = false;
  // A named fault point is armed on one host from the start too: some (carving a chunk) are
  // passed mostly early in a run.
  if (!o.fault.empty() && o.crashes && o.hosts > 1)
    S.caches[mix(o.seed) % uint64_t(o.hosts)]->arm_fault(o.fault);
  std::vector<std::thread> ts;
  for (int h = 0; h < o.hosts; ++h) ts.emplace_back(host_main, std::ref(S), h);
  // Faults: every ~0.4 s one host is armed to crash or to pause past its lease at a random later
  // coherence call (alternating), so a 2-second run sees a few of each.
  std::mt19937_64 rng(mix(o.seed ^ 0xFA17));
  int event = 0;
  while (Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(
        400, std::max<int64_t>(
                 1, std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count()))));
    if (Clock::now() >= end || o.hosts < 2) continue;
    EmuCache& c = *S.caches[rng() % uint64_t(o.hosts)];
    bool crash = (event++ % 2) == 0;
    if (crash && o.crashes) {
      if (o.fault.empty())
        c.arm_crash();
      else
        c.arm_fault(o.fault);
    }
    if (!crash && o.pauses) c.arm_pause(uint64_t(o.lease_ms) * 3 / 2);
  }
  S.stop = true;
  // Hosts finish their operation; one still stuck after kStopSeconds (a broken discipline can
  // stall it in lease waits; a pause is cut short) crashes at its next coherence call.
  const auto grace = Clock::now() + std::chrono::duration<double>(kStopSeconds);
  for (int h = 0; h < o.hosts; ++h) {
    while (!S.done[h].load() && Clock::now() < grace)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!S.done[h].load()) S.caches[h]->force_crash();
  }
  for (auto& t : ts) t.join();

  SimResult r;
  const uint64_t seen = S.mem->counters.lost_update + S.mem->counters.invalidate_dirty +
                        S.mem->counters.lock_overlap + S.mem->counters.lost_ticket + S.wrong_payload +
                        S.stale_read;
  // The final checker: another host attaches once every dead node is dead by lease, reclaims
  // them, and runs `pool check` (accounting, double allocation, stuck entries) under emulation.
  // A negative control that is caught already skips it (it only adds seconds of lease waits).
  if (o.brk.empty() || seen == 0) {
    EmuConfig calm = S.cfg;
    calm.p_evict = 0.05;
    EmuCache cache(*S.mem, o.hosts, mix(o.seed ^ 0xC4EC), calm);
    EmulatedHost eh;
    eh.base = cache.base();
    eh.size = S.mem->size();
    eh.model = &cache;
    eh.host_id = mix(0xC4EC) | 1;
    eh.host_slot = o.hosts;
    // A checker starved past half a lease (a loaded machine) fences itself: it then starts over
    // as a new node on the next of its rows; kCheckAttempts fences in a row count as a failed check.
    for (int attempt = 0;; ++attempt) {
      std::unique_ptr<Pool> p;
      eh.host_slot = o.hosts + attempt;  // a fenced attempt's node is not dead yet: its own slot
      try {
        p = Pool::open_emulated(eh);
        cache.set_ticker([q = p.get()] { q->heartbeat_tick(); }, uint64_t(o.lease_ms) * 1'000'000 / 8);
        cache.set_chores(heal_chore(S, p.get()), uint64_t(o.lease_ms) * 1'000'000 / 8);
        const auto until = Clock::now() + std::chrono::milliseconds(o.lease_ms * 2 + 100);
        // A retry after a fence (or a stop that overran) may not fit in --seconds any more: then
        // the check is reported incomplete rather than run early (crashed hosts not yet dead by
        // lease would look like stuck entries) or run past the bound.
        if (until + std::chrono::duration<double>(kCheckSeconds) > deadline) {
          cache.set_ticker(nullptr, 0);
          cache.set_chores(nullptr, 0);
          p->abandon();
          r.check_incomplete = true;
          S.note("final check incomplete: --seconds left too little time for its lease wait");
          break;
        }
        while (Clock::now() < until) {
          p->heartbeat_tick();
          p->reap_dead_nodes();
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        p->heartbeat_tick();
        CheckReport cr = p->check();
        r.kinds["check_errors"] = cr.errors.size();
        for (size_t i = 0; i < cr.errors.size() && i < 4; ++i) S.note("check: " + cr.errors[i]);
        cache.set_ticker(nullptr, 0);
        cache.set_chores(nullptr, 0);
        p->close();
        break;
      } catch (const FencedError& e) {
        cache.set_ticker(nullptr, 0);
        cache.set_chores(nullptr, 0);
        if (p) p->abandon();
        if (attempt + 1 < kCheckAttempts) continue;
        r.check_incomplete = true;
        S.note(std::string("final check incomplete: ") + e.what());
        break;
      } catch (const std::exception& e) {
        cache.set_ticker(nullptr, 0);
        cache.set_chores(nullptr, 0);
        if (p) p->abandon();
        // Under a --break switch the pool may be beyond checking: that is a violation too.
        r.kinds["check_errors"] += 1;
        S.note(std::string("final check: ") + e.what());
        break;
      }
    }
  }
  r.ops = S.ops;
  r.verified_reads = S.verified;
  r.misses = S.misses;
  r.crashes = S.crashes;
  for (auto& c : S.caches) r.pauses += c->pauses(), r.fault_crashes += c->fault_crashes();
  r.fenced = S.fenced;
  r.attaches = S.attaches;
  r.other_errors = S.other;
  r.lock_skips = S.skips;
  r.evictions = S.mem->counters.evictions;
  r.pause_deferred = S.mem->counters.pause_deferred;
  r.kinds["lost_update"] = S.mem->counters.lost_update;
  r.kinds["invalidate_dirty"] = S.mem->counters.invalidate_dirty;
  r.kinds["lock_overlap"] = S.mem->counters.lock_overlap;
  r.kinds["lost_ticket"] = S.mem->counters.lost_ticket;
  r.healed = S.healed;
  r.observer_writes = S.observer_writes;
  for (auto& c : S.caches) r.heal_passes += c->chore_runs();
  r.kinds["wrong_payload"] = S.wrong_payload;
  r.kinds["stale_read"] = S.stale_read;
  r.notes = S.mem->reports;
  r.notes.insert(r.notes.end(), S.notes.begin(), S.notes.end());
  return r;
}

}  // namespace cxlkv::sim
