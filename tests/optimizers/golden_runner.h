// Rebuilds a golden trajectory's problem (../shared/golden/README.md), runs tidepool's
// optimizer on it and measures how far the result is from the reference. Shared by the
// gtest battery (test_golden.cpp) and the command-line checker (tidepool_golden).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "json_value.h"
#include "optimizers/state_placement.h"

namespace tidepool::testing {

// The README's tolerance: |x − ref| ≤ kGoldenTolerance · (kGoldenFloor + |ref|).
inline constexpr double kGoldenTolerance = 1e-6;
inline constexpr double kGoldenFloor = 1e-3;
// fp32 runs against the fp64 reference (issue 5): |x − ref| ≤ kFloat32Tolerance.
inline constexpr double kFloat32Tolerance = 1e-4;

struct GoldenStep {
  double loss = 0.0;
  std::vector<std::vector<double>> params;  // flattened, in param_names order
};

struct GoldenCase {
  std::string name;
  std::string path;
  JsonValue optimizer;
  bool closure_protocol = false;
  std::vector<double> X, Y;
  std::vector<int64_t> X_shape, Y_shape;
  std::vector<std::vector<int64_t>> param_shapes;
  std::vector<std::vector<double>> init_params;
  std::vector<GoldenStep> steps;
};

// The *.json files of <shared>/golden, sorted (empty when the folder is missing).
std::vector<std::string> golden_files(const std::string& shared_dir);

// Throws std::runtime_error naming the file and the problem for malformed input.
GoldenCase load_golden(const std::string& path);

struct RunOptions {
  torch::Dtype dtype = torch::kFloat64;
  torch::Device device = torch::kCPU;
  // Apollo's state / AADL's history placement; null: the optimizer's default.
  std::shared_ptr<optim::StatePlacement> placement;
  // Apollo: the fused step (CUDA kernels for CUDA runs, the host implementation for CPU
  // runs); false: the LibTorch-ops path.
  bool fused_kernels = true;
  // > 0: after this many steps save the optimizer, build a fresh one on the same parameters,
  // load, and continue with it.
  int64_t reload_after = 0;
  // Steps to run; 0: as many as the golden file has.
  int64_t steps = 0;
};

struct Trajectory {
  std::vector<double> losses;                     // loss at the parameters after each step
  std::vector<std::vector<torch::Tensor>> params;  // CPU copies after each step
};

Trajectory run_golden(const GoldenCase& golden, const RunOptions& options = {});

struct Deviation {
  double max_scaled = 0.0;  // max over steps and elements of |x − ref| / (floor + |ref|)
  double max_loss_scaled = 0.0;
  double max_abs = 0.0;     // max over steps and elements of |x − ref|
  int64_t worst_step = 0;   // 1-based
  int64_t steps = 0;
};

Deviation compare(const GoldenCase& golden, const Trajectory& run);

// Pass or fail, decided in this one place for the CPU and GPU test batteries and the
// tidepool_golden checker:
//   fp64: the golden README's rule, exactly: every parameter at every step within
//         |x − ref| ≤ 1e-6·(1e-3 + |ref|) (max_scaled), the loss too (max_loss_scaled).
//   fp32: within 1e-4 of the fp64 reference, absolute (max_abs): the README's relative
//         rule is for fp64 runs; with its 1e-3 floor it would ask 1e-7 of entries near
//         zero, below fp32's own rounding after 25–30 steps. One measured exception:
//         aadl_sgd_anderson_closure, where the safeguard accepts Anderson points and the
//         ill-conditioned extrapolation amplifies fp32 rounding — the published Python
//         AADL, run in fp32 on that file, ends 8e-3 (peak 1.3e-2) from its own fp64
//         trajectory; it is held to that, 1.3e-2.
// Both also require the run to cover every step of the file.
struct Verdict {
  bool pass = false;
  double measured = 0.0;  // the deviation the rule bounds
  double bound = 0.0;
  const char* measure = "";  // "scaled" or "absolute"
};
Verdict judge(const GoldenCase& golden, const Deviation& deviation, torch::Dtype dtype);

// True when every parameter at every step is bitwise equal.
bool bitwise_equal(const Trajectory& a, const Trajectory& b);

}  // namespace tidepool::testing
