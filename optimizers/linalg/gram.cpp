// The Gram pass of lstsq: G = XᵀX for X = [A | B] given as column vectors, fp64 accumulation,
// one read of X, never more than one block of rows upcast at a time.
//
// Why fp64 accumulation: summing 2e7 fp32 products in fp32 loses ~3e-2 relative, which is
// the error torch's fp32 LAPACK drivers show on the 2e7×5 problem. Every element is
// upcast before it is multiplied, so the only rounding is fp64's (~1e-16·√blocks).
//
// CPU: gram_cpu.cpp's loop over raw column pointers (threads over fixed row chunks).
// CUDA: gram_kernels.cu reads X once (coalesced 16-byte loads, fp64 accumulation, a
// deterministic two-pass reduction on the device) when m ≤ 16. Wider sets fall back to
// blocks of rows stacked, upcast and multiplied with cuBLAS fp64 gemm (more traffic: AADL
// with ≥ 16 history columns lands here; a kernel for m ≤ 32 would need its pair groups
// spread over more warps).
#include "optimizers/linalg/gram.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "optimizers/linalg/gram_cpu.h"
#include "optimizers/linalg/small_solve.h"

#if TIDEPOOL_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "optimizers/linalg/gram_kernels.h"
#endif

namespace tidepool::linalg::detail {
namespace {

constexpr int64_t kCpuBlockRows = int64_t{1} << 15;
constexpr int64_t kCudaBlockRows = int64_t{1} << 22;

int64_t block_rows_for(const at::Tensor& column) {
  return column.is_cuda() ? kCudaBlockRows : kCpuBlockRows;
}

// The CPU loop and the CUDA kernel read raw pointers (the kernel's data_ptr() checks no
// dtype), so a column of another dtype, device or length would be read as garbage or fault
// instead of being rejected. The public entry points validate their input; this guards
// every caller of this file, for the cost of a loop over ≤ ~32 tensors.
void check_columns(const std::vector<at::Tensor>& columns) {
  const auto& first = columns.front();
  if (first.scalar_type() != at::kFloat && first.scalar_type() != at::kDouble) {
    throw std::invalid_argument(
        std::string("tidepool::linalg: the Gram pass takes float32 or float64 columns, got ") +
        c10::toString(first.scalar_type()));
  }
  for (const auto& column : columns) {
    if (column.dim() != 1 || column.size(0) != first.size(0) ||
        column.scalar_type() != first.scalar_type() || column.device() != first.device()) {
      throw std::invalid_argument(
          "tidepool::linalg: the Gram pass needs 1-D columns of one length, dtype and device");
    }
  }
}

// Rows [begin, begin+count) of every column, side by side, as a (count × m) fp64 block.
at::Tensor fp64_block(const std::vector<at::Tensor>& columns, int64_t begin, int64_t count) {
  std::vector<at::Tensor> slices;
  slices.reserve(columns.size());
  for (const auto& column : columns) slices.push_back(column.narrow(0, begin, count));
  return at::stack(slices, 1).to(at::kDouble);
}

at::Tensor blocked_gram(const std::vector<at::Tensor>& columns) {
  const int64_t rows = columns.front().size(0);
  const int64_t m = static_cast<int64_t>(columns.size());
  const int64_t block = block_rows_for(columns.front());
  auto G = at::zeros({m, m}, columns.front().options().dtype(at::kDouble));
  for (int64_t begin = 0; begin < rows; begin += block) {
    const auto X = fp64_block(columns, begin, std::min(block, rows - begin));
    G.addmm_(X.t(), X);
  }
  return G.cpu();
}

// Raw pointers and strides of 1-D CPU columns of dtype T.
template <typename T>
std::pair<std::vector<const T*>, std::vector<int64_t>> raw_columns(
    const std::vector<at::Tensor>& columns) {
  std::pair<std::vector<const T*>, std::vector<int64_t>> raw;
  for (const auto& column : columns) {
    raw.first.push_back(column.data_ptr<T>());
    raw.second.push_back(column.stride(0));
  }
  return raw;
}

template <typename T>
at::Tensor host_gram(const std::vector<at::Tensor>& columns) {
  const int m = static_cast<int>(columns.size());
  std::vector<std::pair<int, int>> pairs;
  for (int a = 0; a < m; ++a) {
    for (int b = a; b < m; ++b) pairs.emplace_back(a, b);
  }
  const auto [data, stride] = raw_columns<T>(columns);
  const auto sums = cpu_inner_products<T>(data, stride, columns.front().size(0), pairs);
  auto G = at::empty({m, m}, at::kDouble);
  auto g = G.accessor<double, 2>();
  for (size_t p = 0; p < pairs.size(); ++p) {
    g[pairs[p].first][pairs[p].second] = sums[p];
    g[pairs[p].second][pairs[p].first] = sums[p];
  }
  return G;
}

// ⟨columns[0], columns[j]⟩ for every j.
template <typename T>
at::Tensor host_dots(const std::vector<at::Tensor>& columns) {
  std::vector<std::pair<int, int>> pairs;
  for (int j = 1; j < static_cast<int>(columns.size()); ++j) pairs.emplace_back(0, j);
  const auto [data, stride] = raw_columns<T>(columns);
  const auto sums = cpu_inner_products<T>(data, stride, columns.front().size(0), pairs);
  return at::tensor(at::ArrayRef<double>(sums), at::TensorOptions().dtype(at::kDouble));
}

#if TIDEPOOL_HAVE_CUDA
// One pass of gram_kernels.cu: per-block partials and their fixed-order reduction both run
// on the device; only the m(m+1)/2 sums cross to the host.
at::Tensor kernel_gram(const std::vector<at::Tensor>& columns) {
  const auto& first = columns.front();
  const c10::cuda::CUDAGuard guard(first.device());
  const int m = static_cast<int>(columns.size());
  const int64_t rows = first.size(0);
  const int64_t pairs = m * (m + 1) / 2;
  cuda::ColumnSet set{};
  for (int j = 0; j < m; ++j) {
    set.data[j] = columns[j].data_ptr();
    set.stride[j] = columns[j].stride(0);
  }
  // Workspace (partials, then the packed triangle) from the PyTorch caching allocator
  // (tidepool's allocator has no C++ entry point for optimizers/ yet); it is returned when
  // `workspace` goes out of scope, stream-ordered.
  const int64_t partial_doubles = cuda::gram_workspace_doubles(rows, m);
  auto workspace = at::empty({partial_doubles + pairs}, first.options().dtype(at::kDouble));
  double* partials = workspace.data_ptr<double>();
  const cudaError_t status =
      cuda::launch_gram(set, m, rows, first.scalar_type() == at::kDouble, partials,
                        partials + partial_doubles, c10::cuda::getCurrentCUDAStream());
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("tidepool::linalg: Gram kernel launch failed: ") +
                             cudaGetErrorString(status));
  }
  const auto packed = workspace.narrow(0, partial_doubles, pairs).cpu();  // synchronises
  const double* sums = packed.data_ptr<double>();
  auto G = at::empty({m, m}, at::kDouble);
  auto g = G.accessor<double, 2>();
  int64_t pair = 0;
  for (int a = 0; a < m; ++a) {
    for (int b = a; b < m; ++b, ++pair) {
      g[a][b] = sums[pair];
      g[b][a] = sums[pair];
    }
  }
  return G;
}
#endif

}  // namespace

