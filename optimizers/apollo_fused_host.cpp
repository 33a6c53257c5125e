// The fused Apollo step on host memory (see apollo_fused_host.h). It follows the kernels'
// launch sequence: a first pass per block, one combination of the block partials, the
// update pass per block, and for stable decay mean(D) then the θ update.
//
// Its partition is its own (apollo_step_math.h): up to kApolloMaxBlocks contiguous ranges
// of at least kMinBlockElements elements, and within a range kLanes running sums, element
// i in lane i mod kLanes, combined in lane order. Contiguous ranges stream through the
// cache and the lanes give the compiler independent additions; the device's grid-stride
// layout, replayed here, made the tree combination of 256 threads per block cost as much
// as the elements themselves. The update pass walks the same ranges and lanes as the
// first pass, so the carried sums equal the recomputed ones bit for bit (Note [carried
// sums]). Compiled with -ffp-contract=off so that the compiler cannot fuse some of those
// additions and not others.
#include "optimizers/apollo_fused_host.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace tidepool::optim::kernels {
namespace {

constexpr std::int64_t kMinBlockElements = 4096;
constexpr int kLanes = 8;

// At most apollo_blocks(n) (kMinBlockElements ≥ kApolloThreads), so a carry sized by
// apollo_carry_doubles(n) holds the host's partials too.
int host_blocks(std::int64_t n) {
  const std::int64_t blocks = (n + kMinBlockElements - 1) / kMinBlockElements;
  return static_cast<int>(std::clamp<std::int64_t>(blocks, 1, kApolloMaxBlocks));
}

// Per-lane running sums, slot-major so that a slot's lanes sit side by side.
template <int Count>
struct LaneSums {
  double v[Count][kLanes] = {};
  ApolloSumSlots lane(int l) { return ApolloSumSlots{&v[0][l], kLanes}; }
  // Lane 0, 1, ... in order: the block's partial of each slot.
  void combine_into(double* out) const {
    for (int c = 0; c < Count; ++c) {
      double total = v[c][0];
      for (int l = 1; l < kLanes; ++l) total = apollo_combine(c, total, v[c][l]);
      out[c] = total;
    }
  }
};

// fn(b, begin, end) for every block's range, on LibTorch's intra-op pool: a block writes
// only its own partials.
template <typename Fn>
void for_each_block(std::int64_t n, int blocks, const Fn& fn) {
  at::parallel_for(0, blocks, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t b = first; b < last; ++b) {
      fn(static_cast<int>(b), n * b / blocks, n * (b + 1) / blocks);
    }
  });
}

// fn(i, lane) for i in [begin, end): whole rounds of kLanes, then the rest.
template <typename Fn>
void for_each_lane_element(std::int64_t begin, std::int64_t end, const Fn& fn) {
  std::int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) fn(i + l, l);
  }
  for (int l = 0; i < end; ++i, ++l) fn(i, l);
}

template <typename T>
void step(T* param, const T* grad, T* exp_avg, T* hessian, T* update, std::int64_t n,
          const ApolloStepArgs& args, ApolloCarry carry) {
  if (n <= 0) return;
  // A local copy: no store through the element pointers can reach it, so the compiler
  // keeps the flags and scalars in registers instead of reloading them per element.
  const ApolloStepArgs a = args;
  const int blocks = host_blocks(n);
  const bool carried = carry.partials != nullptr && carry.valid;
  const bool stable = a.decay == ApolloDecayMode::stable;
  double* carry_out = apollo_keeps_carry(a) ? carry.partials : nullptr;

  std::vector<double> partials(static_cast<std::size_t>(blocks) * kApolloSums);
  for_each_block(n, blocks, [&](int b, std::int64_t begin, std::int64_t end) {
    LaneSums<kApolloSums> sums;
    for_each_lane_element(begin, end, [&](std::int64_t i, int l) {
      apollo_add_first_pass_terms(sums.lane(l), param, grad, exp_avg, hessian, update, i, a,
                                  carried);
    });
    sums.combine_into(&partials[static_cast<std::size_t>(b) * kApolloSums]);
  });

  double totals[kApolloSums] = {};
  for (int b = 0; b < blocks; ++b) {
    for (int c = 0; c < kApolloSums; ++c) {
      const double partial = carried && c < kApolloCarried
                                 ? carry.partials[static_cast<std::size_t>(b) * kApolloCarried + c]
                                 : partials[static_cast<std::size_t>(b) * kApolloSums + c];
      totals[c] = b == 0 ? partial : apollo_combine(c, totals[c], partial);
    }
  }
  const ApolloElementScalars<T> k = apollo_element_scalars<T>(apollo_finals(totals, a), a);

  std::vector<double> denom_partials(stable ? static_cast<std::size_t>(blocks) : 0);
  for_each_block(n, blocks, [&](int b, std::int64_t begin, std::int64_t end) {
    if (stable) {
      double denom_sum = 0.0;
      for (std::int64_t i = begin; i < end; ++i) {
        denom_sum += static_cast<double>(
            apollo_update_element(param, grad, exp_avg, hessian, update, i, k, a).denom);
      }
      denom_partials[static_cast<std::size_t>(b)] = denom_sum;
      return;
    }
    if (carry_out == nullptr) {
      for (std::int64_t i = begin; i < end; ++i) {
        apollo_update_element(param, grad, exp_avg, hessian, update, i, k, a);
      }
      return;
    }
    LaneSums<kApolloCarried> sums;
    for_each_lane_element(begin, end, [&](std::int64_t i, int l) {
      const ApolloUpdated<T> u =
          apollo_update_element(param, grad, exp_avg, hessian, update, i, k, a);
      apollo_add_state_terms(sums.lane(l), u.m, u.b, u.d);
    });
    sums.combine_into(carry_out + static_cast<std::ptrdiff_t>(b) * kApolloCarried);
  });

  if (stable) {
    double denom_total = 0.0;
    for (const double partial : denom_partials) denom_total += partial;
    const T wd_over_mean = static_cast<T>(a.weight_decay / (denom_total / static_cast<double>(n)));
    const T lr = static_cast<T>(a.lr);
    for_each_block(n, blocks, [&](int, std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        apollo_apply_stable_element(param, update, i, wd_over_mean, lr);
      }
    });
  }
}

}  // namespace

void apollo_step_host(float* param, const float* grad, float* exp_avg, float* hessian,
                      float* update, std::int64_t n, const ApolloStepArgs& args,
                      ApolloCarry carry) {
  step(param, grad, exp_avg, hessian, update, n, args, carry);
}

void apollo_step_host(double* param, const double* grad, double* exp_avg, double* hessian,
                      double* update, std::int64_t n, const ApolloStepArgs& args,
                      ApolloCarry carry) {
  step(param, grad, exp_avg, hessian, update, n, args, carry);
}

}  // namespace tidepool::optim::kernels
