// CPU tests of tidepool::linalg::lstsq / lstsq_columns: constructed problems with known
// solutions (the 2e7×5 fp32 case torch gets wrong, κ up to 1e10 in fp64), residual
// orthogonality, several right-hand sides, rank deficiency, Tikhonov, the streaming form,
// and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "optimizers/linalg/gram_accumulator.h"
#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_test_problems.h"
#include "tests/support/test_scale.h"

namespace tidepool::linalg {
namespace {

using testing::expect_invalid;
using testing::expect_refused;
using testing::matrix_with_condition;
using testing::relative_error;

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

TEST(Lstsq, WellConditionedFp64UsesGramCholeskyAndIsExact) {
  const auto A = matrix_with_condition(20000, 5, 10.0, 1);
  const auto x = testing::values({1.0, -2.0, 3.0, -4.0, 5.0});
  const auto result = lstsq(A, A.mv(x));
  EXPECT_EQ(result.method, LstsqMethod::gram_cholesky);
  EXPECT_STREQ(result.method_name, "gram_cholesky");
  EXPECT_EQ(result.rank, 5);
  // van der Sluis: equilibration raises κ by at most √k.
  EXPECT_LT(result.condition, 10.0 * std::sqrt(5.0));
  EXPECT_GT(result.condition, 10.0 / 3.0);
  EXPECT_EQ(result.solution.sizes(), at::IntArrayRef({5}));
  EXPECT_EQ(result.solution.scalar_type(), at::kDouble);
  EXPECT_LT(relative_error(result.solution, x),
            100.0 * 100.0 * std::numeric_limits<double>::epsilon());
}

// The headline case: torch's default cuts this to rank 1, its fp32 drivers lose
// ~3e-2 to fp32 accumulation. fp64 accumulation must get it to 1e-6.
TEST(Lstsq, Fp32TwentyMillionByFiveComesOutWithin1e6) {
  const int64_t rows = test_support::scaled(20'000'000);
  at::manual_seed(7);
  const auto A = at::randn({rows, 5}, at::kFloat);  // κ ≈ 1 for Gaussian tall A
  const auto x = testing::values({1, 2, 3, 4, 5}, at::kFloat);
  const auto b = A.mv(x);
  const auto result = lstsq(A, b);
  EXPECT_EQ(result.method, LstsqMethod::gram_cholesky);
  EXPECT_EQ(result.rank, 5);
  EXPECT_LT(result.condition, 1.01);
  EXPECT_EQ(result.solution.scalar_type(), at::kFloat);
  EXPECT_LT(relative_error(result.solution, x), 1e-6);
}

class LstsqCondition : public ::testing::TestWithParam<double> {};

// Consistent systems: a backward-stable method gets x to ~κ·eps64; the Gram method alone
// would give κ²·eps64, so automatic must leave it above gram_condition_limit.
TEST_P(LstsqCondition, RecoversKnownSolutionToConditionTimesEps) {
  const double condition = GetParam();
  const auto A = matrix_with_condition(10000, 6, condition, 2);
  const auto x = at::linspace(1.0, 6.0, 6, kF64);
  const auto result = lstsq(A, A.mv(x));
  EXPECT_EQ(result.rank, 6);
  // The Gram route is accurate to ~κ²·eps64, the QR routes to ~κ·eps64.
  const double eps = std::numeric_limits<double>::epsilon();
  const double growth =
      result.method == LstsqMethod::gram_cholesky ? condition * condition : condition;
  EXPECT_LT(relative_error(result.solution, x), 100.0 * eps * growth)
      << "method " << result.method_name;
  // fp64's default gram_condition_limit is 1e4 on κ(AᵀA), i.e. κ(A) ≤ 100.
  if (condition < 100.0) {
    EXPECT_EQ(result.method, LstsqMethod::gram_cholesky);
  } else if (condition > 100.0) {
    EXPECT_NE(result.method, LstsqMethod::gram_cholesky);
  }
  // The estimate is of the equilibrated A: at most √k worse than κ (van der Sluis).
  EXPECT_GT(result.condition, condition / 100.0);
  EXPECT_LT(result.condition, condition * std::sqrt(6.0) * 1.01);
}

INSTANTIATE_TEST_SUITE_P(UpTo1e10, LstsqCondition,
                         ::testing::Values(1.0, 1e2, 1e4, 1e6, 1e8, 1e10));

// A proxy, testable on the CPU, for "CPU and CUDA give the same answer": permuting the
// rows changes every summation order (as a different device does) but not the solution.
// Consistent systems: the difference is then rounding only, ~κ·eps64 on the QR routes and
// ~κ²·eps64 ≤ 1e-12 on the Gram route (fp64 default limit).
class LstsqRowOrder : public ::testing::TestWithParam<double> {};

TEST_P(LstsqRowOrder, DoesNotChangeTheAnswer) {
  const double condition = GetParam();
  const auto A = matrix_with_condition(20000, 6, condition, 40);
  const auto b = A.mv(at::linspace(1.0, 6.0, 6, kF64));
  const auto permutation = at::randperm(20000, at::TensorOptions().dtype(at::kLong));
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const auto Ad = A.to(dtype);
    const auto bd = b.to(dtype);
    const auto original = lstsq(Ad, bd);
    const auto permuted = lstsq(Ad.index_select(0, permutation), bd.index_select(0, permutation));
    EXPECT_EQ(original.method, permuted.method);
    EXPECT_LT(relative_error(permuted.solution, original.solution),
              dtype == at::kDouble ? 1e-10 : 1e-6)
        << original.method_name << " " << at::toString(dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(UpTo1e6, LstsqRowOrder, ::testing::Values(1.0, 1e3, 1e6));

class LstsqMethods : public ::testing::TestWithParam<LstsqMethod> {};

TEST_P(LstsqMethods, ResidualIsOrthogonalToRangeAndReportedNormIsRight) {
  const auto A = matrix_with_condition(8000, 4, 1e3, 3);
  at::manual_seed(4);
  const auto b = A.mv(at::randn({4}, kF64)) + 0.1 * at::randn({8000}, kF64);
  LstsqOptions options;
  options.method = GetParam();
  const auto result = lstsq(A, b, options);
  EXPECT_EQ(result.method, GetParam());
  const auto residual = b - A.mv(result.solution);
  const double orthogonality =
      A.t().mv(residual).abs().max().item<double>() /
      (A.norm().item<double>() * residual.norm().item<double>());
  EXPECT_LT(orthogonality, 1e-9);
  EXPECT_NEAR(result.residual_norm, residual.norm().item<double>(), 1e-8 * b.norm().item<double>());
  ASSERT_EQ(result.residual_norms.size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Forced, LstsqMethods,
                         ::testing::Values(LstsqMethod::gram_cholesky, LstsqMethod::cholesky_qr,
                                           LstsqMethod::svd, LstsqMethod::gram_eigh),
                         [](const ::testing::TestParamInfo<LstsqMethod>& test) {
                           return std::string(method_name(test.param));
                         });

TEST(Lstsq, MultipleRightHandSidesMatchSeparateSolves) {
  const auto A = matrix_with_condition(6000, 5, 50.0, 5);
  at::manual_seed(6);
  const auto B = at::randn({6000, 3}, kF64);
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::cholesky_qr}) {
    LstsqOptions options;
    options.method = method;
    const auto together = lstsq(A, B, options);
    ASSERT_EQ(together.solution.sizes(), at::IntArrayRef({5, 3}));
    ASSERT_EQ(together.residual_norms.size(), 3u);
    double squares = 0.0;
    for (int64_t j = 0; j < 3; ++j) {
      const auto alone = lstsq(A, B.select(1, j), options);
      EXPECT_LT(relative_error(together.solution.select(1, j), alone.solution), 1e-12);
      const double direct =
          (B.select(1, j) - A.mv(together.solution.select(1, j))).norm().item<double>();
      EXPECT_NEAR(together.residual_norms[static_cast<size_t>(j)], direct, 1e-9 * direct);
      squares += direct * direct;
    }
    EXPECT_NEAR(together.residual_norm, std::sqrt(squares), 1e-9 * std::sqrt(squares));
  }
}

// Columns a1, s·a2, a1 + 1e-4·noise; b = a1 + a2 + 1e-3·noise (the same for every s, so
// x = (≈0.5, ≈1/s, ≈0.5)). At rcond 1e-3 the near-collinear pair counts as one direction,
// whatever s is.
struct UnitsProblem {
  at::Tensor A;
  at::Tensor b;
};

UnitsProblem units_problem(int64_t rows, double s, uint64_t seed) {
  at::manual_seed(seed);
  const auto a1 = at::randn({rows}, kF64);
  const auto a2 = at::randn({rows}, kF64);
  const auto a3 = a1 + 1e-4 * at::randn({rows}, kF64);
  return {at::stack({a1, s * a2, a3}, 1), a1 + a2 + 1e-3 * at::randn({rows}, kF64)};
}

// Minimum ‖D⁻¹x‖ at rcond, D = diag(1/‖a_j‖): what lstsq.h promises with equilibration.
at::Tensor equilibrated_reference(const at::Tensor& A, const at::Tensor& b, double rcond) {
  const auto D = 1.0 / A.norm(2, {0});
  return D * at::linalg_pinv(A * D, rcond).mv(b);
}

// The minimum-norm solution, computed independently with the pseudo-inverse.
at::Tensor min_norm_reference(const at::Tensor& A, const at::Tensor& b) {
  return at::linalg_pinv(A, 1e-10).mv(b);
}

TEST(Lstsq, DuplicatedColumnGivesMinimumNormAndRank) {
  at::manual_seed(8);
  const auto base = at::randn({5000, 3}, kF64) * testing::values({1.0, 10.0, 0.1});
  const auto A = at::cat({base, base.narrow(1, 0, 1)}, 1);  // column 3 = column 0
  const auto b = base.mv(testing::values({1.0, 2.0, 3.0})) + 0.01 * at::randn({5000}, kF64);
  const auto result = lstsq(A, b);
  EXPECT_EQ(result.method, LstsqMethod::svd);
  EXPECT_EQ(result.rank, 3);
  EXPECT_TRUE(std::isinf(result.condition) || result.condition > 1e12);
  EXPECT_LT(relative_error(result.solution, min_norm_reference(A, b)), 1e-10);
  // Minimum norm splits the duplicated coefficient evenly.
  EXPECT_NEAR(result.solution[0].item<double>(), result.solution[3].item<double>(), 1e-10);
}

// Exactly dependent columns of different norms, [a, 2a]: both answers solve the problem
// exactly; which one is smallest depends on the variables (lstsq.h, LstsqOptions::
// equilibrate). Without equilibration the minimum ‖x‖ (gelsd's, the pseudo-inverse's); with
// it the minimum ‖D⁻¹x‖, which puts equal weight on the unit-norm columns.
TEST(Lstsq, ScaledDuplicateColumnsSplitTheCoefficientByTheVariablesMinimised) {
  at::manual_seed(12);
  const auto base = at::randn({3000, 2}, kF64);
  const auto A = at::cat({base, 2.0 * base.narrow(1, 0, 1)}, 1);  // column 2 = 2·column 0
  const auto b = base.mv(testing::values({1.0, -2.0})) + 0.01 * at::randn({3000}, kF64);
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::gram_eigh}) {
    LstsqOptions options;
    options.method = method;
    options.equilibrate = false;
    const auto plain = lstsq(A, b, options);
    EXPECT_EQ(plain.rank, 2) << method_name(method);
    EXPECT_LT(relative_error(plain.solution, min_norm_reference(A, b)), 1e-9)
        << method_name(method);
    EXPECT_NEAR(plain.solution[2].item<double>(), 2.0 * plain.solution[0].item<double>(), 1e-9)
        << method_name(method);
    options.equilibrate = true;
    const auto equilibrated = lstsq(A, b, options);
    EXPECT_EQ(equilibrated.rank, 2) << method_name(method);
    EXPECT_NEAR(equilibrated.solution[0].item<double>(),
                2.0 * equilibrated.solution[2].item<double>(), 1e-9)
        << method_name(method);
    // Both solve it: the same coefficient of a in total, the same residual.
    EXPECT_NEAR(plain.solution[0].item<double>() + 2.0 * plain.solution[2].item<double>(),
                equilibrated.solution[0].item<double>() +
                    2.0 * equilibrated.solution[2].item<double>(),
                1e-9)
        << method_name(method);
    EXPECT_NEAR(plain.residual_norm, equilibrated.residual_norm, 1e-9 * plain.residual_norm)
        << method_name(method);
  }
}

TEST(Lstsq, ZeroColumnGetsZeroCoefficientAndLowersRank) {
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::gram_eigh}) {
    at::manual_seed(9);
    auto A = at::randn({4000, 4}, kF64);
    A.select(1, 2).zero_();
    const auto b = at::randn({4000}, kF64);
    LstsqOptions options;
    options.method = method;
    const auto result = lstsq(A, b, options);
    EXPECT_EQ(result.rank, 3) << method_name(method);
    EXPECT_EQ(result.solution[2].item<double>(), 0.0) << method_name(method);
    EXPECT_LT(relative_error(result.solution, min_norm_reference(A, b)), 1e-9)
        << method_name(method);
  }
}

