// Tests of tidepool::linalg::GramAccumulator, driven the way AADL drives it: a ring buffer
// of history columns, one set_column per step, a solve per step. Incremental results must
// equal a from-scratch Gram pass and lstsq_columns on the same columns.
#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "optimizers/linalg/gram_accumulator.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg {
namespace {

using testing::expect_invalid;
using testing::relative_error;

constexpr int64_t kRows = 20000;

at::Tensor fresh_gram(const std::vector<at::Tensor>& columns) {
  const auto X = at::stack(columns, 1).to(at::kDouble);
  return X.t().mm(X);
}

TEST(GramAccumulator, RingBufferUpdatesEqualFromScratchAndLstsqColumns) {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    constexpr int64_t kCapacity = 5;
    GramAccumulator accumulator(kCapacity);
    at::manual_seed(21);
    // A drifting iterate, as an optimizer's history looks: each column = previous + step.
    auto current = at::randn({kRows}, dtype);
    // The test's own copy of each slot's column: the reference must not come from the
    // accumulator under test (a wrong slot would match itself).
    std::vector<at::Tensor> stored(kCapacity);
    for (int64_t step = 0; step < 13; ++step) {
      current = current + 0.1 * at::randn({kRows}, dtype);
      const int64_t slot = step % kCapacity;
      stored[static_cast<std::size_t>(slot)] = current.clone();
      accumulator.set_column(slot, current.clone());
      ASSERT_EQ(accumulator.live_columns(), std::min<int64_t>(step + 1, kCapacity));
      if (step < 2) continue;

      // Logical order oldest → newest, the newest column is the right-hand side.
      std::vector<int64_t> order;
      const int64_t live = accumulator.live_columns();
      for (int64_t i = live; i > 0; --i) order.push_back((step + 1 - i) % kCapacity);
      std::vector<at::Tensor> columns;
      for (const int64_t s : order) {
        columns.push_back(stored[static_cast<std::size_t>(s)]);
        ASSERT_TRUE(at::equal(accumulator.column(s), columns.back())) << "slot " << s;
      }

      EXPECT_LT(relative_error(accumulator.gram(order), fresh_gram(columns)), 1e-13);
      const std::vector<int64_t> a_slots(order.begin(), order.end() - 1);
      const auto incremental = accumulator.solve(a_slots, order.back());
      const std::vector<at::Tensor> a_columns(columns.begin(), columns.end() - 1);
      const auto dense = lstsq_columns(a_columns, columns.back());
      EXPECT_LT(relative_error(incremental.solution, dense.solution),
                dtype == at::kFloat ? 1e-5 : 1e-9)
          << "step " << step;
      EXPECT_EQ(incremental.rank, static_cast<int64_t>(a_slots.size()));
    }
    // recompute() from the stored columns gives the same matrix.
    const std::vector<int64_t> all{0, 1, 2, 3, 4};
    const auto before = accumulator.gram(all);
    accumulator.recompute();
    EXPECT_LT(relative_error(accumulator.gram(all), before), 1e-13);
  }
}

TEST(GramAccumulator, ReplacingAndRemovingColumnsUpdatesOnlyTheirEntries) {
  GramAccumulator accumulator(4);
  at::manual_seed(22);
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < 4; ++j) {
    columns.push_back(at::randn({kRows}, at::kDouble));
    accumulator.set_column(j, columns.back());
  }
  columns[2] = at::randn({kRows}, at::kDouble);  // AADL: replace the newest column
  accumulator.set_column(2, columns[2]);
  EXPECT_LT(relative_error(accumulator.gram({0, 1, 2, 3}), fresh_gram(columns)), 1e-13);
  EXPECT_DOUBLE_EQ(accumulator.inner_product(2, 0), accumulator.inner_product(0, 2));

  accumulator.remove_column(1);
  EXPECT_FALSE(accumulator.has_column(1));
  EXPECT_EQ(accumulator.live_columns(), 3);
  EXPECT_LT(relative_error(accumulator.gram({0, 2, 3}),
                           fresh_gram({columns[0], columns[2], columns[3]})),
            1e-13);
  accumulator.clear();
  EXPECT_EQ(accumulator.live_columns(), 0);
}

