// tidepool::optim::AADL — Anderson acceleration around any torch::optim::Optimizer, after
// the published reference (ORNL/AADL @9765262, `AADL.accelerate`), as DESIGN.md
// "optimizers/" describes it:
//
//   step(closure):
//     1. the inner optimizer steps (with the closure, if given).
//     2. every store_each_nth-th call, each group's parameters, flattened, join that group's
//        history (a ring buffer of history_depth vectors, see anderson_history.h).
//     3. when calls > wait_iterations and calls % frequency == 0, for each group whose
//        history holds ≥ 3 vectors: γ = argmin ‖DX[:,−1] − DRγ‖² + reg_acc‖γ‖²
//        (solved in fp64 on the host from the incrementally kept Gram matrix), x_AA = X[:,−2] +
//        DX[:,−1] − (DX[:,:−1] + DR)γ, relaxed: x = β·x_AA + (1 − β)·X[:,:−1]α.
//        With a closure (the safeguard): the closure is called with grad mode off at the
//        plain iterate and at x; x is kept, and replaces the newest history vector, only if
//        its loss is strictly lower, else the plain iterate is restored. Without a closure
//        x is loaded and the history is left as it is.
//   Returns the loss the inner optimizer's step returned. The chunks of history the
//   step's passes read start loading on entry, before the inner step, or earlier through
//   prefetch() (Note [Loading the history ahead of use] in anderson_history.h).
//
// A rejected candidate leaves the plain iterate (DESIGN.md), the parameters the inner step
// just made, whose loss the safeguard measured. The published code reloads the newest
// stored vector instead: the same iterate whenever this step stored (always with
// store_each_nth 1, the golden files' case); with store_each_nth > 1, on a step that did
// not store, it goes back to the iterate of the last store, dropping the inner steps taken
// since, for a point whose loss it never evaluated. tests/python/reference_aadl.py follows
// DESIGN.md here too.
//
// Diverged parameters (NaN or Inf in a group's history, or values whose inner products
// overflow) make step() throw c10::Error naming the groups, after every group's inner
// update and store were made and the others accelerated: those groups keep their plain
// iterate, and the error repeats at each acceleration until the vector has left the
// history. (The published code loads the NaN extrapolation and trains on.)
//
// A step that throws after the inner step (the safeguard's closure out of memory, a failed
// solve, a failed store of the accepted iterate) leaves the group that threw at its plain
// iterate and still makes this step's store in the groups after it, so that every group's
// history holds the same steps (all but the group whose own store failed, which has no
// room for it); the groups before it were accelerated as usual.
//
// acceleration_type anderson and anderson_normal_equation name the reference's two ways of
// solving the same least-squares problem; here both use the same fp64 solve (equilibrated
// Gram matrix, LAPACK gelsd minimum-norm), which matches the reference to ~1e-9.
//
// AADL's own param_groups() mirror the inner optimizer's parameters so that zero_grad() and
// parameters() work; change learning rates on inner().
//
// Each group's parameters must be real floating point, of one dtype on one device, with at
// least one element (refused when wrapped). Once a group's history holds vectors, its
// parameters must keep their dtype, device and sizes: a step over parameters moved or
// resized since (model.to(...)) is refused before the inner optimizer runs; save this AADL
// and load it into a new one over the changed parameters (loading recasts the history).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "allocator/export.h"
#include "optimizers/anderson_history.h"
#include "optimizers/state_placement.h"

namespace tidepool::optim {

enum class AndersonType { anderson, anderson_normal_equation };

TIDEPOOL_API const char* to_string(AndersonType type);

struct TIDEPOOL_API AADLOptions {
  TORCH_ARG(AndersonType, acceleration_type) = AndersonType::anderson;
  TORCH_ARG(double, relaxation) = 0.1;
  TORCH_ARG(int64_t, wait_iterations) = 1;
  TORCH_ARG(int64_t, history_depth) = 15;
  TORCH_ARG(int64_t, store_each_nth) = 1;
  TORCH_ARG(int64_t, frequency) = 1;
  TORCH_ARG(double, reg_acc) = 0.0;

