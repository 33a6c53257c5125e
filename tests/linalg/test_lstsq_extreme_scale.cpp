// CPU tests of lstsq on finite fp64 data at the edges of the fp64 range, where a square or
// a sum of squares overflows or underflows although every Gram entry itself is finite:
// the condition estimate and method choice must not depend on the data's units, and a
// relative Tikhonov λ that overflows must be refused by every method alike.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg {
namespace {

using testing::expect_invalid;
using testing::matrix_with_condition;
using testing::relative_error;

constexpr LstsqMethod kAllMethods[] = {LstsqMethod::automatic, LstsqMethod::gram_cholesky,
                                       LstsqMethod::cholesky_qr, LstsqMethod::svd,
                                       LstsqMethod::gram_eigh};

// Review finding: the Jacobi eigenvalue routine summed ‖G‖²_F unscaled, which overflows for
// Gram entries ≳ 1.3e154 (tolerance inf: no sweep) and underflows for entries ≲ 1e-162
// (off-diagonal mass 0: no sweep), so G's diagonal came back as its eigenvalues. Without
// equilibration this κ = 1e7 problem then read as κ ≈ 7.5 and was solved by gram_cholesky
// to 3e-3; unscaled it goes to cholesky_qr and is good to ~7e-11.
TEST(LstsqExtremeScale, ConditionEstimateDoesNotDependOnUnits) {
  constexpr double kCondition = 1e7;
  const auto A = matrix_with_condition(10000, 3, kCondition, 48);
  const auto x = testing::values({1.0, 2.0, 3.0});
  for (const double scale : {1e78, 1e-85}) {
    const auto scaled = A * scale;
    LstsqOptions options;
    options.equilibrate = false;
    const auto result = lstsq(scaled, scaled.mv(x), options);
    EXPECT_NE(result.method, LstsqMethod::gram_cholesky) << scale;
    EXPECT_GT(result.condition, 1e6) << scale;
    EXPECT_LT(result.condition, 1e8) << scale;
    EXPECT_EQ(result.rank, 3) << scale;
    // A QR route's accuracy, as in LstsqCondition.RecoversKnownSolutionToConditionTimesEps.
    EXPECT_LT(relative_error(result.solution, x),
              100.0 * std::numeric_limits<double>::epsilon() * kCondition)
        << scale << " " << result.method_name;
  }
}

// Review finding: each G_jj is finite (‖a_j‖ = 1.2e154) but trace(AᵀA) is not, so a
// relative λ was +inf: svd refused, but forced cholesky_qr and gram_eigh silently returned
// x = 0 at rank 0 and gram_cholesky called AᵀA "not positive definite".
TEST(LstsqExtremeScale, RelativeTikhonovWhoseTraceOverflowsIsRefusedByEveryMethod) {
  at::manual_seed(49);
  auto A = at::randn({1000, 2}, at::kDouble);
  A = A / A.norm(2, {0}, /*keepdim=*/true) * 1.2e154;
  const auto b = 0.5 * A.select(1, 0) + 0.25 * A.select(1, 1);
  for (const auto method : kAllMethods) {
    LstsqOptions options;
    options.method = method;
    options.tikhonov = 1e-6;
    options.tikhonov_relative = true;
    SCOPED_TRACE(method_name(method));
    expect_invalid([&] { lstsq(A, b, options); }, "overflows");
    // An absolute λ needs no trace: the same problem is solvable.
    options.tikhonov_relative = false;
    EXPECT_NO_THROW(lstsq(A, b, options));
  }
}

// Review finding: the SVD route took a relative λ from the sum of the squared column
// norms, which is 0 for columns below ~1e-162: the regularisation was silently dropped
// for exactly the tiny problems automatic sends there. Relative Tikhonov does not depend
// on the units: A and b scaled alike give the same x, rank and condition.
TEST(LstsqExtremeScale, RelativeTikhonovOfTinyColumnsIsNotDropped) {
  at::manual_seed(50);
  auto A = at::randn({50, 3}, at::kDouble);
  A.select(1, 2).copy_(A.select(1, 0));  // rank 2: λ decides the answer
  const auto b = at::randn({50}, at::kDouble);
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd}) {
    LstsqOptions options;
    options.method = method;
    options.tikhonov = 1e-2;
    const auto reference = lstsq(A, b, options);
    const auto tiny = lstsq(A * 1e-170, b * 1e-170, options);
    SCOPED_TRACE(method_name(method));
    EXPECT_EQ(tiny.rank, reference.rank);
    EXPECT_EQ(tiny.rank, 3) << "regularised, [A; √λ·D] has full rank";
    EXPECT_LT(relative_error(tiny.solution, reference.solution), 1e-10);
    EXPECT_NEAR(tiny.condition / reference.condition, 1.0, 1e-8);
  }
}

