// Python binding of the shared-memory RPC benchmark (`cxlkv bench rpc`, python/cxlkv/rpc_bench.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "names.h"
#include "rpc_bench.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_rpc(nb::module_& m) {
  m.def(
      "bench_rpc",
      [](const std::string& transport, uint32_t iterations, uint32_t warmup, uint32_t depth, uint32_t batches,
         const std::string& backend, const std::string& dir, bool pin) {
        cxlkv::rpcbench::Options o;
        o.iterations = iterations, o.warmup = warmup, o.depth = depth, o.batches = batches;
        o.backend = cxlkv::parse_backend(backend);
        o.dir = dir, o.pin = pin;
        cxlkv::rpcbench::Result r;
        {
          nb::gil_scoped_release nogil;
          r = cxlkv::rpcbench::run(transport, o);
        }
        nb::dict d;
        for (const auto& [k, v] : r.fields()) d[k] = v;
        d["transport"] = r.transport, d["server_cpu"] = r.server_cpu, d["client_cpu"] = r.client_cpu;
        return d;
      },
      "transport"_a, "iterations"_a = 20000, "warmup"_a = 2000, "depth"_a = 128, "batches"_a = 2000,
      "backend"_a = "coherent", "dir"_a = "/dev/shm", "pin"_a = true,
      "Round trips between this process and a forked echo server over `transport` (rpc, tcp, uds), "
      "timed in C++: depth-1 p50/p99 and messages/s, and messages/s at `depth` (see rpc_bench.h).");
}
