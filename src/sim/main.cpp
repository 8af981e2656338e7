// cxlkv-sim: the non-coherence emulator from the command line (`cxlkv sim` runs it).
//   cxlkv-sim [--hosts N] [--seconds S] [--seed K] [--break flush|invalidate|lock|heal] [--lease-ms MS]
//             [--no-crashes] [--no-pauses]
//   cxlkv-sim --bench OPS     cost of the multihost discipline vs coherent (bench_mh.h)
// Prints one JSON object; exit status 0 (the caller judges `violations`), 2 on bad arguments.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench_mh.h"
#include "errors.h"
#include "sim.h"

int main(int argc, char** argv) {
  cxlkv::sim::SimOptions o;
  int bench_ops = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "cxlkv-sim: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "--hosts")
        o.hosts = std::stoi(val());
      else if (a == "--seconds")
        o.seconds = std::stod(val());
      else if (a == "--seed")
        o.seed = std::stoull(val());
      else if (a == "--break")
        o.brk = val();
      else if (a == "--backend")
        o.backend = val();
      else if (a == "--fault")
        o.fault = val();
      else if (a == "--lease-ms")
        o.lease_ms = uint32_t(std::stoul(val()));
      else if (a == "--no-crashes")
        o.crashes = false;
      else if (a == "--no-pauses")
        o.pauses = false;
      else if (a == "--json") {
      } else if (a == "--bench")
        bench_ops = std::stoi(val());  // the output is always JSON
      else {
        std::fprintf(stderr, "cxlkv-sim: unknown argument %s\n", a.c_str());
        return 2;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "cxlkv-sim: bad value for %s\n", a.c_str());
      return 2;
    }
  }
  try {
    if (bench_ops > 0) {
      std::printf("%s\n", cxlkv::sim::bench_multihost(bench_ops).c_str());
      return 0;
    }
    auto r = cxlkv::sim::run_sim(o);
    std::printf("%s\n", r.to_json(o).c_str());
  } catch (const cxlkv::ArgumentError& e) {
    std::fprintf(stderr, "cxlkv-sim: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cxlkv-sim: %s\n", e.what());
    return 1;
  }
  return 0;
}
