// Apollo on LibTorch: options and their checks, the per-parameter state kept through a
// StatePlacement, the two implementations of the step (LibTorch ops; fused CUDA kernels),
// and save/load. The algorithm is in apollo.h and DESIGN.md "optimizers/".
#include "optimizers/apollo.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>

#include "optimizers/apollo_fused_host.h"
#include "optimizers/apollo_step_math.h"

#if TIDEPOOL_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "optimizers/apollo_kernels.h"
#endif

namespace tidepool::optim {

namespace {

using kernels::kApolloConstantRebound;
constexpr int64_t kArchiveFormat = 1;

bool finite(double x) { return std::isfinite(x); }

// The reference's default: L2 for rebound constant, decoupled for belief.
ApolloWeightDecay decay_type(const ApolloOptions& o) {
  if (o.weight_decay_type()) return *o.weight_decay_type();
  return o.rebound() == ApolloRebound::constant ? ApolloWeightDecay::L2
                                                : ApolloWeightDecay::decoupled;
}

}  // namespace

// ---- options -----------------------------------------------------------------------------

const char* to_string(ApolloRebound rebound) {
  return rebound == ApolloRebound::belief ? "belief" : "constant";
}

const char* to_string(ApolloWeightDecay type) {
  switch (type) {
    case ApolloWeightDecay::L2: return "L2";
    case ApolloWeightDecay::decoupled: return "decoupled";
    case ApolloWeightDecay::stable: return "stable";
  }
  return "?";
}

ApolloOptions::ApolloOptions(double lr) : lr_(lr) {}

ApolloOptions& ApolloOptions::rebound(std::string_view name) {
  if (name == "constant") return rebound(ApolloRebound::constant);
  if (name == "belief") return rebound(ApolloRebound::belief);
  TORCH_CHECK(false, "Apollo: invalid rebound '", std::string(name),
              "' (expected 'constant' or 'belief')");
}

ApolloOptions& ApolloOptions::weight_decay_type(std::string_view name) {
  if (name == "L2") return weight_decay_type(ApolloWeightDecay::L2);
  if (name == "decoupled") return weight_decay_type(ApolloWeightDecay::decoupled);
  if (name == "stable") return weight_decay_type(ApolloWeightDecay::stable);
  TORCH_CHECK(false, "Apollo: invalid weight_decay_type '", std::string(name),
              "' (expected 'L2', 'decoupled' or 'stable')");
}

void ApolloOptions::validate(Check when) const {
  if (when == Check::construction) {
    TORCH_CHECK(finite(lr()) && lr() > 0.0, "Apollo: invalid learning rate ", lr(),
                " (must be > 0)");
  } else {
    TORCH_CHECK(finite(lr()) && lr() >= 0.0, "Apollo: invalid learning rate ", lr(),
                " (must be >= 0)");
  }
  TORCH_CHECK(finite(eps()) && eps() >= 0.0, "Apollo: invalid eps ", eps(), " (must be >= 0)");
  TORCH_CHECK(finite(beta()) && beta() >= 0.0 && beta() < 1.0, "Apollo: invalid beta ", beta(),
              " (must be in [0, 1))");
  TORCH_CHECK(warmup() >= 0, "Apollo: invalid warmup ", warmup(), " (must be >= 0)");
  // init_lr when made: at most lr, as the reference's constructor checks it, or the lr the
  // warmup ramps to (base_lr), whichever is larger. A group given no options inherits
  // base_lr and init_lr from the constructor's lr, so its own lr may lie below both or
  // between them, as the reference (which checks no group) lets it. In training only its
  // sign: a schedule may take lr below init_lr.
  const double init = init_lr().value_or(lr() / 1000.0);
  if (when != Check::training) {
    const double highest = std::max(lr(), base_lr().value_or(lr()));
    TORCH_CHECK(finite(init) && init >= 0.0 && init <= highest, "Apollo: invalid init_lr ", init,
                " (must be in [0, lr = ", highest, "])");
  } else {
    TORCH_CHECK(finite(init) && init >= 0.0, "Apollo: invalid init_lr ", init, " (must be >= 0)");
  }
  if (base_lr()) {
    TORCH_CHECK(finite(*base_lr()) && *base_lr() >= 0.0, "Apollo: invalid base_lr ", *base_lr(),
                " (must be >= 0)");
  }
  TORCH_CHECK(finite(weight_decay()) && weight_decay() >= 0.0, "Apollo: invalid weight_decay ",
              weight_decay(), " (must be >= 0)");
}

ApolloOptions& ApolloOptions::resolve_defaults() {
  if (!base_lr()) base_lr(lr());
  if (!init_lr()) init_lr(lr() / 1000.0);
  weight_decay_type(decay_type(*this));
  return *this;
}

// ---- construction ------------------------------------------------------------------------

Apollo::Apollo(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
               ApolloOptions defaults, std::shared_ptr<StatePlacement> placement)
    : torch::optim::Optimizer(param_groups,
                              std::make_unique<ApolloOptions>(std::move(defaults))),
      placement_(std::move(placement)) {
  TORCH_CHECK(placement_ != nullptr, "Apollo: the state placement must not be null");
  auto& resolved_defaults = static_cast<ApolloOptions&>(this->defaults());
  resolved_defaults.validate();
  // Resolved here, as the reference fills its defaults dict in __init__: a group that
  // add_param_group (not virtual in torch::optim::Optimizer, so not Apollo's to intercept)
  // gives no options of its own copies them with the constructor's init_lr and base_lr.
  resolved_defaults.resolve_defaults();
  for (auto& group : param_groups_) {
    static_cast<ApolloOptions&>(group.options()).validate(ApolloOptions::Check::group);
  }
  check_each_parameter_once();
  resolve_group_options();
}

Apollo::Apollo(std::vector<torch::Tensor> params, ApolloOptions defaults,
               std::shared_ptr<StatePlacement> placement)
    : Apollo({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults),
             std::move(placement)) {}

// Fills the lr-dependent defaults (ApolloOptions::resolve_defaults) of every group that
// has them unset: at construction, and at the first step after add_param_group added a
// group with options of its own, so that they are fixed from then on instead of following
// the group's lr. Called once every group's options were checked (the constructor's check,
// or parameters_to_step's in a step): a group added with an invalid lr is refused with its
// lr named, and nothing is fixed from it (an init_lr fixed from a negative lr would be
// refused at every step after the lr was corrected, as an invalid init_lr the user never
// set). A group added with lr 0 (frozen) keeps them unset, and steps with 0 meanwhile:
// fixed from 0, its warmup would ramp from 0 to 0, and the group not move for `warmup`
// steps once given an lr.
namespace {
bool options_resolved(const ApolloOptions& options) {
  return options.init_lr() && options.base_lr() && options.weight_decay_type();
}
}  // namespace

// A group add_param_group added with options of its own had only the checks every step
// makes (Check::training), so one at lr 0 with an init_lr above it was taken, and its
// warmup moved the "frozen" parameters (review finding); the constructor refuses it.
void Apollo::check_unresolved_groups() const {
  for (const auto& group : param_groups_) {
    const auto& options = static_cast<const ApolloOptions&>(group.options());
    if (!options_resolved(options)) options.validate(ApolloOptions::Check::group);
  }
}

void Apollo::resolve_group_options() {
  for (auto& group : param_groups_) {
    auto& options = static_cast<ApolloOptions&>(group.options());
    if (options_resolved(options)) continue;
    if (options.lr() == 0.0 && !options.base_lr()) {
      options.weight_decay_type(decay_type(options));
      continue;
    }
    options.resolve_defaults();
  }
}

bool Apollo::has_fused_kernels() noexcept {
#if TIDEPOOL_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<std::vector<torch::Tensor>> Apollo::parameters_to_step() const {
  check_each_parameter_once();
  // Note [State held at once]: asked once per step; the message only for a refusal.
  const std::optional<std::size_t> held_limit = placement_->held_at_once_limit();
  std::vector<std::vector<torch::Tensor>> stepping;
  stepping.reserve(param_groups_.size());
  for (const auto& group : param_groups_) {
    // Options may have been changed through param_groups() since construction.
    static_cast<const ApolloOptions&>(group.options()).validate(ApolloOptions::Check::training);
    auto& params = stepping.emplace_back();
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const torch::Tensor& grad = p.grad();
      // Every sparse layout, not only COO (is_sparse() is false for CSR, CSC, BSR, BSC):
      // the fused step reads the gradient as dense memory.
      TORCH_CHECK(grad.layout() == torch::kStrided,
                  "Apollo does not support sparse gradients (a ", grad.layout(),
                  " gradient of a ", p.sizes(), " parameter)");
      // The parameter too (review finding: a sparse parameter with a dense gradient was
      // given state of its layout and refused part-way through the step).
      TORCH_CHECK(p.layout() == torch::kStrided, "Apollo does not support sparse parameters (a ",
                  p.layout(), " ", p.sizes(), " parameter)");
      // LibTorch refuses an in-place update of an inference tensor outside InferenceMode;
      // the fused step writes through the data pointer, so it is refused here, before any
      // parameter steps, as torch.optim's first in-place op would refuse it.
      TORCH_CHECK(!p.is_inference() || c10::InferenceMode::is_enabled(),
                  "Apollo: a ", p.sizes(), " parameter is an inference tensor (made under "
                  "torch.inference_mode), which cannot be updated outside InferenceMode; make "
                  "the parameters outside it");
      const auto dtype = p.scalar_type();
      TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kFloat64 ||
                      dtype == torch::kBFloat16 || dtype == torch::kFloat16,
                  "Apollo: parameters must be float32, float64, bfloat16 or float16, got ",
                  dtype);
      // Note [Checked before any parameter steps]: C++'s mutable_grad() checks nothing
      // (Python's p.grad = t does), and the fused step reads the gradient by raw pointer
      // for the parameter's element count: another device's memory, a shorter buffer or
      // another type would be read as wrong memory, or refused half-way through a step.
      TORCH_CHECK(grad.device() == p.device() && grad.scalar_type() == dtype &&
                      grad.sizes() == p.sizes(),
                  "Apollo: the gradient of a ", p.sizes(), " ", dtype, " parameter on ",
                  p.device(), " is ", grad.sizes(), " ", grad.scalar_type(), " on ",
                  grad.device(), "; it must match the parameter in shape, dtype and device");
      if (auto it = state_.find(p.unsafeGetTensorImpl()); it != state_.end()) {
        // The fused kernels take raw pointers: state elsewhere than its parameter, or of
        // another size (a set_data keeps the tensor, and so its state), would be read and
        // written as the wrong memory, not refused by a LibTorch op.
        const auto& state = static_cast<const ApolloParamState&>(*it->second);
        const torch::TensorOptions& held = state.exp_avg_grad->options();
        TORCH_CHECK(held.device() == p.device() && held.dtype() == p.dtype() &&
                        state.exp_avg_grad->sizes() == p.sizes(),
                    "Apollo: the state of a ", p.sizes(), " parameter is ",
                    state.exp_avg_grad->sizes(), " ", held.dtype(), " on ", held.device(),
                    ", the parameter ", p.sizes(), " ", p.dtype(), " on ", p.device(),
                    " (moved, converted or resized after the optimizer was created or "
                    "loaded: change the model first, then create or load the optimizer)");
      }
      // Note [State held at once]: m, B and d are acquired together.
      const std::size_t held = 3 * static_cast<std::size_t>(p.numel()) * p.element_size();
      TORCH_CHECK(!held_limit || held <= *held_limit, "Apollo: the step of a ", p.sizes(), " ",
                  dtype, " parameter holds its m, B and d at once, ", held,
                  " bytes, more than the state placement's device budget of ", *held_limit,
                  " bytes; give the tiered store a budget of at least ", held,
                  " bytes (TieredStoreOptions::device_budget_bytes, or tidepool.state_budget)");
      params.push_back(p);
    }
  }
  return stepping;
}

