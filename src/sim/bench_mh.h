// `cxlkv-sim --bench`: the cost of the multihost discipline against coherent, same run (JSON).
#pragma once
#include <string>

namespace cxlkv::sim {
std::string bench_multihost(int ops);
}
