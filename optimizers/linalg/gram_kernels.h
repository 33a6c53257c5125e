// CUDA kernels for the Gram pass of lstsq (declarations; gram_kernels.cu holds them).
// They take raw pointers and no LibTorch types, so nvcc never parses LibTorch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tidepool::linalg::cuda {

// The kernel holds the packed upper triangle of the Gram matrix in fp64 registers spread
// over up to four warps' worth of pair groups, so it handles at most this many columns of
// [A | B]; wider problems use the chunked cuBLAS path in gram.cpp.
constexpr int kMaxKernelColumns = 16;

// Column j of [A | B] is element i at data[j] + i·stride[j] (in elements). Columns of a
// row-major N×k matrix have stride k and adjacent data pointers (the kernel reads them as
// one row-major panel); separately allocated column vectors have stride 1. Every data
// pointer must be aligned to the element size (any torch tensor's is).
struct ColumnSet {
  const void* data[kMaxKernelColumns];
  int64_t stride[kMaxKernelColumns];
};

// Doubles of device workspace launch_gram needs for `rows` rows and m columns: the
// per-block partial sums. Depends only on (rows, m), like the launch configuration.
int64_t gram_workspace_doubles(int64_t rows, int m);

// G = XᵀX for the N×m matrix X whose columns `columns` describes (N = rows, 1 ≤ m ≤
// kMaxKernelColumns), fp32 (is_fp64 false) or fp64 input, fp64 accumulation. Writes the
// m(m+1)/2 sums of the upper triangle, packed row by row ((0,0),(0,1)…(0,m−1),(1,1)…), to
// `gram` (device memory, m(m+1)/2 doubles). `workspace` is device memory of
// gram_workspace_doubles(rows, m) doubles. Two kernels on `stream`: per-block partials,
// then a fixed-order reduction; no atomics, so the result is bitwise reproducible run to
// run on one device. Returns cudaErrorInvalidValue for bad sizes or null pointers,
// cudaErrorMisalignedAddress for a column pointer not aligned to its element size, else
// the launch status.
cudaError_t launch_gram(const ColumnSet& columns, int m, int64_t rows, bool is_fp64, double* workspace,
                        double* gram, cudaStream_t stream);

}  // namespace tidepool::linalg::cuda