TEST(GramAccumulator, IllConditionedHistoryFallsBackToMinimumNormFromTheGram) {
  GramAccumulator accumulator(4);
  at::manual_seed(23);
  const auto a = at::randn({kRows}, at::kDouble);
  const auto b = at::randn({kRows}, at::kDouble);
  accumulator.set_column(0, a);
  accumulator.set_column(1, a.clone());  // exact duplicate: singular AᵀA
  accumulator.set_column(2, b);
  accumulator.set_column(3, 2.0 * a + b + 0.01 * at::randn({kRows}, at::kDouble));
  const auto result = accumulator.solve({0, 1, 2}, 3);
  EXPECT_EQ(result.method, LstsqMethod::gram_eigh);
  EXPECT_EQ(result.rank, 2);
  const auto A = at::stack({a, a, b}, 1);
  const auto reference = at::linalg_pinv(A, 1e-10).mv(accumulator.column(3));
  EXPECT_LT(relative_error(result.solution, reference), 1e-8);
  EXPECT_NEAR(result.solution[0].item<double>(), 1.0, 1e-2);  // 2·a split over two copies

  // Tikhonov regularises the singular system: κ(AᵀA + λI) ≈ 2/1e-3 is within fp64's
  // default gram_condition_limit (1e4), so Cholesky takes it.
  LstsqOptions options;
  options.tikhonov = 1e-3;
  EXPECT_EQ(accumulator.solve({0, 1, 2}, 3, options).method, LstsqMethod::gram_cholesky);
  // Forced methods that re-read the columns go through lstsq_columns.
  options = {};
  options.method = LstsqMethod::svd;
  const auto svd = accumulator.solve({0, 1, 2}, 3, options);
  EXPECT_EQ(svd.method, LstsqMethod::svd);
  EXPECT_LT(relative_error(svd.solution, reference), 1e-10);
}

// Review finding: the eigh fallback solved the unscaled AᵀA truncated to the rank of the
// equilibrated one. Full rank with κ²(AD) ≈ 4e4 (so the fallback runs): relative error
// 0.55 at s = 1e-8. Rank-deficient at rcond 1e-3: it dropped the small column.
TEST(GramAccumulator, EighFallbackWorksInEquilibratedVariables) {
  for (const double s : {1.0, 1e-6, 1e-8}) {
    GramAccumulator accumulator(4);
    at::manual_seed(46);
    const auto a1 = at::randn({kRows}, at::kDouble);
    const auto a2 = s * at::randn({kRows}, at::kDouble);
    const auto a3 = a1 + 1e-2 * at::randn({kRows}, at::kDouble);
    accumulator.set_column(0, a1);
    accumulator.set_column(1, a2);
    accumulator.set_column(2, a3);
    accumulator.set_column(3, a1 + (2.0 / s) * a2 + 3.0 * a3);
    const auto result = accumulator.solve({0, 1, 2}, 3);
    EXPECT_EQ(result.method, LstsqMethod::gram_eigh) << s;
    EXPECT_EQ(result.rank, 3) << s;
    const auto unscaled = result.solution * testing::values({1.0, s, 1.0});
    EXPECT_LT(relative_error(unscaled, testing::values({1.0, 2.0, 3.0})), 1e-9) << s;

    // Near-collinear a3 ≈ a1 at rcond 1e-3: rank 2, and the same answer in every unit.
    accumulator.set_column(2, a1 + 1e-4 * at::randn({kRows}, at::kDouble));
    accumulator.set_column(3, a1 + (1.0 / s) * a2 + 1e-3 * at::randn({kRows}, at::kDouble));
    LstsqOptions options;
    options.rcond = 1e-3;
    const auto truncated = accumulator.solve({0, 1, 2}, 3, options);
    EXPECT_EQ(truncated.rank, 2) << s;
    EXPECT_DOUBLE_EQ(truncated.rcond, 1e-3) << s;
    EXPECT_NEAR(truncated.solution[0].item<double>(), 0.5, 0.05) << s;
    EXPECT_NEAR(truncated.solution[1].item<double>() * s, 1.0, 0.05) << s;
    EXPECT_NEAR(truncated.solution[2].item<double>(), 0.5, 0.05) << s;
  }
}

