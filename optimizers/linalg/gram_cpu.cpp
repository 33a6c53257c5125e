// The CPU inner-product pass of lstsq: chosen pairs of ⟨x_a, x_b⟩ for m column pointers, fp64
// accumulation — all pairs a ≤ b for the Gram matrix of [A | B], (new, j) for
// GramAccumulator::set_column.
//
// Rows are cut into fixed chunks (kChunkRows, independent of the thread count) that
// at::parallel_for spreads over threads; each chunk writes its own partial G and the
// partials are summed in chunk order, so the result is the same on every run and with any
// number of threads. Inside a chunk, tiles of kTileRows rows are upcast into a small
// column-major fp64 buffer (in L1) and every requested pair (a, b) is a dot product over the tile
// with four independent accumulators, which the compiler keeps in vector registers. This reads
// X once at memory speed; the earlier version (stack + at::mm per block) spent most of
// its time in tensor bookkeeping.
#include "optimizers/linalg/gram_cpu.h"

#include <algorithm>

#include <ATen/Parallel.h>

namespace tidepool::linalg::detail {
namespace {

constexpr int64_t kChunkRows = int64_t{1} << 16;
constexpr int64_t kTileRows = 256;

double dot_tile(const double* x, const double* y, int64_t n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += x[i] * y[i];
    s1 += x[i + 1] * y[i + 1];
    s2 += x[i + 2] * y[i + 2];
    s3 += x[i + 3] * y[i + 3];
  }
  for (; i < n; ++i) s0 += x[i] * y[i];
  return (s0 + s1) + (s2 + s3);
}

}  // namespace

template <typename T>
std::vector<double> cpu_inner_products(const std::vector<const T*>& data,
                                       const std::vector<int64_t>& stride, int64_t rows,
                                       const std::vector<std::pair<int, int>>& pairs) {
  const auto m = static_cast<int64_t>(data.size());
  const auto n_pairs = static_cast<int64_t>(pairs.size());
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  std::vector<double> partials(static_cast<size_t>(chunks * n_pairs), 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    std::vector<double> tile(static_cast<size_t>(m * kTileRows));
    for (int64_t chunk = first; chunk < last; ++chunk) {
      double* sums = partials.data() + chunk * n_pairs;
      const int64_t end = std::min(rows, (chunk + 1) * kChunkRows);
      for (int64_t begin = chunk * kChunkRows; begin < end; begin += kTileRows) {
        const int64_t n = std::min(kTileRows, end - begin);
        for (int64_t j = 0; j < m; ++j) {
          const T* column = data[static_cast<size_t>(j)];
          const int64_t s = stride[static_cast<size_t>(j)];
          double* t = tile.data() + j * kTileRows;
          for (int64_t i = 0; i < n; ++i) t[i] = static_cast<double>(column[(begin + i) * s]);
        }
        for (int64_t p = 0; p < n_pairs; ++p) {
          const auto [a, b] = pairs[static_cast<size_t>(p)];
          sums[p] += dot_tile(tile.data() + a * kTileRows, tile.data() + b * kTileRows, n);
        }
      }
    }
  });
  std::vector<double> out(static_cast<size_t>(n_pairs), 0.0);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    for (int64_t p = 0; p < n_pairs; ++p)
      out[static_cast<size_t>(p)] += partials[static_cast<size_t>(chunk * n_pairs + p)];
  }
  return out;
}

template std::vector<double> cpu_inner_products<float>(const std::vector<const float*>&,
                                                       const std::vector<int64_t>&, int64_t,
                                                       const std::vector<std::pair<int, int>>&);
template std::vector<double> cpu_inner_products<double>(const std::vector<const double*>&,
                                                        const std::vector<int64_t>&, int64_t,
                                                        const std::vector<std::pair<int, int>>&);

}  // namespace tidepool::linalg::detail
