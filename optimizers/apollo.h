// tidepool::optim::Apollo — Apollo (Ma 2020, "Apollo: An Adaptive Parameter-wise Diagonal
// Quasi-Newton Method"), a torch::optim::Optimizer whose per-parameter state (m, B, d) lives
// wherever a StatePlacement puts it.
//
// The update follows the published reference (XuezheMax/apollo optim/apollo.py @7adf28f),
// step by step as written in DESIGN.md "optimizers/"; the golden trajectories in
// ../shared/golden pin it down to ~1e-12 in fp64.
//
// Two implementations of the same step:
//   - LibTorch ops (any device, fp32/fp64, and bf16/fp16 in the parameter's dtype as the
//     reference computes): the reference's sequence of tensor operations.
//   - fused (fp32/fp64; CUDA kernels in optimizers/apollo_kernels.cu for CUDA tensors, the
//     same algorithm on the host in apollo_fused_host.cpp for CPU tensors): one reduction
//     pass (⟨g,d⟩ and ‖δ‖∞ in fp64; ‖d‖₄, ⟨m,d⟩, ⟨B,d²⟩ come carried from
//     the previous step's update pass, Note [carried sums] in apollo_step_math.h), one elementwise
//     pass that updates m, B, d and θ, plus a second reduction for mean(D) with
//     weight_decay_type stable. No host synchronisation inside the step.
//
// Save/load write the options of every group and, per parameter (numbered in group order),
// step, exp_avg_grad, approx_hessian and update, through torch::serialize archives; load
// puts the state into this optimizer's placement whatever placement saved it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "allocator/export.h"
#include "optimizers/state_placement.h"

namespace tidepool::optim {

enum class ApolloRebound { constant, belief };
enum class ApolloWeightDecay { L2, decoupled, stable };

TIDEPOOL_API const char* to_string(ApolloRebound rebound);
TIDEPOOL_API const char* to_string(ApolloWeightDecay type);

struct TIDEPOOL_API ApolloOptions
    : public torch::optim::OptimizerCloneableOptions<ApolloOptions> {
  explicit ApolloOptions(double lr);

  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta) = 0.9;
  TORCH_ARG(double, eps) = 1e-4;
  TORCH_ARG(ApolloRebound, rebound) = ApolloRebound::constant;
  TORCH_ARG(int64_t, warmup) = 500;
  // Unset: lr / 1000 (resolved when the group joins an optimizer).
  TORCH_ARG(std::optional<double>, init_lr);
  TORCH_ARG(double, weight_decay) = 0.0;
  // Unset: L2 for rebound constant, decoupled for belief (resolved like init_lr).
  TORCH_ARG(std::optional<ApolloWeightDecay>, weight_decay_type);
  // The lr the warmup ramps to (the reference's base_lr): unset means lr when the group
  // joins the optimizer; it does not follow later lr changes, as in the reference. A group
  // with options of its own ramps to its own lr (the reference's setdefault would give it
  // the constructor's base_lr and init_lr, whatever its lr).
  TORCH_ARG(std::optional<double>, base_lr);

 public:
  // By name, as the reference spells them ("constant" | "belief", "L2" | "decoupled" |
  // "stable"); an unknown name throws c10::Error naming it.
  ApolloOptions& rebound(std::string_view name);
  ApolloOptions& weight_decay_type(std::string_view name);

  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }

  // When the options are checked: an optimizer is made with lr > 0, as the reference
  // checks in its constructor; its groups (given to the constructor or added) may have lr
  // 0, frozen from the start, as the reference checks no group; steps and checkpoints also
  // take lr = 0 (a schedule that decays to 0, a group frozen with set_lr(0)).
  enum class Check { construction, group, training };
  // Throws c10::Error naming the first invalid option (lr ≤ 0 when made, < 0 for a group
  // or in training, eps < 0, beta outside [0, 1), warmup < 0, init_lr outside [0, max(lr,
  // base_lr)] when made or for a group, or < 0 in training, base_lr < 0, weight_decay < 0,
  // non-finite values).
  void validate(Check when = Check::construction) const;
  // Fills the reference's defaults that depend on other options where unset: init_lr =
  // lr / 1000, base_lr = lr, weight_decay_type by rebound. An optimizer does this once,
  // when a group joins it, so that later lr changes do not move them.
  ApolloOptions& resolve_defaults();
};

