// The arithmetic of one fused Apollo step, shared by the CUDA kernels (apollo_kernels.cu)
// and the host implementation (apollo_fused_host.cpp): what the passes sum, how the sums
// become s, Δ and σ, and the update of one element. Plain C++ with no CUDA or LibTorch
// headers: nvcc compiles it as host+device code.
//
// Each implementation splits the elements into at most kApolloMaxBlocks blocks in a way
// that depends on n alone (the kernels: kApolloThreads threads per block, grid-stride; the
// host: contiguous ranges, a few lanes each), sums each block's share in fp64 in a fixed
// order and combines the block partials in a fixed order. So a step gives the same bits
// every time and on any number of host threads (the placement and save/load tests need
// that); the two implementations need not give the same bits as each other.
//
// Note [carried sums]
// ~~~~~~~~~~~~~~~~~~~
// Step t needs, before it can update any element, five reductions over the whole tensor:
// Σd⁴, Σm·d, ΣB·d² (d, m, B as the previous step left them), Σg·d and max|g − m|
// (belief only), where g is this step's gradient (+ λθ for L2). The first three involve only
// state that the previous step's update pass wrote, so that pass sums them as it writes them
// (per block, from registers: no extra memory traffic) and keeps the block partials in
// the parameter's carried-sums buffer (at most kApolloCarried × kApolloMaxBlocks doubles,
// 24 KiB). Step t then reads only g and d (and m for belief,
// θ for L2) before the update, instead of g, m, B, d: 44 B/param in fp32 without decay
// rather than 52 B against the 36 B the update itself must move (bench/RESULTS.md).
// ⟨δ, d⟩ is computed as Σg·d − Σm·d in fp64 in both cases, and the update pass sums the
// state with the very function the first pass uses, over the same partition in the same
// order, so a carried sum equals the recomputed one bit for bit: a step after a checkpoint load (no
// carry) gives what the uninterrupted run gives. The carry is valid only while m, B and d change
// through the fused step alone; the ops path and load() drop it, and weight_decay_type
// stable, whose update pass does not write the final d, never keeps one.
#pragma once

#include <cmath>
#include <cstdint>

#include "optimizers/host_device.h"

namespace tidepool::optim::kernels {

enum class ApolloDecayMode : int { none = 0, l2 = 1, decoupled = 2, stable = 3 };

struct ApolloStepArgs {
  double alpha = 0.0;         // (1 − β) / (1 − βᵗ)
  double eps = 0.0;           // ε as given (the step applies the constant-rebound ε/σ)
  double lr = 0.0;            // η for this step (after warmup)
  double weight_decay = 0.0;  // λ
  bool belief = false;        // rebound belief (σ = ‖δ‖∞) instead of constant (σ = 0.01)
  ApolloDecayMode decay = ApolloDecayMode::none;
};

inline constexpr int kApolloThreads = 256;
inline constexpr int kApolloMaxBlocks = 1024;
inline constexpr double kApolloConstantRebound = 0.01;

TIDEPOOL_HOST_DEVICE inline int apollo_blocks(std::int64_t n) {
  std::int64_t blocks = (n + kApolloThreads - 1) / kApolloThreads;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks < kApolloMaxBlocks ? blocks : kApolloMaxBlocks);
}

// The reductions, in the order the partial buffers hold them. The first kApolloCarried
// are the ones over the state alone (Note [carried sums]).
enum ApolloSum : int {
  kSumD4 = 0,        // Σd⁴
  kSumExpAvgD = 1,   // Σm·d
  kSumHessianD2 = 2, // ΣB·d²
  kSumGradD = 3,     // Σg·d
  kMaxDelta = 4,     // max|g − m|
};
inline constexpr int kApolloCarried = 3;
inline constexpr int kApolloSums = 5;

// A parameter's carried sums (Note [carried sums]): the block partials of Σd⁴, Σm·d and
// ΣB·d² that the previous step's update pass left, kApolloCarried per block.
struct ApolloCarry {
  double* partials = nullptr;  // apollo_carry_doubles(n) doubles; null: keep none
  bool valid = false;          // they hold the previous step's sums (else recomputed)
};