TEST(GramAccumulator, ForcedGramCholeskyRefusesToTruncate) {
  GramAccumulator accumulator(3);
  at::manual_seed(47);
  const auto a = at::randn({kRows}, at::kDouble);
  accumulator.set_column(0, a);
  accumulator.set_column(1, a + 1e-3 * at::randn({kRows}, at::kDouble));
  accumulator.set_column(2, at::randn({kRows}, at::kDouble));
  LstsqOptions options;
  options.method = LstsqMethod::gram_cholesky;
  options.rcond = 1e-2;
  EXPECT_THROW(accumulator.solve({0, 1}, 2, options), std::runtime_error);
  options.rcond = 1e-6;
  const auto full = accumulator.solve({0, 1}, 2, options);
  EXPECT_EQ(full.rank, 2);
  EXPECT_DOUBLE_EQ(full.rcond, 1e-6);
}

TEST(GramAccumulator, BadInputIsRejectedAndLeavesStateUnchanged) {
  GramAccumulator accumulator(3);
  const auto a = at::randn({100}, at::kDouble);
  accumulator.set_column(0, a);
  const auto before = accumulator.gram({0});
  expect_invalid([] { GramAccumulator bad(0); }, "capacity");
  expect_invalid([&] { accumulator.set_column(3, a); }, "outside [0, 3)");
  expect_invalid([&] { accumulator.set_column(-1, a); }, "outside");
  expect_invalid([&] { accumulator.set_column(1, at::randn({99}, at::kDouble)); },
                 "does not match");
  expect_invalid([&] { accumulator.set_column(1, at::randn({100}, at::kFloat)); },
                 "does not match");
  expect_invalid([&] { accumulator.set_column(1, at::randn({10, 10}, at::kDouble)); }, "1-D");
  expect_invalid([&] { accumulator.set_column(1, at::ones({100}, at::kInt)); },
                 "unsupported dtype");
  // Review finding: these threw c10::Error from inside the dot products.
  expect_invalid([&] { accumulator.set_column(1, at::randn({100}, at::kDouble).to_sparse()); },
                 "Sparse tensor");
  const auto meta = at::empty({100}, at::TensorOptions(at::kDouble).device(at::kMeta));
  expect_invalid([&] { accumulator.set_column(1, meta); },
                 "columns must be on the CPU or a CUDA device");
  auto with_nan = at::randn({100}, at::kDouble);
  with_nan[5] = std::numeric_limits<double>::quiet_NaN();
  expect_invalid([&] { accumulator.set_column(1, with_nan); }, "NaN or Inf");
  expect_invalid([&] { accumulator.inner_product(0, 2); }, "slot 2 is empty");
  expect_invalid([&] { accumulator.solve({}, 0); }, "no columns");
  expect_invalid([&] { accumulator.solve({1}, 0); }, "empty");
  expect_invalid([&] { accumulator.remove_column(2); }, "empty");
  EXPECT_EQ(accumulator.live_columns(), 1);
  EXPECT_FALSE(accumulator.has_column(1));
  EXPECT_TRUE(at::equal(accumulator.gram({0}), before));
}

// Review finding: solve checked only options.tikhonov, so rcond = inf gave y = 0 at rank 0,
// rcond = NaN was silently the default and gram_condition_limit = 0 always fell back to
// gram_eigh. It must refuse what lstsq refuses, with lstsq's words.
TEST(GramAccumulator, InvalidOptionsAreRejectedAsLstsqRejectsThem) {
  at::manual_seed(33);
  const auto a0 = at::randn({kRows}, at::kDouble);
  const auto a1 = at::randn({kRows}, at::kDouble);
  GramAccumulator accumulator(3);
  accumulator.set_column(0, a0);
  accumulator.set_column(1, a1);
  accumulator.set_column(2, a0 + 2.0 * a1);
  const std::string lstsq_prefix = "tidepool::linalg::lstsq: ";
  LstsqOptions infinite_rcond;
  infinite_rcond.rcond = std::numeric_limits<double>::infinity();
  LstsqOptions nan_rcond;
  nan_rcond.rcond = std::numeric_limits<double>::quiet_NaN();
  LstsqOptions zero_limit;
  zero_limit.gram_condition_limit = 0.0;
  for (const auto& options : {infinite_rcond, nan_rcond, zero_limit}) {
    std::string lstsq_message;
    try {
      lstsq_columns({a0, a1}, accumulator.column(2), options);
    } catch (const std::invalid_argument& error) {
      lstsq_message = error.what();
    }
    ASSERT_EQ(lstsq_message.rfind(lstsq_prefix, 0), 0u) << lstsq_message;
    const std::string reason = lstsq_message.substr(lstsq_prefix.size());
    for (const auto method : {LstsqMethod::automatic, LstsqMethod::gram_cholesky,
                              LstsqMethod::gram_eigh}) {
      LstsqOptions forced = options;
      forced.method = method;
      expect_invalid([&] { accumulator.solve({0, 1}, 2, forced); }, reason);
    }
  }
  // Review finding: an LstsqMethod value outside the enum (cast from an unchecked integer)
  // ran as automatic, here and in lstsq.
  for (const int value : {-1, 5, 7}) {
    LstsqOptions options;
    options.method = static_cast<LstsqMethod>(value);
    const std::string reason = "options.method " + std::to_string(value) + " is no LstsqMethod";
    expect_invalid([&] { lstsq_columns({a0, a1}, accumulator.column(2), options); }, reason);
    expect_invalid([&] { accumulator.solve({0, 1}, 2, options); }, reason);
  }
}

