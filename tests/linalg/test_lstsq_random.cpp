// Randomized differential test of tidepool::linalg::lstsq and lstsq_columns against an
// independent long-double reference, over problems the hand-written tests
// (test_lstsq.cpp) do not reach:
//   - shapes: wide (N < k), square, tiny (N·k ≤ svd_below_elements) and tall above it, so
//     every automatic branch runs; k 1..20; B 1-D or N×r (r 1..3); fp32 or fp64;
//   - A = U·diag(σ)·Vᵀ with κ up to 1e10 (fp64) / 1e4 (fp32), or small integers (whose
//     combinations are exact in both dtypes), with badly scaled columns and rank deficiency
//     (zero columns, duplicated columns, exact or rounded linear combinations, σ set to 0),
//     and intercept (constant) columns;
//   - options: automatic or each forced method, rcond default / explicit / 0, Tikhonov
//     (relative or absolute), equilibration on/off, exact_residual on/off, other
//     svd_below_elements and gram_condition_limit values;
//   - fp64 columns (or B) scaled exactly, by 2^e, to where their squares overflow or
//     underflow, which lstsq.h says are refused or, for underflow, solved without squaring;
//   - both entry points: dense A in four memory layouts, and A's columns as separate
//     tensors, some of them strided views (stride 0 for a constant column).
// The reference is computed from the very values given (fp32 converts exactly): Householder
// QR of [A·D; √λ·D | B; 0] and a one-sided Jacobi SVD of its R, all in long double (~2000x
// finer than fp64), truncated at the rcond the method applies. Every result must report the
// reference's rank, the documented rcond and a consistent condition estimate, use a method
// the selection rule in lstsq.h allows, match the reference solution (minimum ‖D⁻¹x‖, i.e.
// minimum norm in the equilibrated variables) within the documented accuracy (κ·eps64 on
// the QR routes, κ²·eps64 on the Gram routes, plus fp32's output rounding), report residual
// norms within the documented accuracy of its own solution's, agree bitwise between the two
// entry points and leave its inputs untouched. Each problem is redrawn until all its singular
// values are at least 100x away from the threshold applied, so the expected rank is
// unambiguous. A second test mixes in bad input (NaN/Inf, empty, mismatched, unsupported
// dtypes): it must throw std::invalid_argument naming the problem.
// The drawing of problems is in lstsq_random_problems.h, the reference in lstsq_reference.h.
// Size: TIDEPOOL_TEST_SCALE x 600 problems (60 under sanitizers) and 150 bad inputs;
// TIDEPOOL_TEST_SEED draws other ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_random_problems.h"
#include "tests/linalg/lstsq_reference.h"
#include "tests/linalg/lstsq_test_problems.h"
#include "tests/support/test_scale.h"
#include "tests/support/test_seed.h"

