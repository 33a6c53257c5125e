// CPU tests of what tidepool::linalg::lstsq takes and gives back beyond the shapes and
// dtypes (test_lstsq.cpp): sparse input and an rcond that would drop every direction are
// clear errors, and no route builds an autograd graph.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "optimizers/linalg/gram_accumulator.h"
#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg {
namespace {

using testing::expect_invalid;

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

constexpr LstsqMethod kAllMethods[] = {LstsqMethod::automatic, LstsqMethod::gram_cholesky,
                                       LstsqMethod::cholesky_qr, LstsqMethod::svd,
                                       LstsqMethod::gram_eigh};

// A sparse tensor passed the checks and failed deep in the Gram pass or a copy with a
// c10::Error that named neither the argument nor what to do.
TEST(LstsqInputs, SparseTensorsAreRefusedNamingTheArgument) {
  const auto A = at::randn({5000, 3}, kF64);
  const auto b = at::randn({5000}, kF64);
  expect_invalid([&] { lstsq(A.to_sparse(), b); }, "A is a Sparse tensor");
  expect_invalid([&] { lstsq(A, b.to_sparse()); }, "B is a Sparse tensor");
  expect_invalid([&] { lstsq_columns({A.select(1, 0), A.select(1, 1).to_sparse()}, b); },
                 "column 1 is a Sparse tensor");
  expect_invalid([&] { lstsq(A.to_sparse(), b); }, "to_dense()");
}

// rcond·σ_max at or above σ_max drops every direction: x = 0 at rank 0 (or, forced
// gram_cholesky, a runtime_error about rank 0) for any A, an orthonormal one included.
TEST(LstsqInputs, AnRcondOfOneOrMoreIsRefused) {
  const auto A = at::randn({1000, 3}, kF64);
  const auto b = at::randn({1000}, kF64);
  for (const double rcond : {1.0, 2.0, 1e300}) {
    for (const auto method : kAllMethods) {
      LstsqOptions options;
      options.rcond = rcond;
      options.method = method;
      expect_invalid([&] { lstsq(A, b, options); }, "rcond must be below 1");
    }
  }
  LstsqOptions just_below;
  just_below.rcond = 0.5;
  EXPECT_NO_THROW(lstsq(A, b, just_below));
}

// The Gram route read raw memory (no grad), the SVD and CholeskyQR routes built graphs
// with ATen ops (grad, wrong where cuSOLVER wrote through data_ptr, and holding several
// fp64 N×k copies for backward): now no route records anything.
TEST(LstsqInputs, NoRouteBuildsAnAutogradGraph) {
  const auto A = at::randn({5000, 3}, kF64).requires_grad_();
  const auto b = at::randn({5000}, kF64).requires_grad_();
  for (const auto method : kAllMethods) {
    LstsqOptions options;
    options.method = method;
    const auto result = lstsq(A, b, options);
    EXPECT_FALSE(result.solution.requires_grad()) << method_name(method);
    EXPECT_EQ(result.solution.grad_fn(), nullptr) << method_name(method);
    const auto columns = lstsq_columns({A.select(1, 0), A.select(1, 1), A.select(1, 2)}, b,
                                       options);
    EXPECT_FALSE(columns.solution.requires_grad()) << method_name(method);
  }
}

// Note [Negative views] in lstsq.cpp: a tensor whose negative bit is set (x.conj().imag()
// of a complex x) reads as -memory. The Gram route read the memory and came out with the
// sign of x flipped, while the SVD route got it right.
TEST(LstsqInputs, NegativeViewsGiveTheSameAnswerOnEveryRoute) {
  const auto A = at::randn({5000, 3}, kF64);
  const auto x = at::tensor({1.0, -2.0, 3.0}, kF64);
  const auto b = A.mv(x);
  const auto negative_A = at::_neg_view(-A);
  const auto negative_b = at::_neg_view(-b);
  ASSERT_TRUE(negative_A.is_neg() && negative_b.is_neg());
  for (const auto method : kAllMethods) {
    LstsqOptions options;
    options.method = method;
    for (const auto& [a, rhs] : {std::pair{negative_A, b}, std::pair{A, negative_b},
                                 std::pair{negative_A, negative_b}}) {
      const auto solution = lstsq(a, rhs, options).solution;
      EXPECT_LT((solution - x).abs().max().item<double>(), 1e-12) << method_name(method);
    }
    const auto columns = lstsq_columns({negative_A.select(1, 0), A.select(1, 1),
                                        negative_A.select(1, 2)}, negative_b, options);
    EXPECT_LT((columns.solution - x).abs().max().item<double>(), 1e-12) << method_name(method);
  }
  GramAccumulator accumulator(2);
  accumulator.set_column(0, negative_A.select(1, 0));
  accumulator.set_column(1, A.select(1, 1));
  const double cross = A.select(1, 0).dot(A.select(1, 1)).item<double>();
  EXPECT_NEAR(accumulator.inner_product(0, 1), cross, 1e-9 * std::abs(cross) + 1e-9);
}

}  // namespace
}  // namespace tidepool::linalg
