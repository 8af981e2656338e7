// The one percentile of the C++ benchmarks (bench, rpc_bench, the emulator's bench_mh): the
// nearest rank on (n - 1), ties to even, found by nth_element (reorders v). It is the rule of the
// Python tools (tools/_common.py: numpy's "nearest"), so figures of both languages compare.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace cxlkv {

template <typename T>
double percentile(std::vector<T>& v, double q) {
  if (v.empty()) return 0;
  size_t k = std::min(v.size() - 1, size_t(std::nearbyint(q * double(v.size() - 1))));
  std::nth_element(v.begin(), v.begin() + long(k), v.end());
  return double(v[k]);
}

}  // namespace cxlkv