TIDEPOOL_HOST_DEVICE inline std::int64_t apollo_carry_doubles(std::int64_t n) {
  return static_cast<std::int64_t>(kApolloCarried) * apollo_blocks(n);
}

// The larger of a and b, NaN when either is: ‖δ‖∞ as torch's norm(inf) gives it, which the
// reference's σ is. (fmax lets a NaN operand lose: a NaN gradient element then vanished
// from σ, and the fused step trained on where the reference and the ops path give NaN.)
TIDEPOOL_HOST_DEVICE inline double apollo_max(double a, double b) {
  if (a != a) return a;
  return (b > a || b != b) ? b : a;
}

TIDEPOOL_HOST_DEVICE inline double apollo_combine(int slot, double a, double b) {
  return slot == kMaxDelta ? apollo_max(a, b) : a + b;
}

// The running sums one device thread or one host lane keeps, by ApolloSum slot: `stride`
// doubles apart, so that the host can keep its lanes side by side.
struct ApolloSumSlots {
  double* base;
  int stride;
  TIDEPOOL_HOST_DEVICE double& operator[](int slot) const { return base[slot * stride]; }
};

// Whether a step with these arguments keeps a carry for the next one.
TIDEPOOL_HOST_DEVICE inline bool apollo_keeps_carry(const ApolloStepArgs& a) {
  return a.decay != ApolloDecayMode::stable;
}

// g (+ λθ for L2), in the parameter's precision as the reference computes it: from the
// values (`param` is read only for L2), and from element i of the arrays.
template <typename T>
TIDEPOOL_HOST_DEVICE inline T apollo_decay(T grad, T param, const ApolloStepArgs& a) {
  T g = grad;
  if (a.decay == ApolloDecayMode::l2) g = g + param * static_cast<T>(a.weight_decay);
  return g;
}

template <typename T>
TIDEPOOL_HOST_DEVICE inline T apollo_decayed_grad(const T* grad, const T* param, std::int64_t i,
                                                  const ApolloStepArgs& a) {
  return apollo_decay(grad[i], a.decay == ApolloDecayMode::l2 ? param[i] : T(0), a);
}

// v + a·b, rounded the same way wherever a sum is formed: one fused multiply-add on the
// device (nvcc would otherwise contract some sites and not others), a multiply then an
// add on the host (apollo_fused_host.cpp is compiled with -ffp-contract=off).
TIDEPOOL_HOST_DEVICE inline double apollo_mul_add(double a, double b, double v) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, v);
#else
  return v + a * b;
#endif
}

// Adds one element's Σd⁴, Σm·d, ΣB·d² terms. The first pass and the update pass both
// call this (Note [carried sums]), which is what makes a carried sum bitwise equal to a
// recomputed one.
template <typename T>
TIDEPOOL_HOST_DEVICE inline void apollo_add_state_terms(ApolloSumSlots v, T m, T b, T d) {
  const double dd = static_cast<double>(d);
  const double d2 = dd * dd;
  v[kSumD4] = apollo_mul_add(d2, d2, v[kSumD4]);
  v[kSumExpAvgD] = apollo_mul_add(static_cast<double>(m), dd, v[kSumExpAvgD]);
  v[kSumHessianD2] = apollo_mul_add(static_cast<double>(b), d2, v[kSumHessianD2]);
}

// What the first pass reads of one element: which arrays depends on the step (θ for L2,
// m for belief or without a carry, B without a carry); the others stay 0.
template <typename T>
struct ApolloFirstPassElement {
  T param = T(0), grad = T(0), m = T(0), b = T(0), d = T(0);
};

TIDEPOOL_HOST_DEVICE inline bool apollo_first_pass_reads_m(const ApolloStepArgs& a, bool carried) {
  return a.belief || !carried;
}

template <typename T>
TIDEPOOL_HOST_DEVICE inline ApolloFirstPassElement<T> apollo_load_first_pass(
    const T* param, const T* grad, const T* exp_avg, const T* hessian, const T* update,
    std::int64_t i, const ApolloStepArgs& a, bool carried) {
  ApolloFirstPassElement<T> e;
  e.grad = grad[i];
  if (a.decay == ApolloDecayMode::l2) e.param = param[i];
  e.d = update[i];
  if (apollo_first_pass_reads_m(a, carried)) e.m = exp_avg[i];
  if (!carried) e.b = hessian[i];
  return e;
}

