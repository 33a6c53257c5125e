// Fused CUDA kernels for one Apollo step (see apollo_kernels.h for the launch sequence and
// apollo_step_math.h for the arithmetic and the partition, shared with the host version).
// Raw pointers only, no LibTorch: nvcc on LibTorch headers is slow and not needed here.
//
// Why this shape: the LibTorch-ops step makes ~15 passes over each tensor and syncs the
// host for mean(D); these kernels read g and d once for the reductions (m too for belief,
// θ for L2; Note [carried sums]) and the state once more for the update, which writes it
// once. Reductions accumulate in fp64 for fp32 tensors too, and are combined in a fixed
// order so that two runs of the same step give the same bits (the placement tests).
//
// Note [Loads in flight]
// A pass is bound by memory latency unless each thread keeps several loads in flight:
// with one element per thread and iteration, a grid-stride loop has at most one load per
// array outstanding per thread (the update pass cannot even start the next element's
// loads early, since its stores might alias them as far as the compiler knows), about a
// quarter of what the H200 needs to stream at its copy rate. So every pass takes kUnroll
// elements of its grid-stride walk at a time (i, i + stride, …), loads them all, then
// handles them in the walk's order: each thread still visits the same elements in the
// same order and adds them to its sums in that order, so no bit changes against one
// element at a time (and the carried sums stay equal to recomputed ones).
#include "optimizers/apollo_kernels.h"

#include <cuda_runtime.h>

namespace tidepool::optim::kernels {
namespace {

constexpr int kThreads = kApolloThreads;
constexpr int kMaxBlocks = kApolloMaxBlocks;
// Scratch layout (doubles): partials [kMaxBlocks × kApolloSums] | D partials [kMaxBlocks] |
// finals.
constexpr int kPartials = 0;
constexpr int kDPartials = kMaxBlocks * kApolloSums;
constexpr int kFinals = kDPartials + kMaxBlocks;
constexpr int kFinalCount = 8;
// finals: [0] s = ‖d‖₄ + ε′, [1] Δ, [2] σ, [3] ε′, [4] mean(D)
enum Final { kS = 0, kDelta = 1, kSigma = 2, kEpsPrime = 3, kMeanD = 4 };

// Tree reduction of Count values per thread across the block, slot c by
// apollo_combine(c) (a sum, or the max for kMaxDelta); thread 0 gets the result. The tree
// (stride 128, 64, ..., 1) is fixed, so the result is too.
template <int Count>
__device__ void block_reduce(double (&v)[Count]) {
  __shared__ double shared[Count][kThreads];
  for (int c = 0; c < Count; ++c) shared[c][threadIdx.x] = v[c];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      for (int c = 0; c < Count; ++c) {
        shared[c][threadIdx.x] = apollo_combine(c, shared[c][threadIdx.x],
                                                shared[c][threadIdx.x + stride]);
      }
    }
    __syncthreads();
  }
  for (int c = 0; c < Count; ++c) v[c] = shared[c][0];
}

__device__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

// Elements of a thread's grid-stride walk loaded together (Note [Loads in flight]).
constexpr int kUnroll = 4;

// The thread's grid-stride walk over [0, n) in the order of one element at a time, kUnroll
// elements per round while a whole round fits, then one by one: load(i) reads element i
// (every load of a round is issued before any use), use(i, loaded) handles it.
template <typename Load, typename Use>
__device__ void walk_unrolled(std::int64_t n, Load load, Use use) {
  const std::int64_t stride = grid_stride();
  std::int64_t i = first_index();
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    decltype(load(i)) loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) loaded[u] = load(i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) use(i + u * stride, loaded[u]);
  }
  for (; i < n; i += stride) use(i, load(i));
}

// Pass 1: Σg·d, max|g − m| and, without a carry, Σd⁴, Σm·d, ΣB·d², per block.
template <typename T>
__global__ void reduce_kernel(const T* param, const T* grad, const T* exp_avg, const T* hessian,
                              const T* update, std::int64_t n, ApolloStepArgs a, bool carried,
                              double* scratch) {
  double v[kApolloSums] = {0.0, 0.0, 0.0, 0.0, 0.0};
  walk_unrolled(
      n,
      [&](std::int64_t i) {
        return apollo_load_first_pass(param, grad, exp_avg, hessian, update, i, a, carried);
      },
      [&](std::int64_t, const ApolloFirstPassElement<T>& e) {
        apollo_add_first_pass_values(ApolloSumSlots{v, 1}, e, a, carried);
      });
  block_reduce(v);
  if (threadIdx.x == 0) {
    for (int c = 0; c < kApolloSums; ++c) scratch[kPartials + blockIdx.x * kApolloSums + c] = v[c];
  }
}

// Pass 2: one block combines the partials of `blocks` blocks in a fixed order, the state
// sums from the carry when it holds them.
__global__ void finalize_kernel(int blocks, ApolloStepArgs a, const double* carried,
                                double* scratch) {
  double v[kApolloSums] = {0.0, 0.0, 0.0, 0.0, 0.0};
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
    for (int c = 0; c < kApolloSums; ++c) {
      const double x = carried != nullptr && c < kApolloCarried
                           ? carried[b * kApolloCarried + c]
                           : scratch[kPartials + b * kApolloSums + c];
      v[c] = apollo_combine(c, v[c], x);
    }
  }
  block_reduce(v);
  if (threadIdx.x == 0) {
    const ApolloFinals f = apollo_finals(v, a);
    scratch[kFinals + kS] = f.s;
    scratch[kFinals + kDelta] = f.delta;
    scratch[kFinals + kSigma] = f.sigma;
    scratch[kFinals + kEpsPrime] = f.eps_prime;
  }
}

