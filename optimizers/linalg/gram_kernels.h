// CUDA kernels for the Gram pass of lstsq (declarations; gram_kernels.cu holds them).
// They take raw pointers and no LibTorch types, so nvcc never parses LibTorch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "optimizers/linalg/gram_plan.h"  // kMaxKernelColumns, ColumnSet, gram_workspace_doubles

namespace tidepool::linalg::cuda {

// G = XᵀX for the N×m matrix X whose columns `columns` describes (N = rows, 1 ≤ m ≤
// kMaxKernelColumns), fp32 (is_fp64 false) or fp64 input, fp64 accumulation. Writes the
// m(m+1)/2 sums of the upper triangle, packed row by row ((0,0),(0,1)…(0,m−1),(1,1)…), to
// `gram` (device memory, m(m+1)/2 doubles). `workspace` is device memory of
// gram_workspace_doubles(rows, m) doubles (gram_plan.h). Two kernels on `stream`: per-block
// partials, then a fixed-order reduction; no atomics, so the result is bitwise reproducible run to
// run on one device. Returns cudaErrorInvalidValue for bad sizes or null pointers,
// cudaErrorMisalignedAddress for a column pointer not aligned to its element size, else
// the launch status.
cudaError_t launch_gram(const ColumnSet& columns, int m, int64_t rows, bool is_fp64,
                        double* workspace, double* gram, cudaStream_t stream);

}  // namespace tidepool::linalg::cuda