TEST(Lstsq, WideAndTinyProblemsUseMinimumNormSvd) {
  at::manual_seed(10);
  const auto wide = at::randn({3, 7}, kF64);
  const auto b = at::randn({3}, kF64);
  const auto result = lstsq(wide, b);
  EXPECT_EQ(result.method, LstsqMethod::svd);
  EXPECT_EQ(result.rank, 3);
  // With equilibration (the default) the minimum norm is that of the unit-column
  // variables, ‖D⁻¹x‖ (lstsq.h); without it, the true minimum ‖x‖.
  EXPECT_LT(relative_error(result.solution, equilibrated_reference(wide, b, 1e-10)), 1e-12);
  EXPECT_LT(result.residual_norm, 1e-12);
  LstsqOptions plain;
  plain.equilibrate = false;
  EXPECT_LT(relative_error(lstsq(wide, b, plain).solution, min_norm_reference(wide, b)), 1e-12);

  const auto tiny = at::randn({20, 4}, kF64);
  EXPECT_EQ(lstsq(tiny, at::randn({20}, kF64)).method, LstsqMethod::svd);
}

// Review finding: forced cholesky_qr took a wide problem, whose AᵀA is singular: its shifted
// first pass could come through and return a solution that is not the minimum-norm one.
// It is refused, naming what to use, for every dtype and whether or not the shift holds.
TEST(LstsqErrors, ForcedCholeskyQrRefusesAWideProblem) {
  at::manual_seed(71);
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const auto wide = at::randn({3, 7}, dtype);
    LstsqOptions options;
    options.method = LstsqMethod::cholesky_qr;
    expect_refused([&] { lstsq(wide, at::randn({3}, dtype), options); },
                   "more columns than rows: use method automatic or svd");
  }
}

