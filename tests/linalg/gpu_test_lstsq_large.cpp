// GPU tests of tidepool::linalg::lstsq beyond 2³¹ elements (ctest label gpu; each test
// skips itself without a CUDA device): the Gram kernel's 64-bit indexing and the SVD path's
// TSQR over cuSOLVER's 64-bit QR. They hold 10-62 GiB of device memory each, so this file's
// tests run alone (RUN_SERIAL, tests/CMakeLists.txt: files named *_large.cpp): two of
// them side by side under `ctest -j` would not fit an 80 GB GPU.
#include <gtest/gtest.h>

#include <string>

#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg {
namespace {

using testing::relative_error;

#define TIDEPOOL_REQUIRE_GPU()                          \
  do {                                                  \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// b = A·x as a sum of scaled columns: nine elementwise kernels over 2²⁸-element views,
// instead of one cuBLAS gemv over all of A. For the problems beyond 2³¹ elements below,
// gemv would see j·lda past 2³¹ (n = 2²⁸ columns of A in its column-major view), a size
// no test here has run before — the test must fail only if tidepool is wrong.
at::Tensor product_by_columns(const at::Tensor& A, const at::Tensor& x) {
  const auto x_host = x.to(at::kCPU, at::kDouble);
  auto b = A.select(1, 0) * x_host[0].item<double>();
  for (int64_t j = 1; j < A.size(1); ++j) b.add_(A.select(1, j), x_host[j].item<double>());
  return b;
}

// (2²⁸ + 3) × 9 = 2.4e9 elements > 2³¹, fp32 (9.7 GB) and fp64 (19 GB): the Gram kernel's
// 64-bit indexing. A is rows 1.. of a larger matrix, so its data pointer is 36 (fp32) or
// 72 (fp64) bytes into the allocation, not 16-byte aligned: the loads start with a
// scalar head, and the odd row count leaves a tail.
class LstsqCudaBeyond2To31 : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(LstsqCudaBeyond2To31, GramPathSolvesOddOffsetProblem) {
  TIDEPOOL_REQUIRE_GPU();
  const auto dtype = GetParam();
  const int64_t rows = (int64_t{1} << 28) + 3;
  const int64_t k = 9;
  at::manual_seed(34);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCUDA);
  const auto A = at::randn({rows + 1, k}, options).narrow(0, 1, rows);
  ASSERT_GT(rows * (k + 1), int64_t{1} << 31);
  const auto x = at::linspace(1.0, static_cast<double>(k), k, options);
  const auto result = lstsq(A, product_by_columns(A, x));
  EXPECT_EQ(result.method, LstsqMethod::gram_cholesky);
  EXPECT_LT(relative_error(result.solution, x), dtype == at::kFloat ? 1e-6 : 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LstsqCudaBeyond2To31, ::testing::Values(at::kFloat, at::kDouble),
                         [](const ::testing::TestParamInfo<at::ScalarType>& test) {
                           return std::string(test.param == at::kDouble ? "fp64" : "fp32");
                         });

// (2²⁸ + 4096) × 8 fp32, so [A·D | b] is 2.4e9 fp64 elements: the SVD path's TSQR over
// row chunks of cuSOLVER's Xgeqrf (one Xgeqrf over all of it faulted on the H200; torch's
// CUDA QR fails here). 2²⁷/9 = 14,913,080-row chunks: 18 full ones and one of 4,112 rows.
TEST(LstsqCuda, SvdPathBeyond2To31Elements) {
  TIDEPOOL_REQUIRE_GPU();
  const int64_t rows = (int64_t{1} << 28) + 4096;
  at::manual_seed(35);
  const auto A = at::randn({rows, 8}, at::TensorOptions().device(at::kCUDA));
  const auto x = at::linspace(-1.0, 1.0, 8, at::TensorOptions().device(at::kCUDA));
  LstsqOptions options;
  options.method = LstsqMethod::svd;
  const auto result = lstsq(A, product_by_columns(A, x), options);
  EXPECT_EQ(result.rank, 8);
  EXPECT_LT(relative_error(result.solution, x), 1e-6);
}

}  // namespace
}  // namespace tidepool::linalg