namespace tidepool::linalg {
namespace {

using testing::Matrix;
using testing::Real;
using testing::Reference;
// The drawing of problems (lstsq_random_problems.h).
using testing::applied_rcond;
using testing::Draw;
using testing::draw_problem;
using testing::kEps32;
using testing::kEps64;
using testing::kF64;
using testing::Problem;
using testing::rounding_floor;
using testing::sci;
using testing::unambiguous;

// Safety factor on the documented accuracy (the formulas are in check_result). Over 30
// seeds (9000 problems) the largest error seen was 1.8x the bare formula for the solution,
// 0.9x for the exact residuals: a factor 10 leaves room for other seeds, not for a κ turned
// into κ² or a wrong truncation.
constexpr double kAccuracyFactor = 10.0;

// ---------------------------------------------------------------------------------------
// Checks.

struct Outcome {
  bool threw = false;     // std::runtime_error: a forced method refused the problem
  bool rejected = false;  // std::invalid_argument: the input was refused
  std::string error;
  LstsqResult result;
  bool solved() const { return !threw && !rejected; }
};

template <typename Call>
Outcome run_solver(Call&& call) {
  Outcome outcome;
  try {
    outcome.result = call();
  } catch (const std::invalid_argument& error) {
    outcome.rejected = true;
    outcome.error = error.what();
  } catch (const std::runtime_error& error) {
    outcome.threw = true;
    outcome.error = error.what();
  }
  return outcome;
}

// Whether the squares the Gram pass of [A | B] forms overflow fp64, or those of a nonzero
// column of A underflow it (‖a_j‖² < N·DBL_MIN, lstsq.h): the draw keeps both far from the
// edge.
struct GramRange {
  bool overflow = false;
  bool underflow = false;
};

GramRange gram_range(const Reference& ref) {
  GramRange range;
  const Real largest = std::numeric_limits<double>::max();
  const Real smallest =
      static_cast<Real>(ref.rows) * static_cast<Real>(std::numeric_limits<double>::min());
  for (int64_t j = 0; j < ref.k; ++j) {
    const Real norm = ref.column_norm[static_cast<size_t>(j)];
    const Real squares = norm * norm;
    range.overflow = range.overflow || squares > largest;
    range.underflow = range.underflow || (squares > 0.0L && squares < smallest);
  }
  const std::vector<Real> zeros(static_cast<size_t>(ref.k), 0.0L);
  for (int64_t j = 0; j < ref.rhs; ++j) {
    const Real norm = ref.residual(j, zeros);
    range.overflow = range.overflow || norm * norm > largest;
  }
  return range;
}

bool needs_gram_pass(const Problem& p) {
  return p.options.method != LstsqMethod::svd &&
         !(p.options.method == LstsqMethod::automatic && p.tiny());
}

// The methods lstsq.h's selection rule allows for an automatic solve of this problem.
std::vector<LstsqMethod> automatic_choices(const Problem& p, const Reference& ref) {
  if (p.tiny() || gram_range(ref).underflow) return {LstsqMethod::svd};
  const double t = p.resolved_rcond();
  const double kappa = ref.ratio(p.k - 1) > 0.0 ? 1.0 / ref.ratio(p.k - 1) : HUGE_VAL;
  const double limit = p.gram_condition_limit();
  // The Gram route's κ comes from eigenvalues with error ~k·eps64·λ_max: near the limit
  // (within 20%) either side may win.
  const bool gram_full_rank = ref.rank_at(applied_rcond(LstsqMethod::gram_cholesky, t, p.k)) == p.k;
  std::vector<LstsqMethod> choices;
  if (gram_full_rank && kappa * kappa <= 1.2 * limit) choices.push_back(LstsqMethod::gram_cholesky);
  if (gram_full_rank && kappa * kappa < limit / 1.2) return choices;
  if (ref.rank_at(t) == p.k) {
    choices.push_back(LstsqMethod::cholesky_qr);
    // CholeskyQR3 runs on A·D without the Tikhonov rows: if that is singular it may break
    // down, and the SVD takes over.
    if (ref.lambda > 0.0L && ref.unstacked_ratio < 1e-6) choices.push_back(LstsqMethod::svd);
  } else {
    choices.push_back(LstsqMethod::svd);
  }
  return choices;
}

double to_double(Real v) { return static_cast<double>(v); }

// Checks one result against the reference.
void check_result(const Problem& p, const Reference& ref, const LstsqResult& result,
                  const std::string& label) {
  SCOPED_TRACE(label);
  const LstsqMethod method = result.method;
  if (p.options.method == LstsqMethod::automatic) {
    const auto choices = automatic_choices(p, ref);
    std::string allowed;
    for (const auto m : choices) allowed += std::string(" ") + method_name(m);
    EXPECT_TRUE(std::find(choices.begin(), choices.end(), method) != choices.end())
        << "automatic chose " << method_name(method) << "; the rule allows" << allowed
        << " (κ " << 1.0 / ref.ratio(p.k - 1) << ")";
  } else {
    EXPECT_EQ(method, p.options.method) << method_name(method);
  }
  EXPECT_STREQ(result.method_name, method_name(method));
  const double t = applied_rcond(method, p.resolved_rcond(), p.k);
  EXPECT_DOUBLE_EQ(result.rcond, t);
  const int64_t rank = ref.rank_at(t);
  EXPECT_EQ(result.rank, rank) << "σ/σ_max around rcond " << t << ": "
                               << (rank > 0 ? ref.ratio(rank - 1) : 1.0) << ", "
                               << (rank < p.k ? ref.ratio(rank) : 0.0);
  // The estimate comes from the σ's (or Gram eigenvalues) the rank is decided on: κ > 1/rcond
  // exactly when a direction is dropped. With full rank it is accurate to the relative error
  // of σ_min: (√N + k)·eps64·κ from an R factor, and ·κ² from the eigenvalues of AᵀA.
  const bool gram = method == LstsqMethod::gram_cholesky || method == LstsqMethod::gram_eigh;
  const double sqrt_n = std::sqrt(static_cast<double>(p.rows));
  const double rounding_growth = sqrt_n + static_cast<double>(p.k);
  if (rank == p.k) {
    const double kappa = 1.0 / ref.ratio(p.k - 1);
    const double resolution =
        kAccuracyFactor * rounding_growth * kEps64 * (gram ? kappa * kappa : kappa);
    EXPECT_LE(std::abs(result.condition / kappa - 1.0), resolution)
        << "condition " << result.condition << ", reference " << kappa;
  } else {
    EXPECT_GE(result.condition, 1.0 / t);
  }

  ASSERT_TRUE(result.solution.defined());
  EXPECT_EQ(result.solution.scalar_type(), p.dtype);
  EXPECT_TRUE(result.solution.is_cpu());
  if (p.rhs == 0) {
    ASSERT_EQ(result.solution.sizes(), at::IntArrayRef({p.k}));
  } else {
    ASSERT_EQ(result.solution.sizes(), at::IntArrayRef({p.k, p.rhs}));
  }
  ASSERT_EQ(result.residual_norms.size(), static_cast<size_t>(p.rhs_columns()));
  if (result.rank != rank) return;  // the solution would be compared with another one

  const auto x = (p.rhs == 0 ? result.solution.unsqueeze(1) : result.solution)
                     .to(at::kDouble)
                     .contiguous();
  const double* xs = x.data_ptr<double>();
  const Matrix y_ref = ref.y_keeping(rank);
  const double kappa_kept = rank > 0 ? 1.0 / ref.ratio(rank - 1) : 1.0;
  const bool gram_residual = gram && !p.options.exact_residual;
  const double output_rounding = p.fp64() ? 0.0 : kEps32 / 2;
  Real frobenius_squares = 0.0L;  // long double: a residual of 1e-170 squares to 0 in fp64
  for (int64_t j = 0; j < p.rhs_columns(); ++j) {
    SCOPED_TRACE("right-hand side " + std::to_string(j));
    std::vector<Real> x_returned(static_cast<size_t>(p.k));
    std::vector<Real> x_reference(static_cast<size_t>(p.k));
    Real error = 0.0L, y_norm = 0.0L, x_norm = 0.0L, weighted = 0.0L, x_ref_norm = 0.0L;
    for (int64_t i = 0; i < p.k; ++i) {
      const auto ui = static_cast<size_t>(i);
      x_returned[ui] = xs[i * p.rhs_columns() + j];
      x_reference[ui] = ref.scale[ui] * y_ref(i, j);
      // In the equilibrated variables y = D⁻¹x, where the documented accuracy holds.
      const Real difference = x_returned[ui] / ref.scale[ui] - y_ref(i, j);
      error += difference * difference;
      y_norm += y_ref(i, j) * y_ref(i, j);
      x_norm += x_returned[ui] * x_returned[ui];
      x_ref_norm += x_reference[ui] * x_reference[ui];
      weighted += std::fabs(x_returned[ui]) * ref.column_norm[ui];
    }
    error = std::sqrt(error);
    y_norm = std::sqrt(y_norm);
    const Real b_norm = ref.residual(j, std::vector<Real>(static_cast<size_t>(p.k), 0.0L));
    const Real r_reference = ref.residual(j, x_reference);
    const Real r_returned = ref.residual(j, x_returned);
    // ρ': the (Tikhonov-stacked) residual relative to σ_max·‖y‖, the weight of the κ² term
    // in the least-squares error bound.
    const double stacked =
        to_double(std::sqrt(r_reference * r_reference + ref.lambda * x_ref_norm));
    const double rho = y_norm > 0.0L ? stacked / to_double(ref.sigma[0] * y_norm) : 0.0;
    // lstsq.h: the QR routes are backward stable, κ·eps64 (+ κ²·eps64·ρ' for an
    // inconsistent system, as for any least-squares solver); the Gram routes solve the
    // normal equations, κ²·eps64·(1 + ρ'). Both in the equilibrated variables, and never
    // below the rounding of sums over N rows and of a k×k solve, (√N + k)·eps64.
    const double kappa2 = kappa_kept * kappa_kept;
    const double tolerance_fp64 =
        kAccuracyFactor * kEps64 *
        (rounding_growth + (gram ? kappa2 * (1.0 + rho) : kappa_kept + kappa2 * rho));
    // fp32 output: each x_i is rounded to nearest, |δy_i| ≤ eps32/2·|y_i| on top.
    const double tolerance = tolerance_fp64 + output_rounding * (1.0 + tolerance_fp64);
    EXPECT_LE(to_double(error), tolerance * to_double(y_norm))
        << "solution error " << to_double(error / std::max(y_norm, Real(1e-300)))
        << " relative (equilibrated variables), tolerance " << tolerance << " (κ of the kept part "
        << kappa_kept << ", ρ' " << rho << ")";

    // Residual norms: each is documented as ‖b − A·x‖ of the solution returned. (Long
    // double: for a right-hand side of 1e-160 these squares underflow fp64.)
    const Real reported = result.residual_norms[static_cast<size_t>(j)];
    frobenius_squares += reported * reported;
    const Real scale_exact = b_norm + weighted;  // ‖b‖ + Σ|x_i|·‖a_i‖
    const Real growth = static_cast<Real>(kAccuracyFactor * rounding_growth * kEps64);
    Real computation;
    if (gram_residual) {
      // LstsqOptions::exact_residual: r² has absolute error ~√N·eps64·(‖b‖ + ‖A‖_F‖x‖)²
      // (+ k·eps64 for the k² terms of xᵀAᵀAx).
      const Real scale_doc = b_norm + ref.frobenius * std::sqrt(x_norm);
      const Real square_error = growth * scale_doc * scale_doc;
      const Real sum = reported + r_returned;
      computation = sum > 0.0L ? std::min(std::sqrt(square_error), square_error / sum)
                               : std::sqrt(square_error);
    } else {
      // b − A·x in fp64 (directly, or as Q(R_B − R_A·y)): ~(√N + k)·eps64·(‖b‖ + Σ|x_i|‖a_i‖).
      computation = growth * scale_exact;
    }
    // fp32 output too: the residual is that of the solution as returned, rounded to fp32
    // (it was the fp64 solution's, ~eps32·scale_exact away; the H200 found it).
    EXPECT_LE(to_double(std::fabs(reported - r_returned)), to_double(computation))
        << "reported residual " << to_double(reported) << ", of the returned solution "
        << to_double(r_returned);
    // ...and, through the solution's accuracy (fp32's rounding included), close to the
    // reference solution's residual: |‖b − Ax‖ − ‖b − Ax_ref‖| ≤ σ_max(AD)·‖y − y_ref‖.
    EXPECT_LE(to_double(std::fabs(reported - r_reference)),
              to_double(computation + ref.sigma[0] * tolerance * y_norm))
        << "reported residual " << to_double(reported) << ", reference "
        << to_double(r_reference);
  }
  const double frobenius = to_double(std::sqrt(frobenius_squares));
  EXPECT_NEAR(result.residual_norm, frobenius, 1e-14 * frobenius);
}

// lstsq.cpp reduces both entry points to one list of columns and one code path, which
// reads the same values in the same order whatever the layout: the results are the same
// bits (as they were on every one of 9000 problems).
void check_agreement(const LstsqResult& dense, const LstsqResult& streamed) {
  EXPECT_EQ(dense.method, streamed.method);
  EXPECT_EQ(dense.rank, streamed.rank);
  EXPECT_EQ(dense.rcond, streamed.rcond);
  EXPECT_EQ(dense.condition, streamed.condition);
  EXPECT_EQ(dense.residual_norms, streamed.residual_norms);
  ASSERT_EQ(dense.solution.sizes(), streamed.solution.sizes());
  EXPECT_TRUE(at::equal(dense.solution, streamed.solution))
      << "dense " << dense.solution << "streamed " << streamed.solution;
}

// Refusals. Input: squares that overflow where the Gram pass needs them, or underflow where
// a forced method needs the Gram matrix (lstsq.h). Forced methods: gram_cholesky must refuse
// when it would have to truncate (lstsq.h: it cannot), cholesky_qr may when A·D is
// numerically singular.
void check_refusal(const Problem& p, const Reference& ref, const Outcome& outcome,
                   const std::string& label) {
  SCOPED_TRACE(label);
  const auto range = gram_range(ref);
  const LstsqMethod m = p.options.method;
  std::string fragment;
  if (range.overflow && needs_gram_pass(p)) {
    fragment = "overflow";
  } else if (range.underflow && (m == LstsqMethod::gram_cholesky ||
                                 m == LstsqMethod::cholesky_qr || m == LstsqMethod::gram_eigh)) {
    fragment = "underflow";
  }
  if (!fragment.empty()) {
    EXPECT_TRUE(outcome.rejected) << "expected std::invalid_argument mentioning " << fragment
                                  << "; got " << (outcome.threw ? outcome.error : "a result");
    EXPECT_NE(outcome.error.find(fragment), std::string::npos) << outcome.error;
    return;
  }
  EXPECT_FALSE(outcome.rejected) << outcome.error;
  const double t = applied_rcond(p.options.method, p.resolved_rcond(), p.k);
  if (p.options.method == LstsqMethod::gram_cholesky && ref.rank_at(t) < p.k) {
    EXPECT_TRUE(outcome.threw) << "forced gram_cholesky returned rank " << outcome.result.rank
                               << " for a problem of rank " << ref.rank_at(t) << " at rcond "
                               << t;
    if (outcome.threw) {
      EXPECT_NE(outcome.error.find("gram_cholesky"), std::string::npos) << outcome.error;
      EXPECT_NE(outcome.error.find("use method automatic, svd or gram_eigh"), std::string::npos)
          << outcome.error;
    }
    return;
  }
  if (!outcome.threw) return;
  const bool may_break_down = p.options.method == LstsqMethod::cholesky_qr &&
                              (p.rows < p.k || ref.unstacked_ratio < 1e-13);
  EXPECT_TRUE(may_break_down) << "unexpected refusal: " << outcome.error;
  if (may_break_down) {
    EXPECT_NE(outcome.error.find("use method automatic or svd"), std::string::npos)
        << outcome.error;
  }
}

TEST(LstsqRandom, MatchesLongDoubleReferenceOnRandomProblems) {
  if (std::numeric_limits<Real>::digits <= std::numeric_limits<double>::digits) {
    GTEST_SKIP() << "long double is no finer than double here: no independent reference";
  }
  SCOPED_TRACE(test_support::seed_note());
  Draw draw(test_support::seeded(20260801));
  const int64_t problems = test_support::scaled(test_support::kSanitizedBuild ? 60 : 600);
  int64_t redraws = 0;
  for (int64_t n = 0; n < problems; ++n) {
    Problem problem;
    Reference ref;
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 200) << "no unambiguous problem drawn";
      problem = draw_problem(draw);
      ref = testing::make_reference(problem.A, problem.B, problem.options);
      if (unambiguous(problem, ref)) break;
      ++redraws;
    }
    SCOPED_TRACE("problem " + std::to_string(n) + ": " + problem.describe());