TEST(Lstsq, RcondTruncatesSmallSingularValuesWhenAsked) {
  const auto A = matrix_with_condition(5000, 5, 1e6, 11);
  const auto b = A.mv(at::ones({5}, kF64));
  LstsqOptions options;
  options.equilibrate = false;  // so that σ are exactly the constructed ones
  options.rcond = 1e-2;         // σ = 1, 3.2e-2, 1e-3, 3.2e-5, 1e-6: keeps 2
  const auto result = lstsq(A, b, options);
  EXPECT_EQ(result.method, LstsqMethod::svd);
  EXPECT_EQ(result.rank, 2);
  EXPECT_DOUBLE_EQ(result.rcond, 1e-2);
  EXPECT_EQ(lstsq(A, b).rank, 5);
}

// Review finding: the rank was decided on the equilibrated A but the solution truncated
// the SVD (or eigendecomposition) of the unscaled A, which keeps other directions when
// column norms differ: at s = 1e-5 it kept the near-collinear pair and dropped a2.
TEST(Lstsq, TruncationDoesNotDependOnColumnUnits) {
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::gram_eigh}) {
    // N = 50 takes automatic to the SVD; gram_eigh needs more rows for a stable Gram.
    const int64_t rows = method == LstsqMethod::gram_eigh ? 5000 : 50;
    LstsqOptions options;
    options.method = method;
    options.rcond = 1e-3;
    const auto unit = units_problem(rows, 1.0, 40);
    const auto expected = lstsq(unit.A, unit.b, options);
    EXPECT_NEAR(expected.solution[0].item<double>(), 0.5, 0.05) << method_name(method);
    EXPECT_NEAR(expected.solution[1].item<double>(), 1.0, 0.05) << method_name(method);
    EXPECT_NEAR(expected.solution[2].item<double>(), 0.5, 0.05) << method_name(method);
    for (const double s : {1e-5, 1e-8, 1e5}) {
      const auto scaled = units_problem(rows, s, 40);
      const auto result = lstsq(scaled.A, scaled.b, options);
      EXPECT_EQ(result.rank, 2) << method_name(method) << " s=" << s;
      EXPECT_LT(relative_error(result.solution,
                               equilibrated_reference(scaled.A, scaled.b, result.rcond)),
                1e-8)
          << method_name(method) << " s=" << s;
      // Only column 1's units changed, so only x_1 changes, by 1/s.
      const auto rescaled = result.solution * testing::values({1.0, s, 1.0});
      EXPECT_LT(relative_error(rescaled, expected.solution), 1e-8)
          << method_name(method) << " s=" << s;
    }
  }
}