// A parameter listed twice (in one group, or in two) would take two updates per step
// with one state, where the reference's Python optimizer refuses it; torch::optim's
// add_param_group checks only against state already made, none at construction.
void Apollo::check_each_parameter_once() const {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second,
                  "Apollo: a ", p.sizes(), " parameter appears more than once in the "
                  "parameter groups; give each parameter once");
    }
  }
}

ApolloParamState& Apollo::state_for(const torch::Tensor& param) {
  auto& slot = state_[param.unsafeGetTensorImpl()];
  if (!slot) {
    auto state = std::make_unique<ApolloParamState>();
    // Made where the placement keeps them: a tiered or host-staged state costs no device
    // memory and no copy here (StatePlacement::create_zeros).
    state->exp_avg_grad = placement_->create_zeros(param.sizes(), param.options());
    state->approx_hessian = placement_->create_zeros(param.sizes(), param.options());
    state->update = placement_->create_zeros(param.sizes(), param.options());
    slot = std::move(state);
  }
  return static_cast<ApolloParamState&>(*slot);
}

// Every stepping parameter's state is made before any parameter steps: a placement that
// refuses one (a tiered store of another device than the parameter's) refuses the step
// with nothing changed, as apollo.h promises, instead of after the parameters before it
// took their step. What this call made is dropped again when it throws.
void Apollo::make_state_before_stepping(const std::vector<std::vector<torch::Tensor>>& to_step) {
  std::vector<void*> made;
  try {
    for (const auto& group : to_step) {
      for (const auto& p : group) {
        if (state_.count(p.unsafeGetTensorImpl()) != 0) continue;
        made.push_back(p.unsafeGetTensorImpl());
        state_for(p);
      }
    }
  } catch (...) {
    for (void* key : made) state_.erase(key);
    throw;
  }
}