    const auto A = testing::dense_in_layout(problem.A, problem.dense_layout);
    const auto B = testing::rhs_in_layout(problem.B, problem.b_layout);
    std::vector<at::Tensor> columns;
    for (int64_t j = 0; j < problem.k; ++j) {
      columns.push_back(testing::column_in_layout(problem.A.select(1, j),
                                         problem.column_layouts[static_cast<size_t>(j)]));
    }
    const auto dense =
        run_solver([&] { return lstsq(A, B, problem.options); });
    const auto streamed =
        run_solver([&] { return lstsq_columns(columns, B, problem.options); });

    // Inputs are read, never written (bitwise: they are finite).
    EXPECT_TRUE(at::equal(A, problem.A)) << "lstsq modified A";
    EXPECT_TRUE(at::equal(B, problem.B)) << "lstsq modified B";
    for (int64_t j = 0; j < problem.k; ++j) {
      EXPECT_TRUE(at::equal(columns[static_cast<size_t>(j)], problem.A.select(1, j)))
          << "lstsq_columns modified column " << j;
    }

    check_refusal(problem, ref, dense, "dense");
    check_refusal(problem, ref, streamed, "streamed");
    EXPECT_EQ(dense.threw, streamed.threw) << dense.error << " / " << streamed.error;
    EXPECT_EQ(dense.rejected, streamed.rejected) << dense.error << " / " << streamed.error;
    if (dense.solved()) check_result(problem, ref, dense.result, "dense");
    if (streamed.solved()) check_result(problem, ref, streamed.result, "streamed");
    if (dense.solved() && streamed.solved()) check_agreement(dense.result, streamed.result);
    if (::testing::Test::HasFailure()) break;  // one reproducible failure, not hundreds
  }
  // The redraws keep the rank unambiguous; most problems must pass on the first draw (~82%
  // do), or the distribution is not what the summary at the top says.
  EXPECT_LT(redraws, problems / 2) << redraws << " redraws for " << problems << " problems";
}

