// The fused CUDA implementation of one Apollo step on one tensor, callable from C++ without
// CUDA or LibTorch headers: raw device pointers, a stream as void*, fp32 and fp64. The
// arithmetic is apollo_step_math.h's, which the host implementation shares.
//
// Three to five launches, no host synchronisation:
//   1. reduce    per block: Σg·d (g = grad [+ λθ for L2]), max|g − m| for belief, and
//                Σd⁴, Σm·d, ΣB·d² unless the previous step carried them (Note [carried
//                sums] in apollo_step_math.h)
//   2. finalize  one block combines the block partials in a fixed order (deterministic, so
//                a run is bitwise reproducible) and derives s = ‖d‖₄ + ε′, Δ and σ
//   3. update    elementwise: m, B, d and θ, summing Σd⁴, Σm·d, ΣB·d² of what it writes
//                for the next step (weight_decay_type stable: m, B, m/D and per-block ΣD
//                instead of θ, and no carry)
//   4-5. stable only: finalize mean(D), then d += λ/mean(D)·θ and θ −= η·d.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optimizers/apollo_step_math.h"

namespace tidepool::optim::kernels {

// Number of doubles of device scratch memory apollo_step needs (any n).
std::size_t apollo_scratch_doubles();

// One step on n contiguous elements. All pointers are device pointers on the stream's
// device; scratch holds apollo_scratch_doubles() doubles; carry.partials, if not null,
// apollo_carry_doubles(n) doubles that this step reads (when carry.valid) and rewrites
// for the next (unless the decay is stable: then it is left alone and not valid after).
// Returns the CUDA error code of the launches (0 on success).
int apollo_step(float* param, const float* grad, float* exp_avg, float* hessian,
                float* update, std::int64_t n, const ApolloStepArgs& args, double* scratch,
                ApolloCarry carry, void* stream);
int apollo_step(double* param, const double* grad, double* exp_avg, double* hessian,
                double* update, std::int64_t n, const ApolloStepArgs& args, double* scratch,
                ApolloCarry carry, void* stream);

// The message for an error code returned above.
const char* apollo_error_string(int code);

}  // namespace tidepool::optim::kernels