int64_t underflowing_column(const std::vector<at::Tensor>& columns, const at::Tensor& G,
                            int64_t first) {
  const double limit =
      static_cast<double>(columns.front().size(0)) * std::numeric_limits<double>::min();
  const auto diagonal = G.diagonal().contiguous();
  const double* d = diagonal.data_ptr<double>() + first;
  for (size_t j = 0; j < columns.size(); ++j) {
    if (d[j] >= limit) continue;
    if (d[j] > 0.0 || columns[j].ne(0).any().item<bool>()) return static_cast<int64_t>(j);
  }
  return -1;
}

int64_t underflowing_cross_products(const std::vector<at::Tensor>& a_columns,
                                    const std::vector<at::Tensor>& b_columns,
                                    const at::Tensor& G) {
  const auto k = static_cast<int64_t>(a_columns.size());
  if (underflowing_column(b_columns, G, k) < 0) return -1;
  const double limit =
      static_cast<double>(a_columns.front().size(0)) * std::numeric_limits<double>::min();
  const auto diagonal = G.diagonal().contiguous();
  const double* d = diagonal.data_ptr<double>();
  double smallest_a = std::numeric_limits<double>::infinity();  // of the nonzero columns
  for (int64_t j = 0; j < k; ++j) {
    if (d[j] > 0.0) smallest_a = std::min(smallest_a, std::sqrt(d[j]));
  }
  // ‖b_c‖ measured without squaring it (rescaled blocks): the residual of x = 0.
  const auto zero = at::zeros({k, static_cast<int64_t>(b_columns.size())},
                              at::TensorOptions().dtype(at::kDouble));
  const std::vector<double> b_norms = direct_residual_norms(a_columns, b_columns, zero);
  for (size_t c = 0; c < b_columns.size(); ++c) {
    if (b_norms[c] > 0.0 && smallest_a * b_norms[c] < limit) return static_cast<int64_t>(c);
  }
  return -1;
}