TEST(Lstsq, WithoutEquilibrationTruncationGivesTrueMinimumNorm) {
  for (const auto method : {LstsqMethod::svd, LstsqMethod::gram_eigh}) {
    const auto problem = units_problem(method == LstsqMethod::gram_eigh ? 5000 : 50, 1e-2, 41);
    LstsqOptions options;
    options.method = method;
    options.rcond = 1e-3;
    options.equilibrate = false;
    const auto result = lstsq(problem.A, problem.b, options);
    EXPECT_EQ(result.rank, 2) << method_name(method);
    EXPECT_LT(relative_error(result.solution,
                             at::linalg_pinv(problem.A, result.rcond).mv(problem.b)),
              1e-8)
        << method_name(method);
  }
}

// Full rank, κ²(AD) ≈ 4e4 > gram_condition_limit: automatic leaves Cholesky. Solving
// the unscaled AᵀA there lost everything equilibration bought (relative error 0.55 at
// s = 1e-8); in the scaled variables the error is ~κ²(AD)·eps64 whatever s is.
TEST(Lstsq, FullRankBadlyScaledColumnsStayAccurateOnEveryPath) {
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::gram_eigh,
                            LstsqMethod::cholesky_qr}) {
    for (const double s : {1.0, 1e-6, 1e-8}) {
      at::manual_seed(42);
      const auto a1 = at::randn({5000}, kF64);
      const auto A =
          at::stack({a1, s * at::randn({5000}, kF64), a1 + 1e-2 * at::randn({5000}, kF64)}, 1);
      const auto x = testing::values({1.0, 2.0 / s, 3.0});
      LstsqOptions options;
      options.method = method;
      const auto result = lstsq(A, A.mv(x), options);
      EXPECT_EQ(result.rank, 3) << method_name(method) << " s=" << s;
      EXPECT_LT(relative_error(result.solution * testing::values({1.0, s, 1.0}),
                               testing::values({1.0, 2.0, 3.0})),
                1e-9)
          << method_name(method) << " s=" << s;
    }
  }
}

// Review finding: result.rcond reported the requested value, not the threshold applied.
TEST(Lstsq, ReportedRcondIsTheThresholdApplied) {
  const double eps = std::numeric_limits<double>::epsilon();
  const auto A = matrix_with_condition(20000, 5, 10.0, 43);
  const auto b = A.mv(at::ones({5}, kF64));
  const auto automatic = lstsq(A, b);  // default rcond ≈ 3e-13, below the Gram's resolution
  ASSERT_EQ(automatic.method, LstsqMethod::gram_cholesky);
  EXPECT_DOUBLE_EQ(automatic.rcond, std::sqrt(10.0 * 5.0 * eps));
  LstsqOptions options;
  options.method = LstsqMethod::gram_eigh;
  options.rcond = 1e-12;
  EXPECT_DOUBLE_EQ(lstsq(A, b, options).rcond, std::sqrt(10.0 * 5.0 * eps));
  options.rcond = 1e-3;  // above the floor: applied as given
  EXPECT_DOUBLE_EQ(lstsq(A, b, options).rcond, 1e-3);
  options.method = LstsqMethod::svd;
  options.rcond = 1e-12;
  EXPECT_DOUBLE_EQ(lstsq(A, b, options).rcond, 1e-12);
}

// Review finding: a forced gram_cholesky with rcond above 1/κ reported rank < k but
// returned the untruncated solution. It cannot truncate, so it refuses.
TEST(LstsqErrors, ForcedGramCholeskyRefusesToTruncate) {
  const auto A = matrix_with_condition(5000, 5, 1e3, 44);
  const auto b = A.mv(at::ones({5}, kF64));
  LstsqOptions options;
  options.method = LstsqMethod::gram_cholesky;
  EXPECT_EQ(lstsq(A, b, options).rank, 5);  // the default rcond keeps all five
  options.rcond = 1e-1;
  try {
    const auto result = lstsq(A, b, options);
    ADD_FAILURE() << "expected a refusal; got rank " << result.rank;
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("cannot truncate"), std::string::npos) << error.what();
  }
  // automatic moves on to a method that truncates, and says so.
  options.method = LstsqMethod::automatic;
  const auto truncated = lstsq(A, b, options);
  EXPECT_LT(truncated.rank, 5);
  EXPECT_NE(truncated.method, LstsqMethod::gram_cholesky);
}

// Random-test finding (test_lstsq_random.cpp): an intercept and a rescaled copy of it are
// exactly dependent, but their Gram entries are sums of N equal products whose rounding
// leaves a spurious eigenvalue of ~2-8·eps64·λ_max (N ≤ 1e4). gram_cholesky refused only
// below eps64·λ_max (rcond √eps64), so it returned "rank k" and an arbitrary split of the
// duplicated coefficient in about half of such problems. Its floor is now gram_eigh's,
// √(10k·eps64): the Gram eigenvalues' resolution (Note [Condition from the Gram matrix]).
TEST(LstsqErrors, ForcedGramCholeskyRefusesProportionalConstantColumns) {
  for (const int64_t rows : {100, 305, 1000, 5000}) {
    for (const auto& [s1, s2] : std::vector<std::pair<double, double>>{
             {5.76e3, 46.0}, {3.08e-4, 6.26e-3}, {0.1, 0.3}, {1.0, 0.7}, {2.5e2, 1.3e-2}}) {
      at::manual_seed(48);
      const auto A = at::cat({at::full({rows, 1}, s1, kF64), at::full({rows, 1}, s2, kF64),
                              at::randn({rows, 2}, kF64)},
                             1);
      const auto b = at::randn({rows}, kF64);
      LstsqOptions options;
      options.method = LstsqMethod::gram_cholesky;
      try {
        const auto result = lstsq(A, b, options);
        ADD_FAILURE() << "N " << rows << " scales " << s1 << ", " << s2 << ": rank "
                      << result.rank << ", condition " << result.condition;
      } catch (const std::runtime_error& error) {
        EXPECT_NE(std::string(error.what()).find("use method automatic, svd or gram_eigh"),
                  std::string::npos)
            << error.what();
      }
      // gram_eigh drops the direction: minimum norm splits the intercept evenly (y_0 = y_1).
      options.method = LstsqMethod::gram_eigh;
      const auto result = lstsq(A, b, options);
      EXPECT_EQ(result.rank, 3);
      const double norm = std::sqrt(static_cast<double>(rows));
      EXPECT_NEAR(result.solution[0].item<double>() * s1 * norm,
                  result.solution[1].item<double>() * s2 * norm, 1e-8);
    }
  }
}