// Review finding: solve took the Gram residual (a cancellation) even when the caller asked
// for exact_residual, as lstsq honours it: for a nearly consistent system that residual
// is noise of ~√(√N·eps64) of the problem's scale.
TEST(GramAccumulator, ExactResidualIsMeasuredFromTheColumns) {
  at::manual_seed(37);
  const auto a0 = at::randn({kRows}, at::kDouble);
  const auto a1 = at::randn({kRows}, at::kDouble);
  const auto b = a0 + 2.0 * a1 + 1e-9 * at::randn({kRows}, at::kDouble);
  GramAccumulator accumulator(3);
  accumulator.set_column(0, a0);
  accumulator.set_column(1, a1);
  accumulator.set_column(2, b);
  LstsqOptions options;
  options.exact_residual = true;
  const auto result = accumulator.solve({0, 1}, 2, options);
  const double direct = (b - a0 * result.solution[0].item<double>() -
                         a1 * result.solution[1].item<double>())
                            .norm()
                            .item<double>();
  EXPECT_NEAR(result.residual_norm / direct, 1.0, 1e-6) << result.residual_norm << " " << direct;
}

// Review finding: the Gram eigenvalues summed ‖G‖²_F unscaled, which overflows for entries
// ≳ 1.3e154 and underflows for entries ≲ 1e-162, so no Jacobi sweep ran and G's diagonal
// passed for its eigenvalues: unequilibrated, this κ = 1e7 history read as κ ≈ 7.5 and
// was solved by Cholesky. The estimate must not depend on the columns' units.
TEST(GramAccumulator, ConditionEstimateDoesNotDependOnUnits) {
  const auto A = testing::matrix_with_condition(kRows, 3, 1e7, 34);
  for (const double scale : {1e78, 1e-85}) {
    GramAccumulator accumulator(4);
    for (int64_t j = 0; j < 3; ++j) accumulator.set_column(j, A.select(1, j) * scale);
    accumulator.set_column(3, A.mv(testing::values({1.0, 2.0, 3.0})) * scale);
    LstsqOptions options;
    options.equilibrate = false;
    const auto result = accumulator.solve({0, 1, 2}, 3, options);
    EXPECT_EQ(result.method, LstsqMethod::gram_eigh) << scale;
    EXPECT_GT(result.condition, 1e6) << scale;
    EXPECT_LT(result.condition, 1e8) << scale;
  }
}

// Review finding: each column's ‖c‖² is finite but their sum is not, so a relative λ was
// +inf; it must be refused as lstsq refuses it.
TEST(GramAccumulator, RelativeTikhonovWhoseTraceOverflowsIsRefused) {
  at::manual_seed(35);
  auto A = at::randn({kRows, 2}, at::kDouble);
  A = A / A.norm(2, {0}, /*keepdim=*/true) * 1.2e154;
  GramAccumulator accumulator(3);
  accumulator.set_column(0, A.select(1, 0));
  accumulator.set_column(1, A.select(1, 1));
  accumulator.set_column(2, 0.5 * A.select(1, 0));
  for (const auto method :
       {LstsqMethod::automatic, LstsqMethod::gram_cholesky, LstsqMethod::gram_eigh}) {
    LstsqOptions options;
    options.method = method;
    options.tikhonov = 1e-6;
    expect_invalid([&] { accumulator.solve({0, 1}, 2, options); }, "overflows");
  }
}

