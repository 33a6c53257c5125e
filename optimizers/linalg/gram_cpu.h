// The CPU inner-product pass of lstsq: a plain threaded loop over raw column pointers
// (internal). Serves both the Gram matrix of [A | B] and GramAccumulator's new-column dots.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace tidepool::linalg::detail {

// For every (a, b) in `pairs`: out[p] = Σ_i x_a[i]·x_b[i] with fp64 accumulation, where
// column j is element i at data[j][i·stride[j]]. T is float or double. Reads each column
// once; deterministic for a given `rows`, whatever the number of threads.
template <typename T>
std::vector<double> cpu_inner_products(const std::vector<const T*>& data,
                                       const std::vector<int64_t>& stride, int64_t rows,
                                       const std::vector<std::pair<int, int>>& pairs);

}  // namespace tidepool::linalg::detail
