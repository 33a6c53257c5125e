// The fused CUDA implementation of one Apollo step on one tensor, callable from C++ without
// CUDA or LibTorch headers: raw device pointers, a stream as void*, fp32 and fp64.
//
// Three to five launches, no host synchronisation:
//   1. reduce    per block: Σd⁴, Σδ·d, ΣB·d², max|δ| in fp64 (δ = g [+ λθ for L2] − m)
//   2. finalize  one block sums the block partials in a fixed order (deterministic, so a
//                run is bitwise reproducible) and derives s = ‖d‖₄ + ε′, Δ and σ
//   3. update    elementwise: m, B, d and θ (weight_decay_type stable: m, B, m/D and
//                per-block ΣD instead of θ)
//   4-5. stable only: finalize mean(D), then d += λ/mean(D)·θ and θ −= η·d.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tidepool::optim::kernels {

enum class ApolloDecayMode : int { none = 0, l2 = 1, decoupled = 2, stable = 3 };

struct ApolloStepArgs {
  double alpha = 0.0;         // (1 − β) / (1 − βᵗ)
  double eps = 0.0;           // ε as given (the kernel applies the constant-rebound ε/σ)
  double lr = 0.0;            // η for this step (after warmup)
  double weight_decay = 0.0;  // λ
  bool belief = false;        // rebound belief (σ = ‖δ‖∞) instead of constant (σ = 0.01)
  ApolloDecayMode decay = ApolloDecayMode::none;
};

// Number of doubles of device scratch memory apollo_step needs (any n).
std::size_t apollo_scratch_doubles();

// One step on n contiguous elements. All pointers are device pointers on the stream's
// device; scratch holds apollo_scratch_doubles() doubles. Returns the CUDA error code of the
// launches (0 on success).
int apollo_step(float* param, const float* grad, float* exp_avg, float* hessian,
                float* update, std::int64_t n, const ApolloStepArgs& args, double* scratch,
                void* stream);
int apollo_step(double* param, const double* grad, double* exp_avg, double* hessian,
                double* update, std::int64_t n, const ApolloStepArgs& args, double* scratch,
                void* stream);

// The message for an error code returned above.
const char* apollo_error_string(int code);

}  // namespace tidepool::optim::kernels
