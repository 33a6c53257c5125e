// The gtest form of a golden run's verdict, shared by the CPU battery (test_golden.cpp) and
// the GPU one (gpu_test_optimizers.cpp): pass/fail by judge(), the rule tidepool_golden
// applies too, with the deviation and the worst step in the failure message.
#pragma once

#include <gtest/gtest.h>

#include "golden_runner.h"

namespace tidepool::testing {

inline void expect_passes(const GoldenCase& golden, const RunOptions& options) {
  const Deviation d = compare(golden, run_golden(golden, options));
  const Verdict v = judge(golden, d, options.dtype);
  EXPECT_TRUE(v.pass) << v.measure << " deviation " << v.measured << " > " << v.bound
                      << " (worst step " << d.worst_step << ", " << d.steps << " steps)";
}

}  // namespace tidepool::testing