// Review finding: finite |a| > ~1.3e154 overflowed A.square().sum(0) on the SVD path and
// torch threw c10::Error ("non-finite") from the SVD of a NaN matrix.
TEST(Lstsq, HugeAndTinyFiniteInputOnTheSvdPath) {
  for (const double magnitude : {1e200, 1e-200}) {
    for (const bool equilibrate : {true, false}) {
      at::manual_seed(45);
      const auto A = at::randn({50, 3}, kF64) * magnitude;
      const auto x = testing::values({1.0, 2.0, 3.0});
      const auto b = A.mv(x) + magnitude * 1e-6 * at::randn({50}, kF64);
      LstsqOptions options;
      options.equilibrate = equilibrate;
      const auto result = lstsq(A, b, options);
      EXPECT_EQ(result.method, LstsqMethod::svd);
      EXPECT_EQ(result.rank, 3) << magnitude << equilibrate;
      EXPECT_LT(relative_error(result.solution, x), 1e-5) << magnitude << equilibrate;
      const double direct =
          magnitude * ((b - A.mv(result.solution)) / magnitude).norm().item<double>();
      EXPECT_NEAR(result.residual_norm, direct, 1e-8 * direct) << magnitude << equilibrate;
    }
  }
  // A relative Tikhonov λ needs trace(AᵀA), which overflows: a clear refusal.
  const auto huge = at::randn({50, 3}, kF64) * 1e200;
  LstsqOptions options;
  options.tikhonov = 1e-6;
  expect_invalid([&] { lstsq(huge, huge.sum(1), options); }, "overflows");
}

// Random-test finding (test_lstsq_random.cpp): entries ≲ 1e-154 have squares in float64's
// subnormal range, or 0, so the Gram matrix loses that column's precision or the column
// altogether. For this κ ≈ 1 problem, at 1e-160 every Gram-equilibrated route reported
// κ ≈ 2e4 and lost 8 digits; at 1e-165 forced gram_eigh and cholesky_qr returned rank 2
// with the column's coefficient 0. automatic must take the SVD (which rescales), forced
// methods that need the Gram matrix must refuse, as they do for squares that overflow.
TEST(Lstsq, ColumnsWhoseSquaresUnderflowLeaveTheGramRoute) {
  for (const double magnitude : {1e-160, 1e-165, 1e-200}) {
    at::manual_seed(46);
    auto A = at::randn({5000, 3}, kF64);
    A.select(1, 1).mul_(magnitude);
    const auto b = A.mv(testing::values({1.0, 2.0 / magnitude, 3.0}));
    const auto result = lstsq(A, b);
    EXPECT_EQ(result.method, LstsqMethod::svd) << magnitude;
    EXPECT_EQ(result.rank, 3) << magnitude;
    EXPECT_LT(result.condition, 1.1) << magnitude;
    EXPECT_LT(relative_error(result.solution * testing::values({1.0, magnitude, 1.0}),
                             testing::values({1.0, 2.0, 3.0})),
              1e-13)
        << magnitude;
    for (const auto method :
         {LstsqMethod::gram_cholesky, LstsqMethod::gram_eigh, LstsqMethod::cholesky_qr}) {
      LstsqOptions options;
      options.method = method;
      expect_invalid([&] { lstsq(A, b, options); }, "underflow");
    }
  }
  // An exactly zero column is no underflow: it stays rank deficiency on the Gram route.
  auto A = at::randn({5000, 3}, kF64);
  A.select(1, 2).zero_();
  LstsqOptions options;
  options.method = LstsqMethod::gram_eigh;
  EXPECT_EQ(lstsq(A, at::randn({5000}, kF64), options).rank, 2);
}

// Random-test finding: for b ~ 1e-160 (residual ~7e-162) the direct residual squared
// entries of ~1e-163 to 0, so exact_residual and every cholesky_qr result reported a
// residual of 0; the Gram residual lost bᵀb the same way.
TEST(Lstsq, ResidualsOfATinyRightHandSideDoNotUnderflow) {
  at::manual_seed(47);
  const auto A = at::randn({5000, 3}, kF64);
  const auto noise = at::randn({5000}, kF64);
  for (const double magnitude : {1e-160, 1e-200}) {
    const auto b = (A.mv(testing::values({1.0, 2.0, 3.0})) + 1e-3 * noise) * magnitude;
    for (const auto method : {LstsqMethod::automatic, LstsqMethod::gram_eigh,
                              LstsqMethod::cholesky_qr, LstsqMethod::svd}) {
      for (const bool exact : {false, true}) {
        LstsqOptions options;
        options.method = method;
        options.exact_residual = exact;
        const auto result = lstsq(A, b, options);
        const double direct =
            magnitude * ((b - A.mv(result.solution)) / magnitude).norm().item<double>();
        EXPECT_GT(direct, 0.0);
        EXPECT_NEAR(result.residual_norm, direct, 1e-10 * direct)
            << magnitude << " " << method_name(method) << " exact_residual " << exact;
      }
    }
  }
}

