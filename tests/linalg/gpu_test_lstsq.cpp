// GPU tests of tidepool::linalg::lstsq (ctest label gpu; each test skips itself without a
// CUDA device): CPU and CUDA give the same answer (1e-10 fp64, 1e-6 fp32, κ ≤ 1e6) on every
// method, N·k beyond 2³¹ elements works on the Gram kernel and on cuSOLVER's 64-bit QR,
// and GramAccumulator on device columns equals the host result.
#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "optimizers/linalg/gram_accumulator.h"
#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg {
namespace {

using testing::matrix_with_condition;
using testing::relative_error;

#define TIDEPOOL_REQUIRE_GPU()                                      \
  do {                                                              \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

struct AgreementCase {
  at::ScalarType dtype;
  double condition;
  LstsqMethod method;
};

void PrintTo(const AgreementCase& c, std::ostream* os) {
  *os << at::toString(c.dtype) << " κ=" << c.condition << " " << method_name(c.method);
}

class LstsqCpuCudaAgreement : public ::testing::TestWithParam<AgreementCase> {};

TEST_P(LstsqCpuCudaAgreement, SameAnswerOnBothDevices) {
  TIDEPOOL_REQUIRE_GPU();
  const auto param = GetParam();
  const auto A = matrix_with_condition(200000, 8, param.condition, 31).to(param.dtype);
  // Consistent right-hand sides: with a residual, the problem's own sensitivity
  // (κ²·‖r‖/‖x‖·eps64) lets any two correct computations differ by more than 1e-10 at κ = 1e6.
  at::manual_seed(32);
  const auto B = A.to(at::kDouble).mm(at::randn({8, 2}, at::kDouble)).to(param.dtype);
  LstsqOptions options;
  options.method = param.method;
  const auto on_cpu = lstsq(A, B, options);
  const auto on_cuda = lstsq(A.cuda(), B.cuda(), options);
  EXPECT_TRUE(on_cuda.solution.is_cuda());
  EXPECT_EQ(on_cuda.method, on_cpu.method);
  EXPECT_EQ(on_cuda.rank, on_cpu.rank);
  const double tolerance = param.dtype == at::kDouble ? 1e-10 : 1e-6;
  EXPECT_LT(relative_error(on_cuda.solution, on_cpu.solution), tolerance)
      << "method " << on_cpu.method_name << " κ " << param.condition;
  EXPECT_NEAR(on_cuda.residual_norm, on_cpu.residual_norm, 1e-8 * B.norm().item<double>());
}

std::vector<AgreementCase> agreement_cases() {
  std::vector<AgreementCase> cases;
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const double condition : {1.0, 1e3, 1e6}) {
      for (const auto method : {LstsqMethod::automatic, LstsqMethod::cholesky_qr, LstsqMethod::svd}) {
        cases.push_back({dtype, condition, method});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(UpTo1e6, LstsqCpuCudaAgreement, ::testing::ValuesIn(agreement_cases()),
                         [](const ::testing::TestParamInfo<AgreementCase>& test) {
                           return std::string(test.param.dtype == at::kDouble ? "fp64_" : "fp32_") +
                                  method_name(test.param.method) + "_" + std::to_string(test.index);
                         });

TEST(LstsqCuda, StreamingColumnsOnDeviceEqualDense) {
  TIDEPOOL_REQUIRE_GPU();
  const auto A = matrix_with_condition(100000, 20, 10.0, 33).cuda();  // 21 columns: cuBLAS path
  const auto b = at::randn({100000}, at::TensorOptions().dtype(at::kDouble).device(at::kCUDA));
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < 20; ++j) columns.push_back(A.select(1, j).contiguous());
  const auto dense = lstsq(A, b);
  const auto streamed = lstsq_columns(columns, b);
  EXPECT_LT(relative_error(streamed.solution, dense.solution), 1e-12);
  EXPECT_LT(relative_error(dense.solution, lstsq(A.cpu(), b.cpu()).solution), 1e-10);
}

// 268,435,456 × 9 fp32 = 2.4e9 elements > 2³¹ (9.7 GB): the Gram kernel's 64-bit indexing.
TEST(LstsqCuda, GramPathBeyond2To31Elements) {
  TIDEPOOL_REQUIRE_GPU();
  const int64_t rows = int64_t{1} << 28;
  at::manual_seed(34);
  const auto A = at::randn({rows, 9}, at::TensorOptions().device(at::kCUDA));
  const auto x = at::linspace(1.0, 9.0, 9, at::TensorOptions().device(at::kCUDA));
  const auto result = lstsq(A, A.mv(x));
  EXPECT_EQ(result.method, LstsqMethod::gram_cholesky);
  EXPECT_LT(relative_error(result.solution, x), 1e-6);
}

// 2³¹/8 + 4096 rows × 8 fp64 through cuSOLVER's 64-bit Xgeqrf (torch's CUDA QR fails here).
TEST(LstsqCuda, SvdPathBeyond2To31Elements) {
  TIDEPOOL_REQUIRE_GPU();
  const int64_t rows = (int64_t{1} << 28) + 4096;
  at::manual_seed(35);
  const auto A = at::randn({rows, 8}, at::TensorOptions().device(at::kCUDA));
  const auto x = at::linspace(-1.0, 1.0, 8, at::TensorOptions().device(at::kCUDA));
  LstsqOptions options;
  options.method = LstsqMethod::svd;
  const auto result = lstsq(A, A.mv(x), options);
  EXPECT_EQ(result.rank, 8);
  EXPECT_LT(relative_error(result.solution, x), 1e-6);
}

TEST(LstsqCuda, RankDeficientMinimumNormMatchesCpu) {
  TIDEPOOL_REQUIRE_GPU();
  at::manual_seed(36);
  auto A = at::randn({50000, 5}, at::kDouble);
  A.select(1, 4).copy_(A.select(1, 1));
  A.select(1, 2).zero_();
  const auto b = at::randn({50000}, at::kDouble);
  const auto on_cpu = lstsq(A, b);
  const auto on_cuda = lstsq(A.cuda(), b.cuda());
  EXPECT_EQ(on_cuda.rank, 3);
  EXPECT_EQ(on_cuda.method, LstsqMethod::svd);
  EXPECT_LT(relative_error(on_cuda.solution, on_cpu.solution), 1e-10);
}

TEST(LstsqCuda, MixedDevicesAreRejected) {
  TIDEPOOL_REQUIRE_GPU();
  const auto A = at::randn({100, 3});
  EXPECT_THROW(lstsq(A, at::randn({100}).cuda()), std::invalid_argument);
  EXPECT_THROW(lstsq_columns({A.select(1, 0).cuda(), A.select(1, 1)}, at::randn({100}).cuda()),
               std::invalid_argument);
}

TEST(GramAccumulatorCuda, DeviceColumnsMatchHostColumns) {
  TIDEPOOL_REQUIRE_GPU();
  GramAccumulator on_host(4);
  GramAccumulator on_device(4);
  at::manual_seed(37);
  for (int64_t j = 0; j < 4; ++j) {
    const auto column = at::randn({300000});
    on_host.set_column(j, column);
    on_device.set_column(j, column.cuda());
  }
  EXPECT_LT(relative_error(on_device.gram({0, 1, 2, 3}), on_host.gram({0, 1, 2, 3})), 1e-12);
  EXPECT_LT(relative_error(on_device.solve({0, 1, 2}, 3).solution, on_host.solve({0, 1, 2}, 3).solution), 1e-10);
}

}  // namespace
}  // namespace tidepool::linalg