// Pass 3: the elementwise update. With stable decay, θ is left for apply_stable_kernel and
// each block writes ΣD; otherwise, with carry_out, each block writes the state sums of
// what it wrote for the next step.
template <typename T>
__global__ void update_kernel(T* param, const T* grad, T* exp_avg, T* hessian, T* update,
                              std::int64_t n, ApolloStepArgs a, double* carry_out,
                              double* scratch) {
  ApolloFinals f;
  f.s = scratch[kFinals + kS];
  f.delta = scratch[kFinals + kDelta];
  f.sigma = scratch[kFinals + kSigma];
  f.eps_prime = scratch[kFinals + kEpsPrime];
  const ApolloElementScalars<T> k = apollo_element_scalars<T>(f, a);
  const bool stable = a.decay == ApolloDecayMode::stable;
  double sum_d[1] = {0.0};
  double carried[kApolloCarried] = {0.0, 0.0, 0.0};
  walk_unrolled(
      n,
      [&](std::int64_t i) {
        return apollo_load_update(param, grad, exp_avg, hessian, update, i, a);
      },
      [&](std::int64_t i, const ApolloUpdateElement<T>& e) {
        const ApolloUpdated<T> u = apollo_update_values(e, k, a);
        apollo_store_update(param, exp_avg, hessian, update, i, u, a);
        if (stable) {
          sum_d[0] += static_cast<double>(u.denom);
        } else if (carry_out != nullptr) {
          apollo_add_state_terms(ApolloSumSlots{carried, 1}, u.m, u.b, u.d);
        }
      });
  if (stable) {
    block_reduce(sum_d);
    if (threadIdx.x == 0) scratch[kDPartials + blockIdx.x] = sum_d[0];
  } else if (carry_out != nullptr) {
    block_reduce(carried);
    if (threadIdx.x == 0) {
      for (int c = 0; c < kApolloCarried; ++c)
        carry_out[blockIdx.x * kApolloCarried + c] = carried[c];
    }
  }
}

__global__ void finalize_mean_kernel(int blocks, std::int64_t n, double* scratch) {
  double v[1] = {0.0};
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) v[0] += scratch[kDPartials + b];
  block_reduce(v);
  if (threadIdx.x == 0) scratch[kFinals + kMeanD] = v[0] / static_cast<double>(n);
}

template <typename T>
__global__ void apply_stable_kernel(T* param, T* update, std::int64_t n, ApolloStepArgs a,
                                    const double* scratch) {
  const T wd = static_cast<T>(a.weight_decay / scratch[kFinals + kMeanD]);
  const T lr = static_cast<T>(a.lr);
  walk_unrolled(
      n, [&](std::int64_t i) { return ApolloStable<T>{param[i], update[i]}; },
      [&](std::int64_t i, const ApolloStable<T>& e) {
        const ApolloStable<T> out = apollo_stable_values(e, wd, lr);
        update[i] = out.update;
        param[i] = out.param;
      });
}

template <typename T>
int launch(T* param, const T* grad, T* exp_avg, T* hessian, T* update, std::int64_t n,
           const ApolloStepArgs& args, double* scratch, ApolloCarry carry, void* stream_ptr) {
  if (n <= 0) return cudaSuccess;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int blocks = apollo_blocks(n);
  const bool carried = carry.partials != nullptr && carry.valid;
  double* carry_out = apollo_keeps_carry(args) ? carry.partials : nullptr;
  reduce_kernel<T><<<blocks, kThreads, 0, stream>>>(param, grad, exp_avg, hessian, update, n,
                                                    args, carried, scratch);
  finalize_kernel<<<1, kThreads, 0, stream>>>(blocks, args, carried ? carry.partials : nullptr,
                                              scratch);
  update_kernel<T><<<blocks, kThreads, 0, stream>>>(param, grad, exp_avg, hessian, update, n,
                                                    args, carry_out, scratch);
  if (args.decay == ApolloDecayMode::stable) {
    finalize_mean_kernel<<<1, kThreads, 0, stream>>>(blocks, n, scratch);
    apply_stable_kernel<T><<<blocks, kThreads, 0, stream>>>(param, update, n, args, scratch);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

std::size_t apollo_scratch_doubles() { return kFinals + kFinalCount; }

int apollo_step(float* param, const float* grad, float* exp_avg, float* hessian, float* update,
                std::int64_t n, const ApolloStepArgs& args, double* scratch, ApolloCarry carry,
                void* stream) {
  return launch(param, grad, exp_avg, hessian, update, n, args, scratch, carry, stream);
}

int apollo_step(double* param, const double* grad, double* exp_avg, double* hessian,
                double* update, std::int64_t n, const ApolloStepArgs& args, double* scratch,
                ApolloCarry carry, void* stream) {
  return launch(param, grad, exp_avg, hessian, update, n, args, scratch, carry, stream);
}

const char* apollo_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace tidepool::optim::kernels