 public:
  // "anderson" | "anderson_normal_equation"; anything else throws c10::Error naming it.
  AADLOptions& acceleration_type(std::string_view name);
  // Throws c10::Error naming the first invalid option (relaxation ≤ 0, wait_iterations < 0,
  // history_depth < 3, store_each_nth < 1, frequency < 1, reg_acc < 0, non-finite values).
  void validate() const;
};

class TIDEPOOL_API AADL : public torch::optim::Optimizer {
 public:
  // history_placement: where the history vectors live; null means host memory for CUDA
  // parameters (HostStagedPlacement) and plain resident tensors for CPU parameters. A
  // TieredPlacement keeps them in the tiered store; every pass streams them chunk by chunk
  // (anderson_history.h), so its device budget needs room for about two chunks per vector,
  // not for the history; a step refuses, before anything runs, a budget below one chunk
  // (2²⁰ elements, or the group's size if smaller) per vector of history_depth.
  AADL(std::shared_ptr<torch::optim::Optimizer> inner, AADLOptions options = {},
       std::shared_ptr<StatePlacement> history_placement = nullptr);

  torch::Tensor step(LossClosure closure = nullptr) override;

  // Starts loading the part of the history that the next step() reads first; a hint that
  // never changes a result. step() does this itself on entry, which overlaps the loads
  // with the inner step (and, with a closure, with its forward and backward pass). A
  // trainer that runs forward and backward outside step() calls prefetch() before its
  // forward pass to get the same overlap. Note [Loading the history ahead of use] in
  // anderson_history.h.
  void prefetch() const;

  // Saves the inner optimizer (nested archive "inner"), the counters and every group's
  // history with its matrices and parameter shapes; load restores them into this
  // optimizer's placement, replacing the inner optimizer's state (as a fresh optimizer's
  // would be), or throws c10::Error naming what does not fit (the key, for a value that is
  // missing, negative or of the wrong type) and changes nothing. History vectors saved
  // from parameters of another floating dtype are cast to this optimizer's, and their
  // matrices recomputed (read_history in aadl.cpp); the inner optimizer's state is what
  // its own load makes of it (LibTorch's keep the dtype it was saved in).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  torch::optim::Optimizer& inner() noexcept { return *inner_; }
  const AADLOptions& options() const noexcept { return options_; }
  const AndersonHistory& history(size_t group) const { return *histories_.at(group); }
  // How many accelerated iterates were kept / rejected by the safeguard so far.
  int64_t accepted() const noexcept { return accepted_; }
  int64_t rejected() const noexcept { return rejected_; }

 private:
  // What the next step() does, decided by the counters alone.
  struct NextStep {
    bool stores = false;       // the parameters join the history
    bool accelerates = false;  // groups with ≥ 3 vectors extrapolate
  };
  NextStep next_step() const noexcept;
  // The inner optimizer still has the groups it had when wrapped, one per history (its
  // param_groups() is mutable): step, save and load index them by the histories.
  void check_inner_groups(const char* who) const;
  void prefetch(NextStep next) const;
  // Solves the group's least-squares problem and returns the extrapolated vector;
  // `newest` and `out` as in AndersonHistory::combine.
  torch::Tensor extrapolate(const AndersonHistory& history, const torch::Tensor& newest,
                            const torch::Tensor& out) const;
  // Group g's part of step() after the inner step: its store, its extrapolation and the
  // safeguard; a group whose history is not finite goes into `diverged` instead.
  void step_group(size_t g, bool stores, bool accelerates, const LossClosure& closure,
                  std::vector<size_t>& diverged);

  std::shared_ptr<torch::optim::Optimizer> inner_;
  AADLOptions options_;
  std::vector<std::unique_ptr<AndersonHistory>> histories_;
  int64_t call_counter_ = 0;
  int64_t store_counter_ = 0;
  int64_t accepted_ = 0;
  int64_t rejected_ = 0;
};

}  // namespace tidepool::optim
