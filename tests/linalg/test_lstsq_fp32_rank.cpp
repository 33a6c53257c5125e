// CPU tests of the default rcond on fp32 input: a well-posed fp32 problem with κ ≤ 1e6 —
// the range where lstsq.h promises CPU and CUDA agree — is solved at full rank for every
// history depth AADL uses (k ≤ 20), with room to spare, so that the rank cannot flip
// between two devices whose fp64 rounding differs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg {
namespace {

using testing::matrix_with_condition;
using testing::relative_error;

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// Review finding: the fp32 default was k·eps32, which at k = 9 is 1.07e-6 and at k = 20
// 2.4e-6, so κ = 1e6 lost its smallest direction (and at k = 8, 9.5e-7, it kept it by 5%).
TEST(LstsqFp32DefaultRcond, KeepsFullRankUpToCondition1e6ForEveryHistoryDepth) {
  for (const int64_t k : {5, 8, 9, 16, 20}) {
    const auto A = matrix_with_condition(20000, k, 1e6, 50 + static_cast<uint64_t>(k))
                       .to(at::kFloat);
    const auto b = A.to(at::kDouble).mv(at::linspace(1.0, 2.0, k, kF64)).to(at::kFloat);
    // The stored fp32 data, solved exactly in fp64 at full rank.
    const auto reference = at::linalg_pinv(A.to(at::kDouble), 1e-14).mv(b.to(at::kDouble));
    for (const auto method : {LstsqMethod::automatic, LstsqMethod::cholesky_qr,
                              LstsqMethod::svd}) {
      LstsqOptions options;
      options.method = method;
      const auto result = lstsq(A, b, options);
      EXPECT_EQ(result.rank, k) << method_name(method) << " k=" << k << " rcond "
                                << result.rcond << " condition " << result.condition;
      // Three times below 1/κ: the margin that keeps the rank decision off the threshold.
      EXPECT_LT(result.rcond * result.condition, 1.0 / 3.0)
          << method_name(method) << " k=" << k;
      // Truncating the smallest direction moves x by O(1); keeping it leaves the fp64
      // rounding of the chosen route (≤ κ²·eps64 on the Gram route).
      EXPECT_LT(relative_error(result.solution, reference), 1e-3)
          << method_name(method) << " k=" << k;
    }
  }
}

// The data's precision still bounds the default from below: fp32 columns that agree to
// within fp32 rounding count as one direction.
TEST(LstsqFp32DefaultRcond, ColumnsEqualToFp32PrecisionAreOneDirection) {
  at::manual_seed(51);
  const auto base = at::randn({20000, 4}, kF64);
  auto A = at::cat({base, base.narrow(1, 0, 1) *
                              (1.0 + 1e-8 * at::randn({20000, 1}, kF64))},
                   1)
               .to(at::kFloat);
  const auto b = A.to(at::kDouble).mv(at::ones({5}, kF64)).to(at::kFloat);
  const auto result = lstsq(A, b);
  EXPECT_EQ(result.rank, 4) << "rcond " << result.rcond;
}

}  // namespace
}  // namespace tidepool::linalg
