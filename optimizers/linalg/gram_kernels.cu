// CUDA kernels for lstsq's Gram pass: G = XᵀX for X = [A | B] (N×m, m ≤ 16) in one read of
// X at HBM bandwidth, fp32 or fp64 input, fp64 accumulation, bitwise reproducible.
//
// How it works (the H200 showed the previous row-per-thread kernel at 4–120× the time of
// reading A once: each thread loaded one scalar per column of its own row, so a warp's load
// of a row-major N×8 fp32 A touched 1 KB for 128 useful bytes per instruction, and few
// bytes were in flight):
//   1. Panels. On the host, adjacent columns with the same row stride and adjacent data
//      pointers merge into one panel: element (r, c) at base + r·stride + c. A row-major
//      N×k A is one panel of width k; a 1-D B, or each of AADL's separate column vectors,
//      is a panel of width 1 (stride 1); a column-major A is k panels of width 1. A panel
//      with stride == width is one contiguous array of N·width elements.
//   2. Slabs and tiles. Block b owns the contiguous rows [b·S, min((b+1)·S, N)), S a
//      multiple of the tile height kRows; the grid (≤ kMaxBlocks) depends only on (N, m),
//      so the summation order never changes. The block walks its slab one tile of kRows
//      rows at a time.
//   3. Loads. A contiguous panel's tile is the flat element range [r₀·w, (r₀+n)·w) of
//      its array: consecutive threads read consecutive 16-byte vectors (float4/double2)
//      from the first 16-byte-aligned element on, with a scalar head and tail, two or four
//      vectors per thread in flight. Narrow (w·size < 16 B) and strided panels read one
//      element per thread, consecutive threads on consecutive elements of the panel.
//      Every value is converted to fp64 once and stored column-major in shared memory,
//      tile[column][row], pitch kRows + 1 (odd, so reads are bank-conflict free). While
//      the block works on tile t, it asks L2 to prefetch tile t+1 (prefetch.L2 per
//      128-byte line), which keeps HBM busy during the compute phase.
//   4. Products. The m(m+1)/2 pairs are split into kGroups groups (1, 2 or 4, so that a
//      thread holds ≤ 46 fp64 accumulators in registers); warp w serves group w % kGroups
//      and a fixed set of rows of each tile. Shared-memory reads: lane = row, conflict-free.
//   5. Reduction. Warp shuffles (fixed tree) then a fixed loop over warps give one partial
//      per (pair, block), stored pair-major in `workspace`; a second kernel, one block per
//      pair, sums a pair's partials in a fixed order. No atomics anywhere.
// Indices: global element offsets are int64 (N·stride beyond 2³¹ is the normal case);
// offsets inside one tile are < kRows·kMaxKernelColumns = 8192 and are int. All of that
// arithmetic (launch shape, panels, vector split, index maps) lives in gram_plan.h, where
// the CPU tests check it; this file holds only what runs on the device.
#include "optimizers/linalg/gram_kernels.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tidepool::linalg::cuda {
namespace {

// The 16-byte vector type of T: float4 or double2 (four or two lanes).
template <typename T>
using Vector16 = std::conditional_t<std::is_same_v<T, float>, float4, double2>;
static_assert(sizeof(Vector16<float>) == kVectorBytes && sizeof(Vector16<double>) == kVectorBytes);

template <typename T, int kPitch>
__device__ __forceinline__ void store_element(double* tile, const Panel& panel, int f, T value) {
  tile[tile_index(panel, f, kPitch)] = static_cast<double>(value);
}

// Rows [row0, row0 + n) of a panel with row_stride == width: the flat elements
// [row0·w, row0·w + n·w) of one contiguous array. Vectors from the first 16-byte boundary
// (`head` scalars before it, `tail` after the last whole vector).
template <typename T, int kPitch, int kLoadBatch>
__device__ void load_vectorised(const Panel& panel, int64_t row0, int n, double* tile) {
  using Vec = Vector16<T>;
  constexpr int kLanes = kVectorBytes / static_cast<int>(sizeof(T));
  const T* segment = static_cast<const T*>(panel.base) + row0 * panel.width;  // int64 offset
  const int count = n * panel.width;                                          // ≤ 8192
  // segment is sizeof(T)-aligned (checked on the host), so `head` whole elements bring it
  // to a 16-byte boundary.
  const VectorSplit split =
      vector_split(reinterpret_cast<uintptr_t>(segment), count, static_cast<int>(sizeof(T)));
  const int head = split.head;
  const int vectors = split.vectors;
  const int body_end = split.body_end;  // elements [body_end, count) are the tail
  const Vec* body = reinterpret_cast<const Vec*>(segment + head);  // 16-byte aligned

  for (int v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kLoadBatch) {
    Vec loaded[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int v = v0 + u * kThreads;
      if (v < vectors) loaded[u] = __ldg(body + v);
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int v = v0 + u * kThreads;
      if (v < vectors) {
        T lanes[kLanes];
        memcpy(lanes, &loaded[u], sizeof(Vec));  // register moves, no aliasing questions
#pragma unroll
        for (int q = 0; q < kLanes; ++q)
          store_element<T, kPitch>(tile, panel, head + v * kLanes + q, lanes[q]);
      }
    }
  }
  // Head [0, head) and tail [body_end, count): together fewer than 2·kLanes elements.
  const int edge = head + (count - body_end);
  for (int e = threadIdx.x; e < edge; e += kThreads) {
    const int f = e < head ? e : body_end + (e - head);
    store_element<T, kPitch>(tile, panel, f, __ldg(segment + f));
  }
}

// Rows [row0, row0 + n) of any panel, one element per thread: element e of the tile is
// (r, c) = (e / w, e mod w), at base + (row0 + r)·row_stride + c. Consecutive threads read
// consecutive columns of a row, then the next row: coalesced when the stride is small.
template <typename T, int kPitch, int kLoadBatch>
__device__ void load_elements(const Panel& panel, int64_t row0, int n, double* tile) {
  const T* base = static_cast<const T*>(panel.base);
  const int count = n * panel.width;
  for (int e0 = threadIdx.x; e0 < count; e0 += kThreads * kLoadBatch) {
    T loaded[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int e = e0 + u * kThreads;
      if (e < count) loaded[u] = __ldg(base + element_offset(panel, row0, e));  // int64 offset
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int e = e0 + u * kThreads;
      if (e < count) store_element<T, kPitch>(tile, panel, e, loaded[u]);
    }
  }
}

// Asks L2 to fetch rows [row0, row0 + n) of every contiguous panel (one prefetch per
// 128-byte line, spread over the block). Every line named holds at least one byte of the
// panel, so it lies in a mapped page; prefetch is a hint and changes no memory.
template <typename T>
__device__ void prefetch_rows(const PanelSet& panels, int64_t row0, int n) {
  for (int i = 0; i < panels.count; ++i) {
    const Panel& panel = panels.panel[i];
    if (panel.row_stride != panel.width) continue;  // strided panels: not worth the lines
    const auto first =
        reinterpret_cast<uintptr_t>(static_cast<const T*>(panel.base) + row0 * panel.width);
    const uintptr_t last = first + static_cast<uintptr_t>(n) * panel.width * sizeof(T) - 1;
    const uintptr_t first_line = first / 128;
    const int lines = static_cast<int>(last / 128 - first_line + 1);
    for (int l = threadIdx.x; l < lines; l += kThreads) {
      const auto address = reinterpret_cast<const void*>((first_line + l) * 128);
      asm volatile("prefetch.L2 [%0];" ::"l"(address));
    }
  }
}

// Accumulates row r of the tile into the pairs of group kGroup: pair p = (a, b), a ≤ b, in
// packed row-major order; the group owns p ∈ [kGroup·P_g, (kGroup+1)·P_g). The loops are
// fully unrolled, so p and acc's index are compile-time constants and acc stays in
// registers; x_j that the group never uses are never loaded.
template <int M, int kGroup>
__device__ __forceinline__ void accumulate_group(const double* tile, int r, double* acc) {
  constexpr int kPitch = tile_pitch(M);
  constexpr int kPerGroup = pairs_per_group(M);
  constexpr int kFirst = kGroup * kPerGroup;
  double x[M];
#pragma unroll
  for (int j = 0; j < M; ++j) x[j] = tile[j * kPitch + r];
  int p = 0;
#pragma unroll
  for (int a = 0; a < M; ++a) {
#pragma unroll
    for (int b = a; b < M; ++b, ++p) {
      if (p >= kFirst && p < kFirst + kPerGroup) acc[p - kFirst] = fma(x[a], x[b], acc[p - kFirst]);
    }
  }
}

// Run-time group (warp-uniform) → compile-time kGroup.
template <int M, int kGroup = 0>
__device__ __forceinline__ void accumulate_row(const double* tile, int r, int group, double* acc) {
  if constexpr (kGroup < pair_groups(M)) {
    if (group == kGroup) {
      accumulate_group<M, kGroup>(tile, r, acc);
    } else {
      accumulate_row<M, kGroup + 1>(tile, r, group, acc);
    }
  }
}

// Pass 1: block b sums its slab [b·rows_per_block, min((b+1)·rows_per_block, rows)) and
// writes pair p's sum to partials[p·gridDim.x + b]. The host sizes the grid as
// ceil(rows / rows_per_block), so every slab holds at least one row.
template <typename T, int M>
__global__ void __launch_bounds__(kThreads, 2)
    gram_partials_kernel(PanelSet panels, int64_t rows, int64_t rows_per_block, double* partials) {
  constexpr int kRows = tile_rows(M);
  constexpr int kPitch = tile_pitch(M);
  constexpr int kGroups = pair_groups(M);
  constexpr int kPerGroup = pairs_per_group(M);
  constexpr int kPairs = pair_count(M);
  constexpr int kRowStep = kThreads / kGroups;  // rows of a tile one pass of the block covers
  __shared__ double tile[M * kPitch];
  __shared__ double warp_sums[kWarps][kPerGroup];
  static_assert(sizeof(tile) + sizeof(warp_sums) == partials_shared_bytes(M),
                "gram_plan.h's size is the kernel's");

  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int group = warp % kGroups;
  const int first_row = (warp / kGroups) * 32 + lane;  // this thread's rows:
                                                       // first_row + i·kRowStep

  double acc[kPerGroup];
#pragma unroll
  for (int q = 0; q < kPerGroup; ++q) acc[q] = 0.0;

  const int64_t slab_begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t slab_end = min(slab_begin + rows_per_block, rows);
  for (int64_t row0 = slab_begin; row0 < slab_end; row0 += kRows) {
    const int n = static_cast<int>(min(static_cast<int64_t>(kRows), slab_end - row0));
    if (row0 + kRows < slab_end) {
      prefetch_rows<T>(panels, row0 + kRows,
                       static_cast<int>(min(static_cast<int64_t>(kRows), slab_end - row0 - kRows)));
    }
    for (int i = 0; i < panels.count; ++i) {
      if (panels.panel[i].vectorised) {
        load_vectorised<T, kPitch, load_batch(M)>(panels.panel[i], row0, n, tile);
      } else {
        load_elements<T, kPitch, load_batch(M)>(panels.panel[i], row0, n, tile);
      }
    }
    __syncthreads();  // tile complete
    for (int r = first_row; r < n; r += kRowStep) accumulate_row<M>(tile, r, group, acc);
    __syncthreads();  // tile consumed before the next one overwrites it
  }

#pragma unroll
  for (int q = 0; q < kPerGroup; ++q) {
    double v = acc[q];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp][q] = v;
  }
  __syncthreads();
  for (int p = static_cast<int>(threadIdx.x); p < kPairs; p += kThreads) {
    const int g = p / kPerGroup;
    const int q = p - g * kPerGroup;
    double total = 0.0;
    for (int w = g; w < kWarps; w += kGroups) total += warp_sums[w][q];  // group g's warps,
                                                                         // in order
    partials[static_cast<int64_t>(p) * gridDim.x + blockIdx.x] = total;
  }
}

