// CUDA kernels for lstsq's Gram pass: G = XᵀX for X = [A | B] (N×m, m ≤ 16) in one read of
// X, fp32 or fp64 input, fp64 accumulation.
//
// Each thread walks rows with a grid-stride loop (64-bit indices, so N·k beyond 2³¹ is
// fine), upcasts its row to fp64 and adds the m(m+1)/2 products to register accumulators.
// Blocks reduce with warp shuffles and write one partial per pair; the host sums the
// partials in a fixed order. No atomics: the result is bitwise reproducible run to run.
// The kernel is memory-bound (m(m+1)/2 fp64 FMAs per m loads), which is what lets the
// whole solve run close to the time of reading A once.
#include "optimizers/linalg/gram_kernels.h"

namespace tidepool::linalg::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename T, int M>
__global__ void __launch_bounds__(kThreads) gram_partials_kernel(ColumnSet columns, int64_t rows,
                                                                 double* partials) {
  constexpr int kPairs = M * (M + 1) / 2;
  double acc[kPairs];
#pragma unroll
  for (int p = 0; p < kPairs; ++p) acc[p] = 0.0;

  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < rows; i += step) {
    double x[M];
#pragma unroll
    for (int j = 0; j < M; ++j) {
      x[j] = static_cast<double>(static_cast<const T*>(columns.data[j])[i * columns.stride[j]]);
    }
    int p = 0;
#pragma unroll
    for (int a = 0; a < M; ++a) {
#pragma unroll
      for (int b = a; b < M; ++b) acc[p++] += x[a] * x[b];
    }
  }

  __shared__ double warp_sums[kWarps][kPairs];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    double v = acc[p];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp][p] = v;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < kPairs; p += kThreads) {
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w][p];
    partials[static_cast<int64_t>(blockIdx.x) * kPairs + p] = total;
  }
}

template <typename T, int M>
cudaError_t launch_for(const ColumnSet& columns, int64_t rows, double* partials,
                       cudaStream_t stream) {
  gram_partials_kernel<T, M><<<gram_grid_size(rows), kThreads, 0, stream>>>(columns, rows, partials);
  return cudaGetLastError();
}

// Runtime m → compile-time M, so the accumulators stay in registers.
template <typename T, int M = 1>
cudaError_t dispatch_columns(const ColumnSet& columns, int m, int64_t rows, double* partials,
                             cudaStream_t stream) {
  if constexpr (M > kMaxKernelColumns) {
    return cudaErrorInvalidValue;
  } else {
    if (m == M) return launch_for<T, M>(columns, rows, partials, stream);
    return dispatch_columns<T, M + 1>(columns, m, rows, partials, stream);
  }
}

}  // namespace

int gram_grid_size(int64_t rows) {
  // Enough blocks to fill an H200 several times over (132 SMs), few enough that the host
  // reduction of the partials stays in the microseconds.
  constexpr int64_t kMaxBlocks = 1056;
  const int64_t wanted = (rows + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 1 ? 1 : (wanted < kMaxBlocks ? wanted : kMaxBlocks));
}

cudaError_t launch_gram_partials(const ColumnSet& columns, int m, int64_t rows, bool is_fp64,
                                 double* partials, cudaStream_t stream) {
  if (m < 1 || m > kMaxKernelColumns || rows < 1 || partials == nullptr) return cudaErrorInvalidValue;
  return is_fp64 ? dispatch_columns<double>(columns, m, rows, partials, stream)
                 : dispatch_columns<float>(columns, m, rows, partials, stream);
}

}  // namespace tidepool::linalg::cuda