// ---- the step ----------------------------------------------------------------------------

namespace {

struct StepScalars {
  double alpha;  // (1 − β) / (1 − βᵗ)
  double lr;     // η after warmup
};

StepScalars step_scalars(const ApolloOptions& o, int64_t steps_taken) {
  StepScalars s{};
  const double base = o.base_lr().value_or(o.lr());
  const double init = o.init_lr().value_or(base / 1000.0);
  s.lr = steps_taken < o.warmup()
             ? (base - init) * static_cast<double>(steps_taken) / static_cast<double>(o.warmup()) +
                   init
             : o.lr();
  const double bias_correction = 1.0 - std::pow(o.beta(), static_cast<double>(steps_taken + 1));
  s.alpha = (1.0 - o.beta()) / bias_correction;
  return s;
}

// The reference's sequence of tensor operations (apollo.py @7adf28f), for any device.
void step_with_ops(torch::Tensor& p, const torch::Tensor& raw_grad, torch::Tensor& m,
                   torch::Tensor& B, torch::Tensor& d, const ApolloOptions& o,
                   const StepScalars& s) {
  // Nothing to compute, as in the fused paths; and the belief rebound's inf-norm of an
  // empty tensor throws (it has no identity), which stopped a step half done.
  if (p.numel() == 0) return;
  const ApolloWeightDecay decay = decay_type(o);
  const bool belief = o.rebound() == ApolloRebound::belief;
  torch::Tensor grad = raw_grad;
  if (o.weight_decay() != 0.0 && decay == ApolloWeightDecay::L2) {
    grad = grad.add(p, o.weight_decay());  // a copy: p.grad stays untouched
  }
  torch::Tensor delta_grad = grad - m;
  torch::Tensor rebound;
  double eps = o.eps();
  if (belief) {
    rebound = torch::linalg_vector_norm(delta_grad, std::numeric_limits<double>::infinity());
  } else {
    eps = eps / kApolloConstantRebound;
  }
  // Every allocation comes before the first write to the state or the parameter (two
  // more temporaries of the parameter's size than computing in place): a step out of
  // memory part-way leaves m, B, d and θ as they were, whichever placement keeps them,
  // not m updated and B not. The same operations in the same order as the reference.
  const torch::Tensor m_new = m.add(delta_grad, s.alpha);
  const torch::Tensor denom = torch::linalg_vector_norm(d, 4).add(eps);
  const torch::Tensor d_scaled = d.div(denom);
  const torch::Tensor v_sq = d_scaled.mul(d_scaled);
  const torch::Tensor delta =
      delta_grad.div_(denom).mul_(d_scaled).sum().mul(-s.alpha) - B.mul(v_sq).sum();
  const torch::Tensor B_new = B.addcmul(v_sq, delta);
  const torch::Tensor D = belief ? torch::maximum(B_new.abs(), rebound).add_(eps / s.alpha)
                                 : B_new.abs().clamp_(kApolloConstantRebound);
  const torch::Tensor d_new = m_new.div(D);
  if (o.weight_decay() != 0.0 && decay != ApolloWeightDecay::L2) {
    const double wd = decay == ApolloWeightDecay::stable
                          ? o.weight_decay() / D.mean().item<double>()
                          : o.weight_decay();
    d_new.add_(p, wd);
  }
  m.copy_(m_new);
  B.copy_(B_new);
  d.copy_(d_new);
  p.add_(d_new, -s.lr);
}

kernels::ApolloStepArgs fused_step_args(const ApolloOptions& o, const StepScalars& s) {
  kernels::ApolloStepArgs args;
  args.alpha = s.alpha;
  args.eps = o.eps();
  args.lr = s.lr;
  args.weight_decay = o.weight_decay();
  args.belief = o.rebound() == ApolloRebound::belief;
  switch (decay_type(o)) {
    case ApolloWeightDecay::L2: args.decay = kernels::ApolloDecayMode::l2; break;
    case ApolloWeightDecay::decoupled: args.decay = kernels::ApolloDecayMode::decoupled; break;
    case ApolloWeightDecay::stable: args.decay = kernels::ApolloDecayMode::stable; break;
  }
  if (o.weight_decay() == 0.0) args.decay = kernels::ApolloDecayMode::none;
  return args;
}

// The fused step (CUDA kernels or the host implementation) on one parameter, with the
// carried sums of Note [carried sums] (apollo_step_math.h): `carried` is the parameter's
// buffer of them, undefined when the previous step left none; afterwards it holds this
// step's, or is undefined when this step keeps none (stable decay).
void step_fused(torch::Tensor& p, const torch::Tensor& raw_grad, torch::Tensor& m,
                torch::Tensor& B, torch::Tensor& d, torch::Tensor& carried,
                const ApolloOptions& o, const StepScalars& s) {
  const kernels::ApolloStepArgs args = fused_step_args(o, s);
  kernels::ApolloCarry carry;
  // A new buffer of carried sums becomes the parameter's only once the step has filled
  // it: one kept after a throw before that (a copy or a scratch buffer out of memory)
  // would be taken for valid at the next step and its garbage read as the sums.
  torch::Tensor fresh_carry;
  if (kernels::apollo_keeps_carry(args)) {
    carry.valid = carried.defined();
    if (!carry.valid) {
      fresh_carry = torch::empty({kernels::apollo_carry_doubles(p.numel())},
                                 p.options().dtype(torch::kFloat64));
    }
    carry.partials = (carry.valid ? carried : fresh_carry).data_ptr<double>();
  } else {
    carried = torch::Tensor();
  }
  // Both implementations take contiguous memory; a non-contiguous parameter goes through
  // a copy.
  torch::Tensor param = p.is_contiguous() ? p : p.contiguous();
  const torch::Tensor grad = raw_grad.contiguous();
  const int64_t n = p.numel();
  if (p.is_cpu()) {
    const auto on_host = [&](auto zero) {
      using T = decltype(zero);
      kernels::apollo_step_host(param.data_ptr<T>(), grad.data_ptr<T>(), m.data_ptr<T>(),
                                B.data_ptr<T>(), d.data_ptr<T>(), n, args, carry);
    };
    p.scalar_type() == torch::kFloat32 ? on_host(0.0f) : on_host(0.0);
  } else {
#if TIDEPOOL_HAVE_CUDA
    torch::Tensor scratch =
        torch::empty({static_cast<int64_t>(kernels::apollo_scratch_doubles())},
                     p.options().dtype(torch::kFloat64));
    // The launch goes to the parameter's device, whichever device is current.
    const c10::cuda::CUDAGuard device_guard(p.device());
    void* stream = c10::cuda::getCurrentCUDAStream(p.device().index()).stream();
    const auto on_device = [&](auto zero) {
      using T = decltype(zero);
      return kernels::apollo_step(param.data_ptr<T>(), grad.data_ptr<T>(), m.data_ptr<T>(),
                                  B.data_ptr<T>(), d.data_ptr<T>(), n, args,
                                  scratch.data_ptr<double>(), carry, stream);
    };
    const int rc = p.scalar_type() == torch::kFloat32 ? on_device(0.0f) : on_device(0.0);
    if (rc != 0) carried = torch::Tensor();  // a failed launch may have written part of it
    TORCH_CHECK(rc == 0, "Apollo: fused CUDA step failed: ", kernels::apollo_error_string(rc));
#else
    TORCH_CHECK(false, "Apollo: no fused step for ", p.device(), " in this build");
#endif
  }
  if (fresh_carry.defined()) carried = std::move(fresh_carry);
  // The parameter changed in place, as p.add_ on the ops path changes it: autograd must
  // see a new version, or a graph that saved the old value (a second backward through
  // retain_graph, a GAN whose D steps before G's backward through D) would silently use
  // the new one instead of refusing (review finding: the raw-pointer write left the
  // version as it was). The copy of a non-contiguous parameter counts as one already.
  if (param.is_same(p)) {
    p.unsafeGetTensorImpl()->bump_version();
  } else {
    p.copy_(param);
  }
}

}  // namespace