// ---------------------------------------------------------------------------------------
// Bad input.

TEST(LstsqRandom, BadInputIsRejectedWithAMessageNamingTheProblem) {
  SCOPED_TRACE(test_support::seed_note());
  Draw draw(test_support::seeded(20260802));
  const int64_t cases = test_support::scaled(test_support::kSanitizedBuild ? 40 : 150);
  const LstsqMethod methods[] = {LstsqMethod::automatic, LstsqMethod::gram_cholesky,
                                 LstsqMethod::cholesky_qr, LstsqMethod::svd,
                                 LstsqMethod::gram_eigh};
  for (int64_t n = 0; n < cases; ++n) {
    const auto dtype = draw.chance(0.5) ? at::kDouble : at::kFloat;
    const int64_t k = draw.integer(1, 8);
    const int64_t rows = draw.chance(0.5) ? draw.integer(1, 200) : draw.integer(600, 3000);
    const bool matrix_rhs = draw.chance(0.5);
    at::manual_seed(draw.seed());
    auto A = at::randn({rows, k}, kF64).to(dtype);
    auto B = (matrix_rhs ? at::randn({rows, 2}, kF64) : at::randn({rows}, kF64)).to(dtype);
    LstsqOptions options;
    options.method = methods[draw.integer(0, 4)];
    options.equilibrate = draw.chance(0.5);
    const bool streaming = draw.chance(0.5);
    std::vector<at::Tensor> columns;
    for (int64_t j = 0; j < k; ++j) columns.push_back(A.select(1, j));
    std::string fragment;
    std::string what;
    const int64_t kind = draw.integer(0, 7);
    switch (kind) {
      case 0:
      case 1: {  // NaN or ±Inf at a random place of A or of B
        const double bad = draw.chance(0.5) ? std::numeric_limits<double>::quiet_NaN()
                                            : std::copysign(HUGE_VAL, draw.uniform(-1, 1));
        const int64_t row = draw.integer(0, rows - 1);
        if (kind == 0) {
          const int64_t col = draw.integer(0, k - 1);
          A[row][col] = bad;
          what = "A[" + std::to_string(row) + "][" + std::to_string(col) + "] = " + sci(bad);
        } else {
          (matrix_rhs ? B[row][draw.integer(0, 1)] : B[row]) = bad;
          what = "B row " + std::to_string(row) + " = " + sci(bad);
        }
        fragment = "NaN or Inf";
        break;
      }
      case 2:  // B with the wrong number of rows
        B = B.narrow(0, 0, rows - 1 >= 1 ? rows - 1 : 0);
        if (rows == 1) B = at::randn({2}, kF64).to(dtype);
        fragment = "rows but B has";
        what = "B rows " + std::to_string(B.size(0));
        break;
      case 3: {  // unsupported dtypes
        const at::ScalarType bad[] = {at::kInt, at::kLong, at::kHalf, at::kBFloat16};
        const auto type = bad[draw.integer(0, 3)];
        A = A.to(type);
        B = B.to(type);
        for (auto& column : columns) column = column.to(type);
        fragment = "unsupported dtype";
        what = std::string("dtype ") + c10::toString(type);
        break;
      }
      case 4:  // A and B of different dtypes
        B = B.to(dtype == at::kDouble ? at::kFloat : at::kDouble);
        fragment = "dtype";
        what = "B of the other dtype";
        break;
      case 5:  // empty A (no rows or no columns); B empty to match
        if (streaming && draw.chance(0.5)) {
          columns.clear();
          fragment = "no columns";
        } else {
          A = A.narrow(0, 0, 0);
          B = B.narrow(0, 0, 0);
          for (auto& column : columns) column = column.narrow(0, 0, 0);
          fragment = "empty";
        }
        what = "empty A";
        break;
      case 6:  // B of the wrong rank, or without columns
        B = draw.chance(0.5) ? at::randn({rows, 2, 2}, kF64).to(dtype)
                             : at::empty({rows, 0}, A.options());
        fragment = B.dim() == 3 ? "B must be 1-D" : "no columns";
        what = "B of shape " + std::to_string(B.dim()) + "-D";
        break;
      default:  // streaming: one column of another length (dense: of another dtype)
        if (k >= 2) {
          const auto j = static_cast<size_t>(draw.integer(1, k - 1));
          columns[j] = at::randn({rows + 1}, kF64).to(dtype);
          fragment = "column " + std::to_string(j) + " has " + std::to_string(rows + 1) + " rows";
          if (!streaming) {
            B = B.to(at::kHalf);
            fragment = "dtype";
          }
        } else {
          B = B.to(at::kHalf);
          fragment = "dtype";
        }
        what = "mismatched column";
        break;
    }
    SCOPED_TRACE("case " + std::to_string(n) + ": " + what + ", N=" + std::to_string(rows) +
                 " k=" + std::to_string(k) + (streaming ? " streaming" : " dense") + ", method " +
                 method_name(options.method));
    if (streaming) {
      testing::expect_invalid([&] { lstsq_columns(columns, B, options); }, fragment);
    } else {
      testing::expect_invalid([&] { lstsq(A, B, options); }, fragment);
    }
    if (::testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace tidepool::linalg