// Review finding: the Gram residual √(bᵀb − 2xᵀAᵀb + xᵀAᵀAx) doubled xᵀAᵀb ≈ 1.1e308,
// which overflows although bᵀb and every Gram entry are finite: the square became −inf
// and the residual read 0 (with two columns, inf − inf: NaN, which the Frobenius norm
// dropped). The residual here is 0.45e152·√5000 ≈ 3.2e153, on every Gram route.
TEST(LstsqExtremeScale, AGramResidualWhoseTermsOverflowIsMeasuredDirectly) {
  constexpr int64_t kRows = 5000;
  auto alternating = at::empty({kRows}, at::kDouble);
  auto pairs = at::empty({kRows}, at::kDouble);
  for (int64_t i = 0; i < kRows; ++i) {
    alternating[i] = i % 2 == 0 ? 1.0 : -1.0;
    pairs[i] = i % 4 < 2 ? 1.0 : -1.0;
  }
  const auto b = 1.5e152 * (1.0 + 0.3 * alternating);
  const double expected = 0.45e152 * std::sqrt(static_cast<double>(kRows));
  const auto one_column = at::full({kRows, 1}, 1e-150, at::kDouble);
  const auto two_columns = at::stack({at::full({kRows}, 1e-150, at::kDouble), 1e-150 * pairs}, 1);
  for (const auto& A : {one_column, two_columns}) {
    for (const auto method :
         {LstsqMethod::automatic, LstsqMethod::gram_cholesky, LstsqMethod::gram_eigh}) {
      LstsqOptions options;
      options.method = method;
      const auto result = lstsq(A, b, options);
      SCOPED_TRACE(std::string(method_name(method)) + ", " + std::to_string(A.size(1)) +
                   " columns");
      EXPECT_NEAR(result.solution[0].item<double>() / 1.5e302, 1.0, 1e-12);
      ASSERT_EQ(result.residual_norms.size(), 1u);
      EXPECT_NEAR(result.residual_norms[0] / expected, 1.0, 1e-10);
      EXPECT_NEAR(result.residual_norm / expected, 1.0, 1e-10);
    }
  }
}

// Review finding: under equilibration a zero column kept scale 1, so with a relative λ its
// regularisation entry was λ where every other column's was λ/‖a_j‖²: the rank, κ and the
// method chosen followed A's units (forced gram_cholesky refused A·1e-7 as rank 2, and
// solved A·1e-2). It now takes the columns' mean scale, and nothing depends on the units.
TEST(LstsqExtremeScale, AZeroColumnWithRelativeTikhonovDoesNotDependOnUnits) {
  at::manual_seed(51);
  auto A = at::randn({10000, 3}, at::kDouble);
  A.select(1, 2).zero_();
  const auto b = at::randn({10000}, at::kDouble);
  // Not forced cholesky_qr: it factors A itself, and breaks down on the zero column at
  // every scale (the regularisation enters only after the factorisation).
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::gram_cholesky,
                            LstsqMethod::svd, LstsqMethod::gram_eigh}) {
    LstsqOptions options;
    options.method = method;
    options.tikhonov = 1e-6;
    options.tikhonov_relative = true;
    SCOPED_TRACE(method_name(method));
    const auto reference = lstsq(A, b, options);
    EXPECT_EQ(reference.solution[2].item<double>(), 0.0);
    for (const double units : {1e-7, 1e-2, 1e3}) {
      SCOPED_TRACE(units);
      const auto scaled = lstsq(A * units, b * units, options);
      EXPECT_EQ(scaled.method, reference.method);
      EXPECT_EQ(scaled.rank, reference.rank);
      EXPECT_NEAR(scaled.condition / reference.condition, 1.0, 1e-8);
      EXPECT_LT(relative_error(scaled.solution, reference.solution), 1e-10);
    }
  }
}

}  // namespace
}  // namespace tidepool::linalg
