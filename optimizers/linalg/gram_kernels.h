// CUDA kernels for the Gram pass of lstsq (declarations; gram_kernels.cu holds them).
// They take raw pointers and no LibTorch types, so nvcc never parses LibTorch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tidepool::linalg::cuda {

// The kernel keeps one fp64 accumulator per column pair in registers, so it handles at
// most this many columns of [A | B]; wider problems use the chunked cuBLAS path.
constexpr int kMaxKernelColumns = 16;

// Column j of [A | B] is element i at data[j] + i·stride[j] (in elements). Columns of a
// row-major N×k matrix have stride k; separately allocated column vectors have stride 1.
struct ColumnSet {
  const void* data[kMaxKernelColumns];
  int64_t stride[kMaxKernelColumns];
};

// Number of blocks launch_gram_partials uses for `rows` rows. It depends only on `rows`,
// so the reduction order (and the result) is the same on every run.
int gram_grid_size(int64_t rows);

// Computes, per block, the partial sums Σ_i x_ia·x_ib (a ≤ b, packed row by row of the
// upper triangle: (0,0),(0,1)…(0,m−1),(1,1)…) over that block's rows, accumulating in
// fp64, and writes them to partials[block·m(m+1)/2 + pair]. `partials` must hold
// gram_grid_size(rows)·m(m+1)/2 doubles. is_fp64 selects double input, else float.
// Returns the launch status.
cudaError_t launch_gram_partials(const ColumnSet& columns, int m, int64_t rows, bool is_fp64,
                                 double* partials, cudaStream_t stream);

}  // namespace tidepool::linalg::cuda
