// Not part of cxlkv_tests (not globbed: subdirectory). Driven by stale_alloc_repro.sh under gdb.
// Reproducer: an allocator that checked "chunk c is ACTIVE(my ns)" and then claims a desc after
// the chunk was drained and re-carved for another namespace.
//   setup PATH  : creates a 2-chunk pool, ns X fills chunk 0 (4 blocks) and 3 of chunk 1's 4; pins
//                 one block of chunk 0 (so a drain can only take chunk 1); sleeps holding the pin.
//   W PATH      : puts a new key into X (run under gdb: stops in claim_free_block for chunk 1)
//   D PATH      : puts one key into namespace Y (steals = drains chunk 1)
//   check PATH  : prints check() findings
#include <signal.h>
#include "../test_util.h"
using namespace cxlkv;
using namespace cxlkv::test;
int main(int argc, char** argv) {
  std::string mode = argv[1], path = argv[2];
  if (mode == "setup") {
    std::unique_ptr<Pool> p;
    for (uint64_t s = 300 * KiB;; s += 4 * KiB) {
      CreateOptions o;
      o.size = s;
      o.chunk_bytes = 64 * KiB;
      o.index_slots = 1024;
      try {
        p = Pool::create(path, o, false);
      } catch (const ArgumentError&) {
        continue;
      }
      if (p->header().chunk_count == 2) break;
      p.reset();
      unlink(path.c_str());
    }
    auto x = p->open_namespace(layout("X", 16 * KiB));
    std::vector<char> v(16 * KiB, 'x');
    Piece pc{v.data(), v.size()};
    for (uint64_t id = 0; id < 7; ++id) p->put(x, key_of(id), &pc, 1, 0);
    Key k0 = key_of(0);
    auto pins = p->acquire(x, &k0, 1);  // key 0 is in chunk 0
    printf("setup: chunks=%llu pinned=%zu\n", (unsigned long long)p->header().chunk_count, pins.size());
    fflush(stdout);
    pause();
  } else if (mode == "W") {
    auto p = Pool::open(path);
    auto x = p->open_namespace(layout("X", 16 * KiB));
    std::vector<char> v(16 * KiB, 'w');
    Piece pc{v.data(), v.size()};
    printf("W: put -> %d\n", p->put(x, key_of(100), &pc, 1, 0));
  } else if (mode == "D") {
    auto p = Pool::open(path);
    auto y = p->open_namespace(layout("Y", 4 * KiB));
    std::vector<char> v(4 * KiB, 'y');
    Piece pc{v.data(), v.size()};
    printf("D: put -> %d\n", p->put(y, key_of(200), &pc, 1, 0));
  } else {
    auto p = Pool::open(path);
    auto r = p->check();
    printf("check: ok=%d\n", r.ok);
    for (auto& e : r.errors) printf("  %s\n", e.c_str());
    auto x = p->open_namespace(layout("X", 16 * KiB));
    std::vector<char> out(16 * KiB);
    Piece pc{out.data(), out.size()};
    printf("get X/100 -> %d\n", p->get(x, key_of(100), &pc, 1, nullptr));
  }
}