torch::Tensor Apollo::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // The state is acquired in the same order every step (groups, then parameters, then
  // m, B, d), bracketed by the placement's step boundaries: a tiered placement's store
  // records that order in the first step and replays it as its prefetch schedule, loading
  // as far ahead as its budget allows while this loop computes (tiered_placement.h).
  const std::vector<std::vector<torch::Tensor>> to_step = parameters_to_step();
  check_unresolved_groups();
  make_state_before_stepping(to_step);
  // Of groups added since the last step, once nothing can refuse the step any more: a
  // refused step fixes nothing from the lr they have now.
  resolve_group_options();
  StepScope step_scope(*placement_);
  // The parameter stepping after group g's i-th, across groups, or null for the last.
  const auto next_stepping = [&to_step](size_t g, size_t i) -> const torch::Tensor* {
    if (i + 1 < to_step[g].size()) return &to_step[g][i + 1];
    for (size_t h = g + 1; h < to_step.size(); ++h) {
      if (!to_step[h].empty()) return &to_step[h].front();
    }
    return nullptr;
  };
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& options = static_cast<const ApolloOptions&>(param_groups_[g].options());
    // Parameters that take a step, in order; the next one's state (the next group's first
    // parameter's after a group's last) is prefetched while the current one is computed
    // (a hint, also for placements without a schedule and for the first step, before one
    // is recorded). Asked after the current one is acquired, so that a placement short of
    // device memory gives it to the parameter about to step (review finding: a
    // host-staged step whose memory held a few buffers failed at its first parameter,
    // whose acquire came after the prefetch of the second).
    const std::vector<torch::Tensor>& stepping = to_step[g];
    for (size_t i = 0; i < stepping.size(); ++i) {
      torch::Tensor p = stepping[i];
      ApolloParamState& state = state_for(p);
      StateLease m_lease(*state.exp_avg_grad);
      StateLease B_lease(*state.approx_hessian);
      StateLease d_lease(*state.update);
      if (const torch::Tensor* following = next_stepping(g, i)) {
        ApolloParamState& next = state_for(*following);
        next.exp_avg_grad->prefetch();
        next.approx_hessian->prefetch();
        next.update->prefetch();
      }
      torch::Tensor m = m_lease.tensor();
      torch::Tensor B = B_lease.tensor();
      torch::Tensor d = d_lease.tensor();
      const StepScalars scalars = step_scalars(options, state.step);
      // bfloat16 and float16 take the ops path, in the parameter's dtype as the reference
      // computes (the fused step is written for fp32 and fp64).
      const bool fused_dtype =
          p.scalar_type() == torch::kFloat32 || p.scalar_type() == torch::kFloat64;
      const bool fused = fused_kernels_ && fused_dtype &&
                         (p.is_cpu() || (has_fused_kernels() && p.is_cuda()));
      if (fused) {
        try {
          step_fused(p, p.grad(), m, B, d, state.carried_sums, options, scalars);
        } catch (...) {
          // The sums carried in place may already be this step's while m, B and d go back
          // to the last (their leases are released clean): the next step computes afresh
          // (review finding: a throw after the kernels, the copy back of a non-contiguous
          // parameter, left them to be read as valid).
          state.carried_sums = torch::Tensor();
          throw;
        }
      } else {
        // m, B and d change behind the carried sums' back (Note [carried sums]).
        state.carried_sums = torch::Tensor();
        step_with_ops(p, p.grad(), m, B, d, options, scalars);
      }
      state.step += 1;
      // Ends the use: with a tiered placement that writes back on release, the copy back
      // is only enqueued (after the step's kernels, on the store's D2H stream). All three
      // were written: each is released dirty even when an earlier release throws (a
      // write-back that failed), since a lease left to its destructor is released clean,
      // and a clean release lets a placement drop the updated copy for the old one: B and
      // d would go back a step while m, θ and the step count went on.
      m = B = d = torch::Tensor();
      std::exception_ptr first_error;
      for (StateLease* lease : {&m_lease, &B_lease, &d_lease}) {
        try {
          lease->release(/*dirty=*/true);
        } catch (...) {
          if (!first_error) first_error = std::current_exception();
        }
      }
      if (first_error) {
        // A buffer whose write-back failed may come back a step behind (the lease's
        // destructor ends it clean when a dirty retry fails too): the sums carried for the
        // next fused step would then not be those of its state.
        state.carried_sums = torch::Tensor();
        std::rethrow_exception(first_error);
      }
    }
  }
  return loss;
}