// Note [Underflowing squares] (lstsq.cpp): a column of entries ~1e-160 is all but absent
// from the Gram matrix (its squares are subnormal), which would give a wrong rank and
// coefficient; automatic solves from the columns by the SVD, the forced Gram methods
// refuse, as lstsq does.
TEST(GramAccumulator, AColumnWhoseSquaresUnderflowIsSolvedFromTheColumns) {
  at::manual_seed(31);
  const auto tiny = at::randn({kRows}, at::kDouble) * 1e-160;
  const auto plain = at::randn({kRows}, at::kDouble);
  GramAccumulator accumulator(3);
  accumulator.set_column(0, tiny);
  accumulator.set_column(1, plain);
  // The tiny column carries as much of b as the other (coefficient 2e160): well posed.
  accumulator.set_column(2, (2.0 / 1e-160) * tiny + 3.0 * plain);
  const auto result = accumulator.solve({0, 1}, 2);
  EXPECT_EQ(result.method, LstsqMethod::svd);
  EXPECT_EQ(result.rank, 2);
  EXPECT_EQ(result.solution.scalar_type(), at::kDouble);
  EXPECT_TRUE(result.solution.is_cpu());
  EXPECT_LT(relative_error(result.solution * at::tensor({1e-160, 1.0}, at::kDouble),
                           at::tensor({2.0, 3.0}, at::kDouble)),
            1e-12);
  for (const auto method : {LstsqMethod::gram_cholesky, LstsqMethod::gram_eigh}) {
    LstsqOptions forced;
    forced.method = method;
    expect_invalid([&] { accumulator.solve({0, 1}, 2, forced); }, "slot 0 is so small");
  }
}

// A right-hand side that small loses bᵀb, and with it the residual the Gram matrix gives:
// it is measured from the columns.
TEST(GramAccumulator, ATinyRightHandSidesResidualIsMeasuredFromTheColumns) {
  at::manual_seed(32);
  const auto a0 = at::randn({kRows}, at::kDouble);
  const auto a1 = at::randn({kRows}, at::kDouble);
  const auto b = at::randn({kRows}, at::kDouble) * 1e-160;
  GramAccumulator accumulator(3);
  accumulator.set_column(0, a0);
  accumulator.set_column(1, a1);
  accumulator.set_column(2, b);
  const auto result = accumulator.solve({0, 1}, 2);
  const auto y = result.solution * 1e160;  // in units where nothing underflows
  const double expected =
      (b * 1e160 - a0 * y[0].item<double>() - a1 * y[1].item<double>()).norm().item<double>() *
      1e-160;
  ASSERT_EQ(result.residual_norms.size(), 1u);
  EXPECT_NEAR(result.residual_norms[0] / expected, 1.0, 1e-12);
  EXPECT_GT(result.residual_norm, 0.0);
}

// The same for the accumulator: a right-hand side whose products with the columns
// underflow is solved by the SVD from the columns (automatic), or refused (forced Gram).
TEST(GramAccumulator, ARightHandSideWhoseProductsUnderflowIsSolvedFromTheColumns) {
  at::manual_seed(38);
  const auto a0 = at::randn({kRows}, at::kDouble) * 1e-100;
  const auto a1 = at::randn({kRows}, at::kDouble) * 1e-100;
  const auto b = (a0 - 2.0 * a1) * 1e-122;
  GramAccumulator accumulator(3);
  accumulator.set_column(0, a0);
  accumulator.set_column(1, a1);
  accumulator.set_column(2, b);
  const auto result = accumulator.solve({0, 1}, 2);
  EXPECT_EQ(result.method, LstsqMethod::svd);
  const auto y = result.solution * 1e122;
  EXPECT_NEAR(y[0].item<double>(), 1.0, 1e-10);
  EXPECT_NEAR(y[1].item<double>(), -2.0, 1e-10);
  for (const auto method : {LstsqMethod::gram_cholesky, LstsqMethod::gram_eigh}) {
    LstsqOptions options;
    options.method = method;
    expect_invalid([&] { accumulator.solve({0, 1}, 2, options); }, "products underflow");
  }
}

}  // namespace
}  // namespace tidepool::linalg
