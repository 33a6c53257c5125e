// GPU tests of the Gram kernel (optimizers/linalg/gram_kernels.cu) through the public
// GramAccumulator, whose recompute() hands its columns — any 1-D views — to one Gram pass.
// Each layout exercises one of the kernel's load paths and tails: row-major panels read
// as 16-byte vectors (fp32 and fp64, aligned and not), narrow panels, strided column
// slices, column-major columns, stride-0 columns, 1 to 16 columns (1, 2 and 4 pair
// groups, 512- and 256-row tiles), row counts that are odd, smaller than one vector, and
// large enough that each block walks several tiles. The reference is an fp64 matrix
// product on the CPU; the kernel must match it to fp64 rounding and give bitwise the same
// result when run again. (N·m beyond 2³¹ is covered in gpu_test_lstsq_large.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "optimizers/linalg/gram_accumulator.h"

namespace tidepool::linalg {
namespace {

// The columns of X for one layout: `rows` long, dtype `dtype`, on the GPU.
using Layout = std::function<std::vector<at::Tensor>(int64_t rows, at::ScalarType dtype)>;

struct GramCase {
  std::string name;
  Layout layout;
  int64_t rows;
  at::ScalarType dtype;
};

void PrintTo(const GramCase& c, std::ostream* os) { *os << c.name; }

at::TensorOptions on_gpu(at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(at::kCUDA);
}

std::vector<at::Tensor> columns_of(const at::Tensor& matrix) {
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < matrix.size(1); ++j) columns.push_back(matrix.select(1, j));
  return columns;
}

// Row-major N×k (one panel of width k, stride k) followed by separate 1-D vectors.
Layout row_major_plus_vectors(int64_t k, int64_t vectors) {
  return [k, vectors](int64_t rows, at::ScalarType dtype) {
    auto columns = columns_of(at::randn({rows, k}, on_gpu(dtype)));
    for (int64_t v = 0; v < vectors; ++v) columns.push_back(at::randn({rows}, on_gpu(dtype)));
    return columns;
  };
}

// A row-major N×k matrix and a vector that start `offset` elements into their allocations
// (which are 16-byte aligned): with offset·size not a multiple of 16 the vector loads start
// with a scalar head. (Rows 1..N of an (N+1)×k matrix would not do for k = 4 or 8: the
// offset k·size is then a multiple of 16.)
Layout offset_views(int64_t k, int64_t offset) {
  return [k, offset](int64_t rows, at::ScalarType dtype) {
    const auto flat = at::randn({rows * k + offset}, on_gpu(dtype));
    auto columns = columns_of(flat.narrow(0, offset, rows * k).view({rows, k}));
    columns.push_back(at::randn({rows + offset}, on_gpu(dtype)).narrow(0, offset, rows));
    return columns;
  };
}

// Columns 0..4 and 7 of an N×8 matrix: a width-5 panel with stride 8 and a width-1 panel
// with stride 8 (the strided element path).
Layout column_slices() {
  return [](int64_t rows, at::ScalarType dtype) {
    const auto wide = at::randn({rows, 8}, on_gpu(dtype));
    auto columns = columns_of(wide.narrow(1, 0, 5));
    columns.push_back(wide.select(1, 7));
    return columns;
  };
}

// A column-major N×k matrix (each column contiguous, k separate width-1 panels).
Layout column_major(int64_t k) {
  return [k](int64_t rows, at::ScalarType dtype) {
    return columns_of(at::randn({k, rows}, on_gpu(dtype)).t());
  };
}

// A constant column given as a stride-0 view, between two ordinary ones.
Layout with_stride_zero() {
  return [](int64_t rows, at::ScalarType dtype) {
    return std::vector<at::Tensor>{at::randn({rows}, on_gpu(dtype)),
                                   at::full({1}, 0.75, on_gpu(dtype)).expand({rows}),
                                   at::randn({rows}, on_gpu(dtype))};
  };
}

class GramKernel : public ::testing::TestWithParam<GramCase> {};

TEST_P(GramKernel, MatchesFp64ReferenceAndIsReproducible) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto& param = GetParam();
  at::manual_seed(71);
  const auto columns = param.layout(param.rows, param.dtype);
  const auto m = static_cast<int64_t>(columns.size());
  GramAccumulator accumulator(m);
  std::vector<int64_t> slots;
  for (int64_t j = 0; j < m; ++j) {
    accumulator.set_column(j, columns[static_cast<size_t>(j)]);
    slots.push_back(j);
  }
  accumulator.recompute();  // one Gram pass over the columns as given (views, not copies)
  const auto G = accumulator.gram(slots);
  accumulator.recompute();
  EXPECT_TRUE(at::equal(G, accumulator.gram(slots)))
      << "two runs differ: the reduction order is not fixed";