// ---- save / load -------------------------------------------------------------------------

namespace {

void write_options(torch::serialize::OutputArchive& archive, const ApolloOptions& o) {
  archive.write("lr", c10::IValue(o.lr()));
  archive.write("beta", c10::IValue(o.beta()));
  archive.write("eps", c10::IValue(o.eps()));
  archive.write("rebound", c10::IValue(std::string(to_string(o.rebound()))));
  archive.write("warmup", c10::IValue(o.warmup()));
  // Unset until the group's first step with an lr (Apollo::resolve_group_options): written
  // only once fixed, so that a loaded group fixes them as the saved one would have.
  if (o.init_lr()) archive.write("init_lr", c10::IValue(*o.init_lr()));
  if (o.base_lr()) archive.write("base_lr", c10::IValue(*o.base_lr()));
  archive.write("weight_decay", c10::IValue(o.weight_decay()));
  archive.write("weight_decay_type",
                c10::IValue(std::string(to_string(decay_type(o)))));
}

c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value), "Apollo::load: the archive has no '", key, "'");
  return value;
}

void read_options(torch::serialize::InputArchive& archive, ApolloOptions& o) {
  o.lr(read_value(archive, "lr").toDouble());
  o.beta(read_value(archive, "beta").toDouble());
  o.eps(read_value(archive, "eps").toDouble());
  o.rebound(read_value(archive, "rebound").toStringRef());
  o.warmup(read_value(archive, "warmup").toInt());
  c10::IValue value;
  if (archive.try_read("init_lr", value)) o.init_lr(value.toDouble());
  if (archive.try_read("base_lr", value)) o.base_lr(value.toDouble());
  o.weight_decay(read_value(archive, "weight_decay").toDouble());
  o.weight_decay_type(read_value(archive, "weight_decay_type").toStringRef());
}

}  // namespace