// Review finding: with A ~ 1e-100 (its squares fine) and b ~ 1e-222, the products of AᵀB
// are subnormal: the Gram route solved from an AᵀB wrong by percents (or 0 for b ~
// 1e-230, x = 0 at rank 2). automatic takes the SVD; the forced Gram methods refuse.
TEST(Lstsq, ARightHandSideWhoseProductsWithAUnderflowLeavesTheGramRoute) {
  at::manual_seed(48);
  const auto A = at::randn({10000, 2}, kF64) * 1e-100;
  for (const double scale : {1e-122, 1e-130}) {
    const auto x_true = testing::values({1.0, -2.0}) * scale;
    const auto b = A.mv(x_true);
    const auto result = lstsq(A, b);
    EXPECT_EQ(result.method, LstsqMethod::svd) << scale;
    EXPECT_LT(relative_error(result.solution, x_true), 1e-10) << scale;
    for (const auto method : {LstsqMethod::gram_cholesky, LstsqMethod::gram_eigh}) {
      LstsqOptions options;
      options.method = method;
      expect_invalid([&] { lstsq(A, b, options); }, "AᵀB underflow");
    }
    LstsqOptions cholesky_qr;
    cholesky_qr.method = LstsqMethod::cholesky_qr;
    EXPECT_LT(relative_error(lstsq(A, b, cholesky_qr).solution, x_true), 1e-10) << scale;
  }
}

TEST(Lstsq, TikhonovMatchesClosedFormAbsoluteAndRelative) {
  const auto A = matrix_with_condition(6000, 5, 1e5, 12);
  at::manual_seed(13);
  const auto b = at::randn({6000}, kF64);
  const auto gram = A.t().mm(A);
  for (const bool relative : {false, true}) {
    for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::gram_eigh}) {
      LstsqOptions options;
      options.method = method;
      options.tikhonov = 1e-4;
      options.tikhonov_relative = relative;
      const double lambda = relative ? 1e-4 * gram.trace().item<double>() / 5.0 : 1e-4;
      const auto expected = at::linalg_solve(gram + lambda * at::eye(5, kF64), A.t().mv(b));
      const auto result = lstsq(A, b, options);
      EXPECT_LT(relative_error(result.solution, expected), 1e-9) << method_name(method) << relative;
    }
  }
}

// Review finding: automatic trusted CholeskyQR3's R by the rank and κ of [R; √λ·D], which
// any λ > 0 makes full rank and bounded, so an exactly singular A (a duplicated column) got
// CholeskyQR3's noisy R: 99% relative error at λ = 1e-16, 1% at 1e-14. R is now judged
// alone, and such problems go to the SVD route, which forced svd matches.
TEST(Lstsq, RegularisedSingularProblemsAreNotLeftToCholeskyQr) {
  for (const double lambda : {1e-16, 1e-14, 1e-12, 1e-10}) {
    at::manual_seed(5);
    auto A = at::randn({20000, 3}, kF64);
    A.select(1, 1).copy_(A.select(1, 0));
    const auto b = at::randn({20000}, kF64);
    LstsqOptions options;
    options.tikhonov = lambda;
    const auto automatic = lstsq(A, b, options);
    options.method = LstsqMethod::svd;
    const auto svd = lstsq(A, b, options);
    SCOPED_TRACE(lambda);
    EXPECT_NE(automatic.method, LstsqMethod::cholesky_qr);
    EXPECT_EQ(automatic.rank, 3);
    EXPECT_LT(relative_error(automatic.solution, svd.solution), 1e-9);
  }
}

TEST(Lstsq, ExactResidualOptionAgreesWithGramResidual) {
  const auto A = matrix_with_condition(9000, 3, 5.0, 14);
  at::manual_seed(15);
  const auto b = at::randn({9000}, kF64);
  LstsqOptions options;
  options.exact_residual = true;
  const auto exact = lstsq(A, b, options);
  const auto gram = lstsq(A, b);
  EXPECT_NEAR(exact.residual_norm, (b - A.mv(exact.solution)).norm().item<double>(), 1e-12);
  EXPECT_NEAR(gram.residual_norm, exact.residual_norm, 1e-8);
}

// fp32 input: the solution comes back rounded to fp32, and residual_norms are documented as
// those of the solution returned. The H200 found the nine fp32 cases of the CPU/CUDA
// agreement test reporting the residual of the fp64 solution before rounding (6.8e-8
// reported, 1.1e-7 for the returned solution, at κ = 1): the difference is
// ‖A·(x₆₄ − fl32(x₆₄))‖ ≈ eps32·‖A‖‖x‖, far above the fp64 rounding of b − Ax that
// exact_residual promises. This is that check on the CPU (the bug was not device-specific),
// for every method and both entry points.
struct Fp32ResidualCase {
  double condition;
  LstsqMethod method;
};

void PrintTo(const Fp32ResidualCase& c, std::ostream* os) {
  *os << "κ=" << c.condition << " " << method_name(c.method);
}

class LstsqFp32Residual : public ::testing::TestWithParam<Fp32ResidualCase> {};