  const auto X = at::stack(columns, 1).to(at::kCPU, at::kDouble);
  const auto reference = X.t().mm(X);
  // Both sums are fp64 over products that are exact (fp32 input) or correctly rounded:
  // |G_ab − ref_ab| ≤ c·eps64·√N·‖x_a‖‖x_b‖ with room to spare at 1e-12
  // (√N·eps64 ≤ 4e-13).
  const auto diagonal = reference.diagonal();
  const auto scale = (diagonal.unsqueeze(1) * diagonal.unsqueeze(0)).sqrt();
  const double worst = ((G - reference).abs() / scale).max().item<double>();
  EXPECT_LT(worst, 1e-12) << param.name;
}

std::vector<GramCase> gram_cases() {
  std::vector<GramCase> cases;
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const std::string suffix = dtype == at::kDouble ? "_fp64" : "_fp32";
    // m = 9, the AADL/bench shape: one pair group, 512-row tiles; odd N; N > 2048 tiles so
    // every block walks several tiles and the L2 prefetch runs; N below one vector.
    cases.push_back(
        {"row_major_8_plus_1_odd" + suffix, row_major_plus_vectors(8, 1), 100'003, dtype});
    cases.push_back({"row_major_8_plus_1_multi_tile" + suffix, row_major_plus_vectors(8, 1),
                     1'500'007, dtype});
    cases.push_back(
        {"row_major_8_plus_1_three_rows" + suffix, row_major_plus_vectors(8, 1), 3, dtype});
    cases.push_back({"one_row" + suffix, row_major_plus_vectors(4, 1), 1, dtype});
    // Odd widths: 5·4 = 20-byte rows (vectors straddle rows), 3 columns (narrow for fp32,
    // vectorised for fp64), single column.
    cases.push_back({"row_major_5_plus_2" + suffix, row_major_plus_vectors(5, 2), 77'777, dtype});
    cases.push_back({"row_major_3" + suffix, row_major_plus_vectors(3, 0), 65'537, dtype});
    cases.push_back({"single_column" + suffix, row_major_plus_vectors(1, 0), 99'999, dtype});
    cases.push_back({"offset_views_5_by_1" + suffix, offset_views(5, 1), 100'001, dtype});
    cases.push_back({"offset_views_8_by_1" + suffix, offset_views(8, 1), 4'099, dtype});
    cases.push_back({"offset_views_8_by_3" + suffix, offset_views(8, 3), 1'027, dtype});
    cases.push_back({"column_slices" + suffix, column_slices(), 50'001, dtype});
    cases.push_back({"column_major_7" + suffix, column_major(7), 70'001, dtype});
    cases.push_back({"stride_zero" + suffix, with_stride_zero(), 30'011, dtype});
    // Pair groups and tile heights: m = 10 (two groups, 512 rows), 11 (two groups, 256
    // rows), 13 and 16 (four groups, 256 rows).
    cases.push_back({"ten_columns" + suffix, row_major_plus_vectors(9, 1), 40'961, dtype});
    cases.push_back({"eleven_columns" + suffix, row_major_plus_vectors(11, 0), 40'961, dtype});
    cases.push_back({"thirteen_columns" + suffix, row_major_plus_vectors(12, 1), 20'483, dtype});
    cases.push_back({"sixteen_columns" + suffix, row_major_plus_vectors(13, 3), 600'011, dtype});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, GramKernel, ::testing::ValuesIn(gram_cases()),
                         [](const ::testing::TestParamInfo<GramCase>& test) {
                           return test.param.name;
                         });

}  // namespace
}  // namespace tidepool::linalg