std::optional<ApolloSavedParam> Apollo::saved_state_of(const torch::Tensor& param) const {
  auto it = state_.find(param.unsafeGetTensorImpl());
  if (it == state_.end()) return std::nullopt;
  const auto& state = static_cast<const ApolloParamState&>(*it->second);
  return ApolloSavedParam{state.step, state.exp_avg_grad->read_host(),
                          state.approx_hessian->read_host(), state.update->read_host()};
}

std::vector<std::optional<ApolloSavedParam>> Apollo::saved_state() const {
  std::vector<std::optional<ApolloSavedParam>> saved;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) saved.push_back(saved_state_of(p));
  }
  return saved;
}

std::optional<ApolloSavedParam> Apollo::saved_state(size_t index) const {
  size_t first = 0;
  for (const auto& group : param_groups_) {
    if (index - first < group.params().size()) return saved_state_of(group.params()[index - first]);
    first += group.params().size();
  }
  throw std::out_of_range("Apollo: no parameter " + std::to_string(index) + "; it has " +
                          std::to_string(first));
}

std::vector<bool> Apollo::parameters_with_state() const {
  std::vector<bool> with_state;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      with_state.push_back(state_.count(p.unsafeGetTensorImpl()) != 0);
    }
  }
  return with_state;
}

void Apollo::restore_state(std::vector<ApolloOptions> options,
                           const std::vector<std::optional<ApolloSavedParam>>& state) {
  TORCH_CHECK(options.size() == param_groups_.size(), "Apollo: options for ", options.size(),
              " parameter groups given, this optimizer has ", param_groups_.size());
  for (size_t g = 0; g < options.size(); ++g) {
    try {
      // A run saved after its lr reached 0 restores.
      options[g].validate(ApolloOptions::Check::training);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "Apollo: the options of parameter group ", g, ": ",
                  e.what_without_backtrace());
    }
    // Defaults left unset stay unset: the next step fixes them by the rule the constructor
    // and add_param_group follow (resolve_group_options), from the lr the group has then,
    // as the optimizer that was saved would have.
  }
  size_t param_count = 0;
  for (const auto& group : param_groups_) param_count += group.params().size();
  TORCH_CHECK(state.size() == param_count, "Apollo: state for ", state.size(),
              " parameters given, this optimizer has ", param_count);
  // Copy everything into the placement first so that a refusal leaves this optimizer as
  // it was.
  std::vector<std::pair<torch::Tensor, std::unique_ptr<ApolloParamState>>> states;
  size_t index = 0;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      const auto& saved = state[index];
      if (saved) {
        // A negative count would make the bias correction divide by zero (1 - beta^0) and
        // the next step write inf or NaN into the parameter.
        TORCH_CHECK(saved->step >= 0, "Apollo: parameter ", index, " has step ", saved->step,
                    " (a count of steps taken, at least 0)");
        const auto adopt = [&](const char* key, const torch::Tensor& t) {
          TORCH_CHECK(t.defined(), "Apollo: parameter ", index, " has no '", key, "'");
          TORCH_CHECK(t.sizes() == p.sizes(), "Apollo: '", key, "' of parameter ", index,
                      " has shape ", t.sizes(), ", the parameter ", p.sizes());
          TORCH_CHECK(t.is_floating_point(), "Apollo: '", key, "' of parameter ", index,
                      " is ", t.scalar_type(), ", not a floating-point tensor");
          return std::shared_ptr<StateBuffer>(
              placement_->create(t.to(p.options(), false, false, at::MemoryFormat::Contiguous)));
        };
        auto restored = std::make_unique<ApolloParamState>();
        restored->step = saved->step;
        restored->exp_avg_grad = adopt("exp_avg_grad", saved->exp_avg_grad);
        restored->approx_hessian = adopt("approx_hessian", saved->approx_hessian);
        restored->update = adopt("update", saved->update);
        states.emplace_back(p, std::move(restored));
      }
      ++index;
    }
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].set_options(std::make_unique<ApolloOptions>(std::move(options[g])));
  }
  state_.clear();
  for (auto& [p, restored] : states) state_[p.unsafeGetTensorImpl()] = std::move(restored);
}