// Pass 2: block p sums partials[p·blocks .. p·blocks + blocks) in a fixed order (strided per
// thread, then a fixed shuffle tree, then warps in order) into gram[p].
__global__ void __launch_bounds__(kThreads) reduce_partials_kernel(const double* partials,
                                                                   int blocks, double* gram) {
  __shared__ double warp_totals[kWarps];
  const double* row = partials + static_cast<int64_t>(blockIdx.x) * blocks;
  double v = 0.0;
  for (int b = static_cast<int>(threadIdx.x); b < blocks; b += kThreads) v += row[b];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) warp_totals[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) total += warp_totals[w];
    gram[blockIdx.x] = total;
  }
}

template <typename T, int M>
cudaError_t launch_for(const PanelSet& panels, int64_t rows, double* workspace, double* gram,
                       cudaStream_t stream) {
  const LaunchShape shape = launch_shape(rows, M);
  gram_partials_kernel<T, M><<<shape.blocks, kThreads, 0, stream>>>(
      panels, rows, shape.rows_per_block, workspace);
  if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  reduce_partials_kernel<<<pair_count(M), kThreads, 0, stream>>>(workspace, shape.blocks, gram);
  return cudaGetLastError();
}

// Run-time m → compile-time M, so the accumulators stay in registers.
template <typename T, int M = 1>
cudaError_t dispatch_columns(const PanelSet& panels, int m, int64_t rows, double* workspace,
                             double* gram, cudaStream_t stream) {
  if constexpr (M > kMaxKernelColumns) {
    return cudaErrorInvalidValue;
  } else {
    if (m == M) return launch_for<T, M>(panels, rows, workspace, gram, stream);
    return dispatch_columns<T, M + 1>(panels, m, rows, workspace, gram, stream);
  }
}

}  // namespace

cudaError_t launch_gram(const ColumnSet& columns, int m, int64_t rows, bool is_fp64,
                        double* workspace, double* gram, cudaStream_t stream) {
  if (m < 1 || m > kMaxKernelColumns || rows < 1 || workspace == nullptr || gram == nullptr) {
    return cudaErrorInvalidValue;
  }
  const size_t element_size = is_fp64 ? sizeof(double) : sizeof(float);
  for (int j = 0; j < m; ++j) {
    if (columns.data[j] == nullptr) return cudaErrorInvalidValue;
    if (reinterpret_cast<uintptr_t>(columns.data[j]) % element_size != 0)
      return cudaErrorMisalignedAddress;
  }
  const PanelSet panels = make_panels(columns, m, element_size);
  return is_fp64 ? dispatch_columns<double>(panels, m, rows, workspace, gram, stream)
                 : dispatch_columns<float>(panels, m, rows, workspace, gram, stream);
}

}  // namespace tidepool::linalg::cuda