// Adds one element's terms to the first pass's sums: Σg·d, and max|g − m| for belief, and,
// when the previous step left no carry, the state terms above.
template <typename T>
TIDEPOOL_HOST_DEVICE inline void apollo_add_first_pass_values(ApolloSumSlots v,
                                                              const ApolloFirstPassElement<T>& e,
                                                              const ApolloStepArgs& a,
                                                              bool carried) {
  const T g = apollo_decay(e.grad, e.param, a);
  const T d = e.d;
  v[kSumGradD] = apollo_mul_add(static_cast<double>(g), static_cast<double>(d), v[kSumGradD]);
  if (apollo_first_pass_reads_m(a, carried)) {
    const T m = e.m;
    if (a.belief) v[kMaxDelta] = apollo_max(v[kMaxDelta], fabs(static_cast<double>(g - m)));
    if (!carried) apollo_add_state_terms(v, m, e.b, d);
  }
}

// The same for element i of the arrays.
template <typename T>
TIDEPOOL_HOST_DEVICE inline void apollo_add_first_pass_terms(ApolloSumSlots v, const T* param,
                                                             const T* grad, const T* exp_avg,
                                                             const T* hessian, const T* update,
                                                             std::int64_t i,
                                                             const ApolloStepArgs& a,
                                                             bool carried) {
  apollo_add_first_pass_values(
      v, apollo_load_first_pass(param, grad, exp_avg, hessian, update, i, a, carried), a,
      carried);
}

// The scalars the update needs, from the combined sums: s = ‖d‖₄ + ε′, Δ, σ, ε′.
struct ApolloFinals {
  double s = 0.0;
  double delta = 0.0;
  double sigma = 0.0;
  double eps_prime = 0.0;
};

TIDEPOOL_HOST_DEVICE inline ApolloFinals apollo_finals(const double* sums,
                                                       const ApolloStepArgs& a) {
  ApolloFinals f;
  f.sigma = a.belief ? sums[kMaxDelta] : kApolloConstantRebound;
  f.eps_prime = a.belief ? a.eps : a.eps / kApolloConstantRebound;
  f.s = sqrt(sqrt(sums[kSumD4])) + f.eps_prime;
  // Δ = −α⟨δ/s, d/s⟩ − ⟨B, (d/s)²⟩ with ⟨δ, d⟩ = Σg·d − Σm·d.
  const double delta_dot_d = sums[kSumGradD] - sums[kSumExpAvgD];
  f.delta = -a.alpha * (delta_dot_d / (f.s * f.s)) - sums[kSumHessianD2] / (f.s * f.s);
  return f;
}

// The finals in the parameter's precision, as the elementwise update uses them.
template <typename T>
struct ApolloElementScalars {
  T s, delta_b, sigma, floor_add, alpha, lr, wd;
};

template <typename T>
TIDEPOOL_HOST_DEVICE inline ApolloElementScalars<T> apollo_element_scalars(
    const ApolloFinals& f, const ApolloStepArgs& a) {
  ApolloElementScalars<T> k;
  k.s = static_cast<T>(f.s);
  k.delta_b = static_cast<T>(f.delta);
  k.sigma = static_cast<T>(f.sigma);
  k.floor_add = static_cast<T>(f.eps_prime / a.alpha);
  k.alpha = static_cast<T>(a.alpha);
  k.lr = static_cast<T>(a.lr);
  k.wd = static_cast<T>(a.weight_decay);
  return k;
}

// What the update wrote for one element (θ: the new value, or the old one for stable
// decay, which leaves θ for after mean(D)), and its D (for stable decay's mean(D)).
template <typename T>
struct ApolloUpdated {
  T m, b, d, denom, param;
};

// What the update reads of one element (θ is read unless the decay is stable).
template <typename T>
struct ApolloUpdateElement {
  T param, grad, m, b, d;
};