void Apollo::save(torch::serialize::OutputArchive& archive) const {
  archive.write("apollo_format", c10::IValue(kArchiveFormat));
  archive.write("group_count", c10::IValue(static_cast<int64_t>(param_groups_.size())));
  const auto saved = saved_state();
  size_t index = 0;  // parameters are numbered across groups, in group order
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& group = param_groups_[g];
    torch::serialize::OutputArchive group_archive;
    write_options(group_archive, static_cast<const ApolloOptions&>(group.options()));
    group_archive.write("param_count", c10::IValue(static_cast<int64_t>(group.params().size())));
    for (size_t i = 0; i < group.params().size(); ++i, ++index) {
      if (!saved[index]) continue;
      torch::serialize::OutputArchive param_archive;
      param_archive.write("step", c10::IValue(saved[index]->step));
      param_archive.write("exp_avg_grad", saved[index]->exp_avg_grad, true);
      param_archive.write("approx_hessian", saved[index]->approx_hessian, true);
      param_archive.write("update", saved[index]->update, true);
      group_archive.write("state_" + std::to_string(index), param_archive);
    }
    archive.write("group_" + std::to_string(g), group_archive);
  }
}

void Apollo::load(torch::serialize::InputArchive& archive) {
  TORCH_CHECK(read_value(archive, "apollo_format").toInt() == kArchiveFormat,
              "Apollo::load: not an Apollo archive of format ", kArchiveFormat);
  const int64_t group_count = read_value(archive, "group_count").toInt();
  TORCH_CHECK(group_count == static_cast<int64_t>(param_groups_.size()),
              "Apollo::load: the archive has ", group_count, " parameter groups, this optimizer ",
              param_groups_.size());
  std::vector<ApolloOptions> options;
  std::vector<std::optional<ApolloSavedParam>> state;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& group = param_groups_[g];
    torch::serialize::InputArchive group_archive;
    TORCH_CHECK(archive.try_read("group_" + std::to_string(g), group_archive),
                "Apollo::load: the archive has no group ", g);
    options.emplace_back(1.0);
    read_options(group_archive, options.back());
    const int64_t param_count = read_value(group_archive, "param_count").toInt();
    TORCH_CHECK(param_count == static_cast<int64_t>(group.params().size()),
                "Apollo::load: group ", g, " has ", param_count,
                " parameters in the archive, this optimizer ", group.params().size());
    for (size_t i = 0; i < group.params().size(); ++i) {
      const size_t index = state.size();
      auto& saved = state.emplace_back();
      torch::serialize::InputArchive param_archive;
      if (!group_archive.try_read("state_" + std::to_string(index), param_archive)) continue;
      saved.emplace();
      saved->step = read_value(param_archive, "step").toInt();
      const auto read = [&](const char* key, torch::Tensor& t) {
        TORCH_CHECK(param_archive.try_read(key, t, true), "Apollo::load: parameter ", index,
                    " has no '", key, "'");
      };
      read("exp_avg_grad", saved->exp_avg_grad);
      read("approx_hessian", saved->approx_hessian);
      read("update", saved->update);
    }
  }
  restore_state(std::move(options), state);
}

}  // namespace tidepool::optim