// Per-parameter state. Copies (clone()) share the buffers.
struct TIDEPOOL_API ApolloParamState
    : public torch::optim::OptimizerCloneableParamState<ApolloParamState> {
  int64_t step = 0;
  std::shared_ptr<StateBuffer> exp_avg_grad;    // m
  std::shared_ptr<StateBuffer> approx_hessian;  // B
  std::shared_ptr<StateBuffer> update;          // d
  // The fused step's sums over m, B and d for the next step (Note [carried sums] in
  // apollo_step_math.h): fp64 on the parameter's device whatever the placement (at most
  // 24 KiB per parameter), undefined when the next step must compute them itself.
  // Whoever changes m, B or d other than through step() must reset it.
  torch::Tensor carried_sums;
};

// One parameter's state as save() writes it: host copies of m, B and d, and the step count.
struct ApolloSavedParam {
  int64_t step = 0;
  torch::Tensor exp_avg_grad;    // m
  torch::Tensor approx_hessian;  // B
  torch::Tensor update;          // d
};

class TIDEPOOL_API Apollo : public torch::optim::Optimizer {
 public:
  Apollo(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
         ApolloOptions defaults,
         std::shared_ptr<StatePlacement> placement = default_placement());
  Apollo(std::vector<torch::Tensor> params, ApolloOptions defaults,
         std::shared_ptr<StatePlacement> placement = default_placement());

  // One Apollo step for every parameter with a gradient. With a closure, it is called
  // with grad mode on and its loss returned. What a step can refuse (sparse gradients of
  // any layout, an unsupported dtype, invalid options in any group, a parameter given
  // twice (also refused at construction), a gradient of another shape, dtype or device
  // than its parameter, state on another device, of another dtype or of another shape
  // than its parameter, e.g. after the model was moved or set_data resized it, a
  // parameter whose m, B and d together exceed a tiered placement's device budget) is
  // checked for every group before any parameter changes: a refused step changes nothing.
  // A failure past those checks (out of memory part-way) leaves the parameters before the
  // one that failed stepped, the rest not, and the one that failed stepped or not
  // depending on where it failed: restore a checkpoint rather than step again.
  // The parameters change in place, with a new autograd version (as Tensor::add_ gives).
  torch::Tensor step(LossClosure closure = nullptr) override;

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Every parameter's state, numbered across groups in group order as save() numbers it:
  // host copies, nullopt for a parameter with no state yet. save() writes this; the Python
  // binding (tidepool.optim) makes its state_dict of it.
  std::vector<std::optional<ApolloSavedParam>> saved_state() const;
  // One parameter's state (numbered as saved_state() numbers them), nullopt when it has
  // none yet; throws std::out_of_range past the last parameter.
  std::optional<ApolloSavedParam> saved_state(size_t index) const;
  // Which parameters have state, numbered as saved_state() numbers them; reads no state.
  std::vector<bool> parameters_with_state() const;
  // Replaces every group's options (one per group) and every parameter's state (one per
  // parameter, numbered as saved_state() numbers them; nullopt: no state). Everything is
  // checked first (options valid for training, step >= 0, each tensor of its parameter's
  // shape): a refusal throws c10::Error naming the parameter and the key, and changes
  // nothing. The tensors are copied into this optimizer's placement, converted to their
  // parameter's dtype and device. Options whose lr-dependent defaults are unset (init_lr,
  // base_lr: a group at lr 0, or one added and not stepped yet) keep them unset; the next
  // step fixes them from the group's lr then, as in the optimizer saved. load() reads an
  // archive into this.
  void restore_state(std::vector<ApolloOptions> options,
                     const std::vector<std::optional<ApolloSavedParam>>& state);

  const StatePlacement& placement() const noexcept { return *placement_; }
  // The fused step (default on): CUDA kernels for CUDA parameters when built with CUDA,
  // the host implementation for CPU parameters. Off: the LibTorch-ops path everywhere
  // (the reference's sequence of operations; the benchmarks' baseline).
  void set_fused_kernels(bool enabled) noexcept { fused_kernels_ = enabled; }
  bool fused_kernels() const noexcept { return fused_kernels_; }
  // True when this build has the fused CUDA kernels at all.
  static bool has_fused_kernels() noexcept;

 private:
  // `param`'s state as host copies (saved_state), nullopt when it has none.
  std::optional<ApolloSavedParam> saved_state_of(const torch::Tensor& param) const;
  ApolloParamState& state_for(const torch::Tensor& param);
  // The parameters each group steps, in order, once everything the step could refuse is
  // checked (see step()).
  std::vector<std::vector<torch::Tensor>> parameters_to_step() const;
  void check_each_parameter_once() const;
  void make_state_before_stepping(const std::vector<std::vector<torch::Tensor>>& to_step);
  // Groups whose lr-dependent options are not fixed yet (added since the last step):
  // checked as the constructor checks its groups, before anything changes.
  void check_unresolved_groups() const;
  void resolve_group_options();

  std::shared_ptr<StatePlacement> placement_;
  bool fused_kernels_ = true;
};

}  // namespace tidepool::optim
