// Fused CUDA kernels for one Apollo step (see apollo_kernels.h for the launch sequence).
// Raw pointers only, no LibTorch: nvcc on LibTorch headers is slow and not needed here.
//
// Why this shape: the LibTorch-ops step makes ~15 passes over each tensor and syncs the
// host for mean(D); these kernels read each state tensor twice (reduction, update) and
// write it once, which is what the HBM floor of the issue counts. Reductions accumulate in
// fp64 for fp32 tensors too, and are summed in a fixed order so that two runs of the same
// step give the same bits (required for the placement tests).
#include "optimizers/apollo_kernels.h"

#include <cuda_runtime.h>

#include <cmath>

namespace tidepool::optim::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;
// Scratch layout (doubles): partials [kMaxBlocks × 4] | D partials [kMaxBlocks] | finals.
constexpr int kPartials = 0;
constexpr int kDPartials = kMaxBlocks * 4;
constexpr int kFinals = kDPartials + kMaxBlocks;
constexpr int kFinalCount = 8;
// finals: [0] s = ‖d‖₄ + ε′, [1] Δ, [2] σ, [3] ε′, [4] mean(D)
enum Final { kS = 0, kDelta = 1, kSigma = 2, kEpsPrime = 3, kMeanD = 4 };

constexpr double kConstantRebound = 0.01;

int blocks_for(std::int64_t n) {
  std::int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Tree reduction of `count` values per thread across the block; thread 0 gets the result.
// `is_max` selects max instead of sum for each slot.
template <int Count>
__device__ void block_reduce(double (&v)[Count], const bool (&is_max)[Count]) {
  __shared__ double shared[Count][kThreads];
  for (int c = 0; c < Count; ++c) shared[c][threadIdx.x] = v[c];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      for (int c = 0; c < Count; ++c) {
        const double other = shared[c][threadIdx.x + stride];
        shared[c][threadIdx.x] =
            is_max[c] ? fmax(shared[c][threadIdx.x], other) : shared[c][threadIdx.x] + other;
      }
    }
    __syncthreads();
  }
  for (int c = 0; c < Count; ++c) v[c] = shared[c][0];
}

template <typename T>
__device__ T decayed_grad(const T* grad, const T* param, std::int64_t i,
                          const ApolloStepArgs& a) {
  T g = grad[i];
  if (a.decay == ApolloDecayMode::l2) g = g + param[i] * static_cast<T>(a.weight_decay);
  return g;
}

// Pass 1: Σd⁴, Σδ·d, ΣB·d², max|δ| per block.
template <typename T>
__global__ void reduce_kernel(const T* param, const T* grad, const T* exp_avg, const T* hessian,
                              const T* update, std::int64_t n, ApolloStepArgs a,
                              double* scratch) {
  double v[4] = {0.0, 0.0, 0.0, 0.0};
  const bool is_max[4] = {false, false, false, true};
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const T delta = decayed_grad(grad, param, i, a) - exp_avg[i];
    const double d = static_cast<double>(update[i]);
    const double d2 = d * d;
    v[0] += d2 * d2;
    v[1] += static_cast<double>(delta) * d;
    v[2] += static_cast<double>(hessian[i]) * d2;
    v[3] = fmax(v[3], fabs(static_cast<double>(delta)));
  }
  block_reduce<4>(v, is_max);
  if (threadIdx.x == 0) {
    for (int c = 0; c < 4; ++c) scratch[kPartials + blockIdx.x * 4 + c] = v[c];
  }
}

// Pass 2: one block combines the partials of `blocks` blocks in a fixed order.
__global__ void finalize_kernel(int blocks, ApolloStepArgs a, double* scratch) {
  double v[4] = {0.0, 0.0, 0.0, 0.0};
  const bool is_max[4] = {false, false, false, true};
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
    for (int c = 0; c < 3; ++c) v[c] += scratch[kPartials + b * 4 + c];
    v[3] = fmax(v[3], scratch[kPartials + b * 4 + 3]);
  }
  block_reduce<4>(v, is_max);
  if (threadIdx.x == 0) {
    const double sigma = a.belief ? v[3] : kConstantRebound;
    const double eps_prime = a.belief ? a.eps : a.eps / kConstantRebound;
    const double s = sqrt(sqrt(v[0])) + eps_prime;
    // Δ = −α⟨δ/s, d/s⟩ − ⟨B, (d/s)²⟩
    const double delta = -a.alpha * (v[1] / (s * s)) - v[2] / (s * s);
    scratch[kFinals + kS] = s;
    scratch[kFinals + kDelta] = delta;
    scratch[kFinals + kSigma] = sigma;
    scratch[kFinals + kEpsPrime] = eps_prime;
  }
}