std::vector<at::Tensor> columns_of(const at::Tensor& matrix) {
  std::vector<at::Tensor> columns;
  columns.reserve(static_cast<size_t>(matrix.size(1)));
  for (int64_t j = 0; j < matrix.size(1); ++j) columns.push_back(matrix.select(1, j));
  return columns;
}

at::Tensor gram_of_columns(const std::vector<at::Tensor>& columns) {
  if (columns.empty()) throw std::invalid_argument("tidepool::linalg: Gram of zero columns");
  check_columns(columns);
#if TIDEPOOL_HAVE_CUDA
  if (columns.front().is_cuda() && static_cast<int>(columns.size()) <= cuda::kMaxKernelColumns) {
    return kernel_gram(columns);
  }
#endif
  if (columns.front().is_cpu()) {
    return columns.front().scalar_type() == at::kDouble ? host_gram<double>(columns)
                                                        : host_gram<float>(columns);
  }
  return blocked_gram(columns);
}

at::Tensor dots_with(const at::Tensor& v, const std::vector<at::Tensor>& columns) {
  const int64_t rows = v.size(0);
  const int64_t m = static_cast<int64_t>(columns.size());
  if (m == 0) return at::zeros({0}, at::kDouble);
  std::vector<at::Tensor> all{v};
  all.insert(all.end(), columns.begin(), columns.end());
  check_columns(all);
  if (v.is_cpu()) {
    return v.scalar_type() == at::kDouble ? host_dots<double>(all) : host_dots<float>(all);
  }
  const int64_t block = block_rows_for(v);
  auto dots = at::zeros({m}, v.options().dtype(at::kDouble));
  for (int64_t begin = 0; begin < rows; begin += block) {
    const int64_t count = std::min(block, rows - begin);
    const auto X = fp64_block(columns, begin, count);
    dots.addmv_(X.t(), v.narrow(0, begin, count).to(at::kDouble));
  }
  return dots.cpu();
}

std::vector<double> direct_residual_norms(const std::vector<at::Tensor>& a_columns,
                                          const std::vector<at::Tensor>& b_columns,
                                          const at::Tensor& x) {
  const auto& first = b_columns.front();
  const int64_t rows = first.size(0);
  const int64_t block = block_rows_for(first);
  const auto x_here = x.to(first.device());
  // Norms, not sums of squares: residual entries below ~1e-154 square to subnormals or 0 in
  // fp64 (a residual of 7e-162 came out as 0). column_norms() rescales each block before it
  // squares, and hypot combines the blocks' norms without squaring them.
  auto norms = at::zeros({static_cast<int64_t>(b_columns.size())},
                         first.options().dtype(at::kDouble));
  for (int64_t begin = 0; begin < rows; begin += block) {
    const int64_t count = std::min(block, rows - begin);
    const auto residual =
        fp64_block(b_columns, begin, count) - fp64_block(a_columns, begin, count).mm(x_here);
    norms = at::hypot(norms, column_norms(residual));
  }
  const auto host = norms.cpu();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}

}  // namespace tidepool::linalg::detail