TEST_P(LstsqFp32Residual, ExactResidualIsThatOfTheReturnedFp32Solution) {
  const auto param = GetParam();
  const auto A = matrix_with_condition(200000, 8, param.condition, 31).to(at::kFloat);
  at::manual_seed(32);
  // Consistent up to fp32 rounding: the true residual is ~eps32·‖b‖, the same size as the
  // effect of rounding x, so a residual of the unrounded x is off by tens of percent.
  const auto B = A.to(at::kDouble).mm(at::randn({8, 2}, kF64)).to(at::kFloat);
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < 8; ++j) columns.push_back(A.select(1, j).contiguous());
  LstsqOptions options;
  options.method = param.method;
  options.exact_residual = true;
  const auto A64 = A.to(at::kDouble);
  const auto B64 = B.to(at::kDouble);
  const double a_norm = A64.norm().item<double>();
  for (const bool streamed : {false, true}) {
    const auto result = streamed ? lstsq_columns(columns, B, options) : lstsq(A, B, options);
    ASSERT_EQ(result.solution.scalar_type(), at::kFloat);
    ASSERT_EQ(result.residual_norms.size(), 2u);
    const auto x = result.solution.to(at::kDouble);  // exactly the fp32 values returned
    for (int64_t j = 0; j < 2; ++j) {
      const double scale = B64.select(1, j).norm().item<double>() +
                           a_norm * x.select(1, j).norm().item<double>();
      const double direct = (B64.select(1, j) - A64.mv(x.select(1, j))).norm().item<double>();
      // b − Ax in fp64 over 2e5 rows: ≲ √N·eps64·scale ≈ 1e-13·scale.
      EXPECT_NEAR(result.residual_norms[static_cast<size_t>(j)], direct, 1e-12 * scale)
          << method_name(result.method) << (streamed ? ", columns" : ", dense")
          << ", right-hand side " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryRoute, LstsqFp32Residual,
    ::testing::Values(Fp32ResidualCase{1.0, LstsqMethod::automatic},
                      Fp32ResidualCase{1e3, LstsqMethod::automatic},
                      Fp32ResidualCase{1e6, LstsqMethod::automatic},
                      Fp32ResidualCase{1.0, LstsqMethod::gram_cholesky},
                      Fp32ResidualCase{1.0, LstsqMethod::gram_eigh},
                      Fp32ResidualCase{1e3, LstsqMethod::cholesky_qr},
                      Fp32ResidualCase{1e3, LstsqMethod::svd}),
    [](const ::testing::TestParamInfo<Fp32ResidualCase>& test) {
      return std::string(method_name(test.param.method)) + "_" + std::to_string(test.index);
    });

// The same contract without exact_residual, where the Gram route's r² = bᵀb − 2xᵀAᵀb +
// xᵀAᵀAx and the SVD route's ‖R_B − R_A·y‖ are evaluated for the returned x (both formulas
// hold for any x). The problem is built so that every fp64 operation on the way is exact:
// A = (3, 3, 3)ᵀ, b = (1, 1, 1), so x = 1/3 and the residual of the fp64 solution is 0,
// while the returned fl32(1/3) leaves √3·|1 − 3·fl32(1/3)| ≈ 5.2e-8, above anything the
// Gram formula's rounding could produce here.
TEST(Lstsq, EveryRouteReportsTheResidualOfTheRoundedFp32Solution) {
  const auto A = at::full({3, 1}, 3.0, at::TensorOptions().dtype(at::kFloat));
  const auto b = at::ones({3}, at::TensorOptions().dtype(at::kFloat));
  const double x32 = static_cast<double>(1.0f / 3.0f);
  const double expected = std::sqrt(3.0) * std::abs(1.0 - 3.0 * x32);
  ASSERT_GT(expected, 1e-8);
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::gram_cholesky,
                            LstsqMethod::gram_eigh, LstsqMethod::cholesky_qr, LstsqMethod::svd}) {
    for (const bool exact : {false, true}) {
      LstsqOptions options;
      options.method = method;
      options.exact_residual = exact;
      for (const bool streamed : {false, true}) {
        const auto result =
            streamed ? lstsq_columns({A.select(1, 0)}, b, options) : lstsq(A, b, options);
        ASSERT_EQ(result.solution.scalar_type(), at::kFloat);
        EXPECT_EQ(result.solution.item<float>(), 1.0f / 3.0f);
        ASSERT_EQ(result.residual_norms.size(), 1u);
        EXPECT_NEAR(result.residual_norms[0], expected, 1e-6 * expected)
            << method_name(result.method) << ", exact_residual " << exact
            << (streamed ? ", columns" : ", dense");
        EXPECT_NEAR(result.residual_norm, expected, 1e-6 * expected);
      }
    }
  }
  // GramAccumulator hands cholesky_qr and svd to lstsq_columns, which returns the columns'
  // dtype: the same contract. (Its Gram methods return fp64, so nothing is rounded there.)
  GramAccumulator accumulator(2);
  accumulator.set_column(0, A.select(1, 0).contiguous());
  accumulator.set_column(1, b);
  for (const auto method : {LstsqMethod::cholesky_qr, LstsqMethod::svd}) {
    LstsqOptions options;
    options.method = method;
    const auto result = accumulator.solve({0}, 1, options);
    ASSERT_EQ(result.solution.scalar_type(), at::kFloat);
    EXPECT_NEAR(result.residual_norm, expected, 1e-6 * expected) << method_name(method);
  }
}

// A solution beyond fp32's range comes back as ±inf; its residual is then not a number
// worth reporting as finite: +inf says the returned solution is unusable.
TEST(Lstsq, Fp32SolutionThatOverflowsReportsAnInfiniteResidual) {
  at::manual_seed(48);
  const auto A = (at::rand({5000, 2}, kF64) + 0.5).to(at::kFloat) * 1e-30f;
  const auto b = (at::rand({5000}, kF64) + 0.5).to(at::kFloat) * 1e30f;
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::cholesky_qr,
                            LstsqMethod::gram_eigh}) {
    for (const bool exact : {false, true}) {
      LstsqOptions options;
      options.method = method;
      options.exact_residual = exact;
      const auto result = lstsq(A, b, options);
      EXPECT_FALSE(at::isfinite(result.solution).all().item<bool>()) << method_name(method);
      ASSERT_EQ(result.residual_norms.size(), 1u);
      EXPECT_EQ(result.residual_norms[0], std::numeric_limits<double>::infinity())
          << method_name(method) << ", exact_residual " << exact;
      EXPECT_EQ(result.residual_norm, std::numeric_limits<double>::infinity());
    }
  }
}

