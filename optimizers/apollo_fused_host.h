// The fused Apollo step on host memory: the algorithm of the CUDA kernels
// (apollo_kernels.h), with their sums and element updates (apollo_step_math.h) over a
// partition of its own, the blocks run on LibTorch's intra-op thread pool. Apollo uses it
// for CPU parameters (two passes over the state where the LibTorch-ops path makes about
// fifteen), and it is how CI, which has no GPU, runs the fused algorithm and its carried
// sums at all.
#pragma once

#include <cstdint>

#include "allocator/export.h"
#include "optimizers/apollo_step_math.h"

namespace tidepool::optim::kernels {

// One step on n contiguous elements of host memory; carry as in apollo_kernels.h's
// apollo_step (host memory too). The result does not depend on the number of threads.
// Exported for the tests, which check the carried sums on it directly.
TIDEPOOL_API void apollo_step_host(float* param, const float* grad, float* exp_avg, float* hessian,
                      float* update, std::int64_t n, const ApolloStepArgs& args,
                      ApolloCarry carry);
TIDEPOOL_API void apollo_step_host(double* param, const double* grad, double* exp_avg,
                      double* hessian, double* update, std::int64_t n, const ApolloStepArgs& args,
                      ApolloCarry carry);

}  // namespace tidepool::optim::kernels