TIDEPOOL_HOST_DEVICE inline bool apollo_update_reads_param(const ApolloStepArgs& a) {
  return a.decay != ApolloDecayMode::stable;
}

template <typename T>
TIDEPOOL_HOST_DEVICE inline ApolloUpdateElement<T> apollo_load_update(
    const T* param, const T* grad, const T* exp_avg, const T* hessian, const T* update,
    std::int64_t i, const ApolloStepArgs& a) {
  return ApolloUpdateElement<T>{apollo_update_reads_param(a) ? param[i] : T(0), grad[i],
                                exp_avg[i], hessian[i], update[i]};
}

// The update of one element from its values: m, B and d always; θ too unless the decay is
// stable, which needs mean(D) first (then d holds m/D).
template <typename T>
TIDEPOOL_HOST_DEVICE inline ApolloUpdated<T> apollo_update_values(const ApolloUpdateElement<T>& e,
                                                                  const ApolloElementScalars<T>& k,
                                                                  const ApolloStepArgs& a) {
  const T delta = apollo_decay(e.grad, e.param, a) - e.m;
  const T m = e.m + k.alpha * delta;
  const T d = e.d / k.s;
  const T b = e.b + k.delta_b * (d * d);
  const T abs_b = b < T(0) ? -b : b;
  // torch.maximum and clamp, as the reference takes D: a NaN B (or σ) gives a NaN D.
  const bool b_nan = abs_b != abs_b;
  const T denom = a.belief ? ((abs_b > k.sigma || b_nan) ? abs_b : k.sigma) + k.floor_add
                           : ((abs_b > T(kApolloConstantRebound) || b_nan)
                                  ? abs_b
                                  : T(kApolloConstantRebound));
  T direction = m / denom;
  T param = e.param;
  if (a.decay != ApolloDecayMode::stable) {
    if (a.decay == ApolloDecayMode::decoupled) direction = direction + k.wd * param;
    param = param - k.lr * direction;
  }
  return ApolloUpdated<T>{m, b, direction, denom, param};
}

// Writes what apollo_update_values computed for element i.
template <typename T>
TIDEPOOL_HOST_DEVICE inline void apollo_store_update(T* param, T* exp_avg, T* hessian,
                                                     T* update, std::int64_t i,
                                                     const ApolloUpdated<T>& u,
                                                     const ApolloStepArgs& a) {
  exp_avg[i] = u.m;
  hessian[i] = u.b;
  if (a.decay != ApolloDecayMode::stable) param[i] = u.param;
  update[i] = u.d;
}

// Updates element i of the arrays (load, apollo_update_values, store).
template <typename T>
TIDEPOOL_HOST_DEVICE inline ApolloUpdated<T> apollo_update_element(T* param, const T* grad,
                                                    T* exp_avg, T* hessian, T* update,
                                                    std::int64_t i,
                                                    const ApolloElementScalars<T>& k,
                                                    const ApolloStepArgs& a) {
  const ApolloUpdated<T> u =
      apollo_update_values(apollo_load_update(param, grad, exp_avg, hessian, update, i, a), k, a);
  apollo_store_update(param, exp_avg, hessian, update, i, u, a);
  return u;
}

// Stable decay, after mean(D): d += λ/mean(D)·θ, θ −= η·d; from the values of θ and d
// (the new ones returned), and on element i of the arrays.
template <typename T>
struct ApolloStable {
  T param, update;
};

template <typename T>
TIDEPOOL_HOST_DEVICE inline ApolloStable<T> apollo_stable_values(ApolloStable<T> e,
                                                                 T wd_over_mean, T lr) {
  const T direction = e.update + wd_over_mean * e.param;
  return ApolloStable<T>{e.param - lr * direction, direction};
}

template <typename T>
TIDEPOOL_HOST_DEVICE inline void apollo_apply_stable_element(T* param, T* update,
                                                             std::int64_t i, T wd_over_mean,
                                                             T lr) {
  const ApolloStable<T> out =
      apollo_stable_values(ApolloStable<T>{param[i], update[i]}, wd_over_mean, lr);
  update[i] = out.update;
  param[i] = out.param;
}

}  // namespace tidepool::optim::kernels