TEST(LstsqColumns, StreamingFormEqualsDenseForm) {
  const auto A = matrix_with_condition(12000, 5, 1e2, 16).to(at::kFloat);
  at::manual_seed(17);
  const auto B = at::randn({12000, 2}, at::kFloat);
  // Columns as separate allocations, one of them a strided view into a larger buffer.
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < 5; ++j) columns.push_back(A.select(1, j).contiguous());
  const auto padded = at::zeros({12000, 3}, at::kFloat);
  padded.select(1, 1).copy_(A.select(1, 4));
  columns[4] = padded.select(1, 1);
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::cholesky_qr, LstsqMethod::svd}) {
    LstsqOptions options;
    options.method = method;
    const auto dense = lstsq(A, B, options);
    const auto streamed = lstsq_columns(columns, B, options);
    EXPECT_EQ(streamed.method, dense.method);
    EXPECT_EQ(streamed.rank, dense.rank);
    EXPECT_LT(relative_error(streamed.solution, dense.solution), 1e-6);
    EXPECT_NEAR(streamed.residual_norm, dense.residual_norm, 1e-9 * dense.residual_norm);
  }
}

TEST(LstsqColumns, IllConditionedColumnsFallBackLikeDense) {
  const auto A = matrix_with_condition(6000, 4, 1e9, 18);
  const auto x = testing::values({1.0, 2.0, 3.0, 4.0});
  const auto b = A.mv(x);
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < 4; ++j) columns.push_back(A.select(1, j).contiguous());
  const auto result = lstsq_columns(columns, b);
  EXPECT_NE(result.method, LstsqMethod::gram_cholesky);
  EXPECT_LT(relative_error(result.solution, x), 1e-4);
}

TEST(LstsqErrors, NonFiniteInputIsRejectedOnEveryPath) {
  const auto A = at::randn({5000, 3}, kF64);
  const auto b = at::randn({5000}, kF64);
  auto with_nan = A.clone();
  with_nan[1234][1] = std::numeric_limits<double>::quiet_NaN();
  auto b_inf = b.clone();
  b_inf[17] = std::numeric_limits<double>::infinity();
  for (const auto method : {LstsqMethod::automatic, LstsqMethod::svd, LstsqMethod::cholesky_qr}) {
    LstsqOptions options;
    options.method = method;
    expect_invalid([&] { lstsq(with_nan, b, options); }, "NaN or Inf");
    expect_invalid([&] { lstsq(A, b_inf, options); }, "NaN or Inf");
  }
  auto tiny = at::randn({10, 2}, kF64);
  tiny[3][0] = -std::numeric_limits<double>::infinity();
  expect_invalid([&] { lstsq(tiny, at::randn({10}, kF64)); }, "NaN or Inf");
}

TEST(LstsqErrors, ShapesDtypesDevicesAndOptions) {
  const auto A = at::randn({100, 3}, kF64);
  const auto b = at::randn({100}, kF64);
  expect_invalid([&] { lstsq(at::Tensor(), b); }, "A is undefined");
  expect_invalid([&] { lstsq(at::randn({100}, kF64), b); }, "A must be 2-D");
  expect_invalid([&] { lstsq(at::randn({0, 3}, kF64), at::randn({0}, kF64)); }, "empty");
  expect_invalid([&] { lstsq(at::randn({100, 0}, kF64), b); }, "empty");
  expect_invalid([&] { lstsq(A, at::randn({99}, kF64)); }, "100 rows but B has 99");
  expect_invalid([&] { lstsq(A, at::randn({100, 0}, kF64)); }, "no columns");
  expect_invalid([&] { lstsq(A, at::randn({100, 2, 2}, kF64)); }, "B must be 1-D");
  expect_invalid([&] { lstsq(A.to(at::kInt), b.to(at::kInt)); }, "unsupported dtype");
  expect_invalid([&] { lstsq(A.to(at::kHalf), b.to(at::kHalf)); }, "unsupported dtype");
  expect_invalid([&] { lstsq(A, b.to(at::kFloat)); }, "dtype");
  expect_invalid([&] { lstsq(A, at::empty({100}, kF64.device(at::kMeta))); }, "is on meta");
  expect_invalid([&] { lstsq(A.to(at::kMeta), b); }, "CPU or a CUDA device");
  LstsqOptions negative;
  negative.tikhonov = -1.0;
  expect_invalid([&] { lstsq(A, b, negative); }, "tikhonov");
  LstsqOptions nan_rcond;
  nan_rcond.rcond = std::numeric_limits<double>::quiet_NaN();
  expect_invalid([&] { lstsq(A, b, nan_rcond); }, "rcond");
}

TEST(LstsqErrors, StreamingColumnsAreChecked) {
  const auto b = at::randn({100}, kF64);
  const auto good = at::randn({100}, kF64);
  expect_invalid([&] { lstsq_columns({}, b); }, "no columns");
  expect_invalid([&] { lstsq_columns({good, at::randn({99}, kF64)}, b); }, "column 1 has 99 rows");
  expect_invalid([&] { lstsq_columns({good, at::randn({100, 1}, kF64)}, b); }, "must be 1-D");
  expect_invalid([&] { lstsq_columns({good, at::randn({100})}, b); }, "dtype");
  expect_invalid([&] { lstsq_columns({good, at::Tensor()}, b); }, "undefined");
}

TEST(LstsqErrors, ForcedGramCholeskyOnSingularInputSaysWhatToDo) {
  auto A = at::randn({3000, 3}, kF64);
  A.select(1, 1).copy_(A.select(1, 0));
  LstsqOptions options;
  options.method = LstsqMethod::gram_cholesky;
  expect_refused([&] { lstsq(A, at::randn({3000}, kF64), options); }, "not positive definite");
}

}  // namespace
}  // namespace tidepool::linalg