// Pass 3: the elementwise update. With stable decay, θ is left for apply_stable_kernel and
// each block writes ΣD instead.
template <typename T>
__global__ void update_kernel(T* param, const T* grad, T* exp_avg, T* hessian, T* update,
                              std::int64_t n, ApolloStepArgs a, double* scratch) {
  const T s = static_cast<T>(scratch[kFinals + kS]);
  const T delta_b = static_cast<T>(scratch[kFinals + kDelta]);
  const T sigma = static_cast<T>(scratch[kFinals + kSigma]);
  const T floor_add = static_cast<T>(scratch[kFinals + kEpsPrime] / a.alpha);
  const T alpha = static_cast<T>(a.alpha);
  const T lr = static_cast<T>(a.lr);
  const T wd = static_cast<T>(a.weight_decay);
  double sum_d[1] = {0.0};
  const bool is_max[1] = {false};
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const T delta = decayed_grad(grad, param, i, a) - exp_avg[i];
    const T m = exp_avg[i] + alpha * delta;
    const T d = update[i] / s;
    const T b = hessian[i] + delta_b * (d * d);
    const T abs_b = b < T(0) ? -b : b;
    const T denom = a.belief ? (abs_b > sigma ? abs_b : sigma) + floor_add
                             : (abs_b > T(kConstantRebound) ? abs_b : T(kConstantRebound));
    T direction = m / denom;
    exp_avg[i] = m;
    hessian[i] = b;
    if (a.decay == ApolloDecayMode::stable) {
      update[i] = direction;
      sum_d[0] += static_cast<double>(denom);
      continue;
    }
    if (a.decay == ApolloDecayMode::decoupled) direction = direction + wd * param[i];
    update[i] = direction;
    param[i] = param[i] - lr * direction;
  }
  if (a.decay == ApolloDecayMode::stable) {
    block_reduce<1>(sum_d, is_max);
    if (threadIdx.x == 0) scratch[kDPartials + blockIdx.x] = sum_d[0];
  }
}

__global__ void finalize_mean_kernel(int blocks, std::int64_t n, double* scratch) {
  double v[1] = {0.0};
  const bool is_max[1] = {false};
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) v[0] += scratch[kDPartials + b];
  block_reduce<1>(v, is_max);
  if (threadIdx.x == 0) scratch[kFinals + kMeanD] = v[0] / static_cast<double>(n);
}

template <typename T>
__global__ void apply_stable_kernel(T* param, T* update, std::int64_t n, ApolloStepArgs a,
                                    const double* scratch) {
  const T wd = static_cast<T>(a.weight_decay / scratch[kFinals + kMeanD]);
  const T lr = static_cast<T>(a.lr);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const T direction = update[i] + wd * param[i];
    update[i] = direction;
    param[i] = param[i] - lr * direction;
  }
}

template <typename T>
int launch(T* param, const T* grad, T* exp_avg, T* hessian, T* update, std::int64_t n,
           const ApolloStepArgs& args, double* scratch, void* stream_ptr) {
  if (n <= 0) return cudaSuccess;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int blocks = blocks_for(n);
  reduce_kernel<T><<<blocks, kThreads, 0, stream>>>(param, grad, exp_avg, hessian, update, n,
                                                    args, scratch);
  finalize_kernel<<<1, kThreads, 0, stream>>>(blocks, args, scratch);
  update_kernel<T><<<blocks, kThreads, 0, stream>>>(param, grad, exp_avg, hessian, update, n,
                                                    args, scratch);
  if (args.decay == ApolloDecayMode::stable) {
    finalize_mean_kernel<<<1, kThreads, 0, stream>>>(blocks, n, scratch);
    apply_stable_kernel<T><<<blocks, kThreads, 0, stream>>>(param, update, n, args, scratch);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

std::size_t apollo_scratch_doubles() { return kFinals + kFinalCount; }

int apollo_step(float* param, const float* grad, float* exp_avg, float* hessian, float* update,
                std::int64_t n, const ApolloStepArgs& args, double* scratch, void* stream) {
  return launch(param, grad, exp_avg, hessian, update, n, args, scratch, stream);
}

int apollo_step(double* param, const double* grad, double* exp_avg, double* hessian,
                double* update, std::int64_t n, const ApolloStepArgs& args, double* scratch,
                void* stream) {
  return launch(param, grad, exp_avg, hessian, update, n, args, scratch, stream);
}

const char* apollo_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace tidepool::optim::kernels
