// AADL: Anderson acceleration wrapped around any torch::optim::Optimizer (see aadl.h for the
// algorithm and anderson_history.h for how the history and its matrices are kept).
#include "optimizers/aadl.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/StringUtil.h>

#include "optimizers/linalg/lstsq.h"

namespace tidepool::optim {

namespace {

constexpr int64_t kArchiveFormat = 1;
// Singular values of the equilibrated Gram matrix below this fraction of the largest count
// as zero: σ(G) = σ(DR)², so this drops directions of DR below ~3e-7 of the strongest,
// which is where fp64 Gram entries stop carrying information.
constexpr double kGramRcond = 1e-13;

std::vector<torch::optim::OptimizerParamGroup> mirror_groups(
    const std::shared_ptr<torch::optim::Optimizer>& inner) {
  TORCH_CHECK(inner != nullptr, "AADL: the inner optimizer must not be null");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& group : inner->param_groups()) {
    groups.emplace_back(group.params());
  }
  return groups;
}

std::unique_ptr<torch::optim::OptimizerOptions> mirror_defaults(
    const std::shared_ptr<torch::optim::Optimizer>& inner) {
  TORCH_CHECK(inner != nullptr, "AADL: the inner optimizer must not be null");
  return inner->defaults().clone();
}

// A group's parameters must flatten into one vector: one dtype, one device, at least one
// element (the history keeps no empty vector: a group of zero-element parameters failed
// every step after its inner update). Checked for every group at construction and before
// a step changes anything. Returns the group's element count (the flattened length).
int64_t check_group(const std::vector<torch::Tensor>& params) {
  TORCH_CHECK(!params.empty(), "AADL: a parameter group of the inner optimizer is empty");
  int64_t elements = 0;
  for (const auto& p : params) elements += p.numel();
  TORCH_CHECK(elements > 0, "AADL: a parameter group of the inner optimizer has ",
              params.size(), " parameter(s) with no elements at all; there is nothing to "
              "accelerate (leave them out of the group, or put them in one with others)");
  // The extrapolation is real (fp64 Gram matrices of real parts): a complex parameter
  // would lose its imaginary part on every accelerated step.
  TORCH_CHECK(c10::isFloatingType(params.front().scalar_type()),
              "AADL: parameters must be real floating point; a group has ",
              params.front().scalar_type(), " parameters");
  for (const auto& p : params) {
    // The history holds each group as one flat vector (reshape, cat, copy back in place).
    TORCH_CHECK(p.layout() == torch::kStrided, "AADL: parameters must be dense (strided); a "
                "group has a ", p.layout(), " parameter");
    TORCH_CHECK(p.scalar_type() == params.front().scalar_type() &&
                    p.device() == params.front().device(),
                "AADL: all parameters of a group must share dtype and device (got ",
                p.scalar_type(), " on ", p.device(), " and ", params.front().scalar_type(),
                " on ", params.front().device(), ")");
  }
  return elements;
}

// The group's parameters as one vector (the reference's parameters_to_vector).
torch::Tensor flatten(const std::vector<torch::Tensor>& params) {
  check_group(params);
  std::vector<torch::Tensor> pieces;
  pieces.reserve(params.size());
  for (const auto& p : params) pieces.push_back(p.detach().reshape(-1));
  return torch::cat(pieces);
}

// Copies a vector back into the group's parameters (vector_to_parameters).
void unflatten(const torch::Tensor& vector, const std::vector<torch::Tensor>& params) {
  int64_t offset = 0;
  for (const auto& p : params) {
    const int64_t n = p.numel();
    p.detach().copy_(vector.narrow(0, offset, n).view(p.sizes()));
    offset += n;
  }
}

double loss_value(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "AADL: the closure must return a scalar loss");
  return loss.item<double>();
}

}  // namespace

// ---- options -----------------------------------------------------------------------------

const char* to_string(AndersonType type) {
  return type == AndersonType::anderson ? "anderson" : "anderson_normal_equation";
}

AADLOptions& AADLOptions::acceleration_type(std::string_view name) {
  if (name == "anderson") return acceleration_type(AndersonType::anderson);
  if (name == "anderson_normal_equation") {
    return acceleration_type(AndersonType::anderson_normal_equation);
  }
  TORCH_CHECK(false, "AADL: unknown acceleration_type '", std::string(name),
              "' (expected 'anderson' or 'anderson_normal_equation')");
}

void AADLOptions::validate() const {
  TORCH_CHECK(std::isfinite(relaxation()) && relaxation() > 0.0, "AADL: invalid relaxation ",
              relaxation(), " (must be > 0)");
  TORCH_CHECK(wait_iterations() >= 0, "AADL: invalid wait_iterations ", wait_iterations(),
              " (must be >= 0)");
  TORCH_CHECK(history_depth() >= 3, "AADL: invalid history_depth ", history_depth(),
              " (must be >= 3: acceleration needs three stored iterates)");
  TORCH_CHECK(store_each_nth() >= 1, "AADL: invalid store_each_nth ", store_each_nth(),
              " (must be >= 1)");
  TORCH_CHECK(frequency() >= 1, "AADL: invalid frequency ", frequency(), " (must be >= 1)");
  TORCH_CHECK(std::isfinite(reg_acc()) && reg_acc() >= 0.0, "AADL: invalid reg_acc ",
              reg_acc(), " (must be >= 0)");
}

// ---- construction ------------------------------------------------------------------------

AADL::AADL(std::shared_ptr<torch::optim::Optimizer> inner, AADLOptions options,
           std::shared_ptr<StatePlacement> history_placement)
    : torch::optim::Optimizer(mirror_groups(inner), mirror_defaults(inner)),
      inner_(std::move(inner)),
      options_(options) {
  options_.validate();
  for (const auto& group : inner_->param_groups()) {
    check_group(group.params());
    std::shared_ptr<StatePlacement> placement = history_placement;
    if (!placement) {
      placement = group.params().front().is_cuda()
                      ? std::shared_ptr<StatePlacement>(std::make_shared<HostStagedPlacement>())
                      : std::shared_ptr<StatePlacement>(std::make_shared<ResidentPlacement>());
    }
    histories_.push_back(
        std::make_unique<AndersonHistory>(options_.history_depth(), std::move(placement)));
  }
}

// ---- the step ----------------------------------------------------------------------------

torch::Tensor AADL::extrapolate(const AndersonHistory& history, const torch::Tensor& newest,
                                const torch::Tensor& out) const {
  const int64_t k = history.size() - 2;
  torch::Tensor gram = history.gram().clone();
  if (options_.reg_acc() != 0.0) gram.diagonal().add_(options_.reg_acc());
  // Equilibrate: unit diagonal (unit-norm DR columns), undone on γ.
  torch::Tensor scale = gram.diagonal().sqrt();
  scale = torch::where(scale > 0, scale, torch::ones_like(scale));
  const torch::Tensor scaled = gram / scale.unsqueeze(1) / scale.unsqueeze(0);
  const torch::Tensor rhs = (history.rhs() / scale).unsqueeze(1);
  // Minimum-norm, rank-revealing, in fp64 on the host: tidepool::linalg's SVD route (what
  // gelsd computes), so the solve is the same code on every device.
  linalg::LstsqOptions solve;
  solve.method = linalg::LstsqMethod::svd;
  solve.rcond = kGramRcond;
  solve.equilibrate = false;  // done above, where the Gram diagonal is at hand
  const torch::Tensor y = linalg::lstsq(scaled, rhs, solve).solution.squeeze(1);
  const torch::Tensor gamma = y / scale;
  TORCH_CHECK(gamma.numel() == k, "AADL: ", gamma.numel(), " coefficients for a history of ", k,
              " differences");
  // Both terms written as x_{m−1} + Σ_l u_l·DX_l (l = 0 … k), so the history is streamed
  // once and differences are taken before scaling (less cancellation than Σ w_j x_j):
  //   x_AA = x_{m−1} − Σ_{i<k} γ_i·DX_{i+1}            (DX_i + DR_i = DX_{i+1})
  //   X[:,:−1]α = x_{m−1} − Σ_l A_l·DX_l, A_l = Σ_{j≤l} α_j = γ_l (l < k), 1 (l = k)
  const double beta = options_.relaxation();
  const auto g = gamma.accessor<double, 1>();
  torch::Tensor u = torch::zeros({k + 1}, torch::kFloat64);
  auto w = u.accessor<double, 1>();
  for (int64_t l = 0; l <= k; ++l) {
    const double anderson = l >= 1 ? -g[l - 1] : 0.0;
    const double average = l < k ? -g[l] : -1.0;
    w[l] = beta * anderson + (1.0 - beta) * average;
  }
  return history.combine(u, newest, out);
}

namespace {

// Whether the group's least-squares problem is finite. Diverged parameters would otherwise
// reach the solve as "A or B contains NaN or Inf", a problem the caller never passed.
bool solvable(const AndersonHistory& history) {
  return torch::isfinite(history.gram()).all().item<bool>() &&
         torch::isfinite(history.rhs()).all().item<bool>();
}

}  // namespace

AADL::NextStep AADL::next_step() const noexcept {
  const int64_t call = call_counter_ + 1;
  return NextStep{store_counter_ + 1 >= options_.store_each_nth(),
                  call > options_.wait_iterations() && call % options_.frequency() == 0};
}

void AADL::prefetch() const { prefetch(next_step()); }

void AADL::prefetch(NextStep next) const {
  for (const auto& history : histories_) {
    if (next.stores) {
      history->prefetch(AndersonHistory::Pass::after_push);
    } else if (next.accelerates && history->size() >= 3) {
      history->prefetch(AndersonHistory::Pass::combine);
    }
  }
}

void AADL::check_inner_groups(const char* who) const {
  TORCH_CHECK(inner_->param_groups().size() == histories_.size(), who, ": the inner optimizer has ",
              inner_->param_groups().size(), " parameter groups, it had ", histories_.size(),
              " when wrapped");
}

torch::Tensor AADL::step(LossClosure closure) {
  check_inner_groups("AADL");
  // add_param_group is not virtual: one called on the wrapper adds to its own groups (a
  // copy of the inner optimizer's), which nothing steps.
  TORCH_CHECK(param_groups_.size() == histories_.size(), "AADL: ", param_groups_.size(),
              " parameter groups were given to the wrapper, which steps the inner "
              "optimizer's ", histories_.size(), "; add groups to inner() before wrapping it");
  // What this step does, decided before anything runs (the counters only move once the
  // inner step succeeded).
  const auto [stores, accelerates] = next_step();
  for (size_t g = 0; g < histories_.size(); ++g) {
    const std::vector<torch::Tensor>& params = inner_->param_groups()[g].params();
    const int64_t numel = check_group(params);
    // Parameters moved to another dtype or device, or resized, since their history was
    // stored: refused before the inner step changes them (the push after it would fail,
    // every step).
    const AndersonHistory& history = *histories_[g];
    TORCH_CHECK(history.accepts(numel, params.front().scalar_type(), params.front().device()),
                "AADL: the parameters of group ", g, " are now ", numel, " elements of ",
                params.front().scalar_type(), " on ", params.front().device(),
                "; their history holds ", history.describe_vectors(),
                ". Parameters changed after wrapping (model.to(...), a resize) need a new AADL "
                "(or save this one and load it into an AADL over the changed parameters: "
                "loading recasts the history to their dtype and device)");
    // A pass over the history holds one stored chunk of each vector at once (up to
    // history_depth of them, anderson_history.h): a placement that cannot hold that many
    // would fail the push after the inner step, at every step once the history is that
    // long (review finding). Refused here, with nothing changed, as Apollo refuses state it
    // cannot hold at once (Note [State held at once] in apollo.cpp).
    if (const std::optional<std::size_t> limit = history.placement().held_at_once_limit()) {
      const auto chunk = static_cast<std::size_t>(std::min(numel, AndersonHistory::kStoreChunk));
      const std::size_t held =
          static_cast<std::size_t>(history.depth()) * chunk * params.front().element_size();
      TORCH_CHECK(held <= *limit, "AADL: a pass over the history of group ", g, " holds one ",
                  chunk, "-element chunk of each of its up to ", history.depth(),
                  " vectors at once, ", held, " bytes, more than the history placement's "
                  "device budget of ", *limit, " bytes; give the tiered store a budget of at "
                  "least ", held, " bytes (twice that lets the next chunks load meanwhile)");
    }
  }
  // Note [Loading the history ahead of use] (anderson_history.h): the first pass this step
  // makes over each history starts loading now, while the inner optimizer steps (and,
  // with a closure, runs the forward and backward pass).
  prefetch(NextStep{stores, accelerates});
  torch::Tensor loss = inner_->step(closure);
  torch::NoGradGuard no_grad;

  store_counter_ = stores ? 0 : store_counter_ + 1;
  call_counter_ += 1;
  // Group by group: a group's push and extrapolation read only its own parameters, and its
  // safeguard writes only those, so this order gives the same bits as all pushes first,
  // while holding one group's flattened vector at a time.
  std::vector<size_t> diverged;  // groups whose history is not finite (see aadl.h)
  // A group that throws part-way (a closure out of memory in its forward pass, a failed
  // solve) leaves the groups after it without this step's store, and the counters have
  // moved, so a retry would not make it: their histories would hold other steps than the
  // rest for good. So they still store it before the error goes on (an error of their
  // own then is not the one to report). A group whose own store is what failed goes
  // without this step's vector: there was no room for it.
  // Each group on its own: one whose store fails leaves the ones after it storing (review
  // finding: the first failure ended the loop, and those groups lost the step for good).
  size_t group = 0;
  const auto store_the_rest = [&] {
    if (!stores) return;
    for (size_t g = group + 1; g < histories_.size(); ++g) {
      try {
        histories_[g]->push(flatten(inner_->param_groups()[g].params()));
      } catch (...) {
      }
    }
  };
  const auto divergence = [&] {
    return c10::str("AADL: the history of parameter group(s) ", c10::Join(", ", diverged),
                    " holds NaN or Inf (or values whose inner products overflow): the "
                    "parameters diverged. Those groups were not accelerated, and are not "
                    "until that vector has left their history (history_depth = ",
                    options_.history_depth(), " stores)");
  };
  // A group before the one that threw may have diverged; the error that goes on must say
  // so too (review finding: the divergence was reported only when no group threw, so a
  // diverged run hitting a later group's out-of-memory showed the OOM alone).
  try {
    for (; group < histories_.size(); ++group) {
      step_group(group, stores, accelerates, closure, diverged);
    }
  } catch (c10::Error& error) {
    store_the_rest();
    if (!diverged.empty()) error.add_context(divergence());
    throw;
  } catch (...) {
    store_the_rest();
    if (!diverged.empty()) TORCH_WARN(divergence());
    throw;
  }
  TORCH_CHECK(diverged.empty(), divergence(),
              ". This step's inner update and store were made for every group.");
  return loss;
}

void AADL::step_group(size_t g, bool stores, bool accelerates, const LossClosure& closure,
                      std::vector<size_t>& diverged) {
  AndersonHistory& history = *histories_[g];
  const auto& params = inner_->param_groups()[g].params();
  // The vector stored this step, still on the compute device: the passes below read it
  // from here instead of loading it back (anderson_history.h, "Storage and streaming").
  torch::Tensor pushed;
  if (stores) {
    pushed = flatten(params);
    history.push(pushed);
  }
  if (!accelerates || history.size() < 3) return;
  if (!solvable(history)) {
    diverged.push_back(g);
    return;
  }
  if (!closure) {
    // The plain iterate is not needed again: the extrapolation overwrites it in place.
    unflatten(extrapolate(history, pushed, pushed), params);
    return;
  }
  const torch::Tensor plain = pushed.defined() ? pushed : flatten(params);
  const torch::Tensor accelerated = extrapolate(history, pushed, {});
  // The pass replace_newest makes loads during the two closure calls (forward passes);
  // after a rejection the next step's first pass reads them (Note [Loading the history
  // ahead of use]).
  history.prefetch(AndersonHistory::Pass::after_replace_newest);
  // On an error below, the parameters go back to the plain iterate; the error that got
  // there is the one to report, not one of putting them back.
  const auto back_to_plain = [&]() noexcept {
    try {
      unflatten(plain, params);
    } catch (...) {
    }
  };
  double plain_loss = 0.0, accelerated_loss = 0.0;
  try {
    plain_loss = loss_value(closure());
    unflatten(accelerated, params);
    accelerated_loss = loss_value(closure());
  } catch (...) {
    // A closure that throws (out of memory in its forward pass) leaves the plain
    // iterate, not one the safeguard never checked.
    back_to_plain();
    throw;
  }
  if (accelerated_loss < plain_loss) {
    try {
      history.replace_newest(accelerated);
    } catch (...) {
      // The history still ends at the plain iterate (Note [A failed push]): so must the
      // parameters, or the next step would start from a point the history never held.
      back_to_plain();
      throw;
    }
    ++accepted_;
  } else {
    unflatten(plain, params);
    ++rejected_;
  }
}

// ---- save / load -------------------------------------------------------------------------

namespace {

// One (possibly nested) archive of AADL's, read with messages that name the key as a path
// from the top ("history_1/gram"), and values of the wrong type refused as such rather than
// by c10's bare "Expected Int but got String".
struct ArchiveReader {
  torch::serialize::InputArchive& archive;
  std::string prefix;  // "" at the top, "history_<g>/" inside a group's archive

  std::string path(const std::string& key) const { return prefix + key; }

  c10::IValue value(const std::string& key) const {
    c10::IValue value;
    TORCH_CHECK(archive.try_read(key, value), "AADL::load: the archive has no '", path(key),
                "'");
    return value;
  }

  int64_t integer(const std::string& key) const { return integer(key, value(key)); }
  int64_t integer(const std::string& key, const c10::IValue& v) const {
    TORCH_CHECK(v.isInt(), "AADL::load: ", path(key), " is a ", v.tagKind(),
                " in the archive; it must be an integer");
    return v.toInt();
  }

  // Counts and counters: a negative one is no archive AADL::save writes, and the largest
  // int64 would overflow at the next step's increment.
  int64_t non_negative(const std::string& key) const {
    const int64_t v = integer(key);
    TORCH_CHECK(v >= 0 && v < std::numeric_limits<int64_t>::max(), "AADL::load: ", path(key),
                " is ", v, " in the archive; it must be >= 0 and below 2^63 - 1");
    return v;
  }

  std::vector<int64_t> integers(const std::string& key) const {
    const c10::IValue v = value(key);
    TORCH_CHECK(v.isIntList(), "AADL::load: ", path(key), " is a ", v.tagKind(),
                " in the archive; it must be a list of integers");
    return v.toIntVector();
  }

  torch::Tensor tensor(const std::string& key) const {
    const c10::IValue v = value(key);
    TORCH_CHECK(v.isTensor(), "AADL::load: ", path(key), " is a ", v.tagKind(),
                " in the archive; it must be a tensor");
    return v.toTensor();
  }
};

// Note [What a loaded Gram matrix must be]
// The archive's G is taken as it is (recomputing it costs a pass per vector), so it is
// checked for what every G AADL saves has, whatever the parameters did: symmetric to the
// bit (each row is also written as its column, anderson_history.cpp) and a diagonal of
// squared norms, never negative. A diverged run's NaN or Inf are kept (save wrote them;
// the step then skips the acceleration, as before the save). What fails is an archive
// damaged or made by hand, which would otherwise steer every accelerated step.
void check_saved_gram(const ArchiveReader& reader, const torch::Tensor& gram) {
  const torch::Tensor transposed = gram.t();
  const bool symmetric =
      ((gram == transposed) | (torch::isnan(gram) & torch::isnan(transposed))).all().item<bool>();
  TORCH_CHECK(symmetric, "AADL::load: ", reader.path("gram"),
              " in the archive is not symmetric, so it is not the Gram matrix AADL saved (a "
              "damaged archive?)");
  const bool diagonal_ok = (gram.diagonal() < 0).logical_not().all().item<bool>();
  TORCH_CHECK(diagonal_ok, "AADL::load: ", reader.path("gram"),
              " in the archive has a negative diagonal entry, so it is not the Gram matrix "
              "AADL saved (a damaged archive?)");
}

// Group g's history from its archive (history_<g>), as a new history of `current`'s depth
// and placement on the parameters' device, in their dtype; `current` is left as it is.
//
// Dtypes. The history vectors are iterates of the parameters and are stored in their
// dtype, as step() pushes them; an archive saved from a model of another dtype (fp64
// loaded into fp32, or back) is cast to it, as PyTorch's Optimizer.load_state_dict casts
// floating-point state to its parameter's dtype: fp64 → fp32 rounds the iterates, the
// other way is exact. The matrices are then recomputed from the vectors as stored, not
// taken from the archive: G and c must be DRᵀDR and DRᵀb of exactly the stored vectors,
// because later pushes add rows computed from the stored values, and G with rows of two
// origins is the Gram matrix of no history (it need not even be positive semidefinite);
// recomputing costs one pass per vector, once, at load. gram and rhs are fp64 however the
// parameters are (anderson_history.h) and save writes them so: any other dtype or shape
// is no archive of AADL's and is refused, not cast (an fp32 "Gram matrix" cast up would
// pass for the fp64 accumulator it is not). Vectors that are not floating point are
// refused too: integer "iterates" are no archive of AADL's either.
std::unique_ptr<AndersonHistory> read_history(torch::serialize::InputArchive& archive, size_t g,
                                              const AndersonHistory& current,
                                              const std::vector<torch::Tensor>& params) {
  const ArchiveReader reader{archive, "history_" + std::to_string(g) + "/"};
  // Archives written before the shapes were saved have none to check.
  c10::IValue saved_param_count;
  if (archive.try_read("param_count", saved_param_count)) {
    const int64_t param_count = reader.integer("param_count", saved_param_count);
    TORCH_CHECK(param_count == static_cast<int64_t>(params.size()), "AADL::load: group ", g,
                " has ", param_count, " parameters in the archive, this optimizer ",
                params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const std::vector<int64_t> shape = reader.integers("param_shape_" + std::to_string(i));
      TORCH_CHECK(params[i].sizes() == at::IntArrayRef(shape), "AADL::load: parameter ", i,
                  " of group ", g, " has shape ", at::IntArrayRef(shape),
                  " in the archive, this optimizer ", params[i].sizes());
    }
  }
  const int64_t count = reader.non_negative("count");
  TORCH_CHECK(count <= current.depth(), "AADL::load: ", reader.path("count"), " is ", count,
              " in the archive: more history vectors than history_depth ", current.depth());
  const torch::TensorOptions compute = params.front().options().requires_grad(false);
  const int64_t numel = check_group(params);  // counted: no flattened copy to count it
  std::vector<torch::Tensor> vectors;
  bool recast = false;  // some vector is of another dtype than the parameters
  for (int64_t i = 0; i < count; ++i) {
    const std::string key = "vector_" + std::to_string(i);
    torch::Tensor v = reader.tensor(key);
    TORCH_CHECK(v.dim() == 1 && v.numel() == numel, "AADL::load: ", reader.path(key),
                " is a ", v.sizes(), " tensor in the archive; group ", g, " has ", numel,
                " elements");
    TORCH_CHECK(c10::isFloatingType(v.scalar_type()), "AADL::load: ", reader.path(key),
                " is a ", v.scalar_type(), " tensor in the archive; it must be floating point");
    recast = recast || v.scalar_type() != params.front().scalar_type();
    vectors.push_back(std::move(v));
  }
  const int64_t k = AndersonHistory::matrix_order(count);
  const torch::Tensor gram = reader.tensor("gram");
  const torch::Tensor rhs = reader.tensor("rhs");
  const bool gram_fits =
      gram.scalar_type() == torch::kFloat64 && gram.dim() == 2 && gram.size(0) == k &&
      gram.size(1) == k;
  const bool rhs_fits = rhs.scalar_type() == torch::kFloat64 && rhs.dim() == 1 && rhs.size(0) == k;
  TORCH_CHECK(gram_fits,
              "AADL::load: ", reader.path("gram"), " is a ", gram.sizes(), " ",
              gram.scalar_type(), " tensor in the archive; it must be a [", k, ", ", k,
              "] Double tensor (the fp64 Gram matrix of ", count, " history vectors)");
  TORCH_CHECK(rhs_fits,
              "AADL::load: ", reader.path("rhs"), " is a ", rhs.sizes(), " ", rhs.scalar_type(),
              " tensor in the archive; it must be a [", k, "] Double tensor (for ", count,
              " history vectors)");
  check_saved_gram(reader, gram);
  if (!recast) return current.restored(vectors, gram, rhs, compute);
  auto history = current.restored({}, gram.new_zeros({0, 0}), rhs.new_zeros({0}), compute);
  for (const auto& v : vectors) history->push(v.to(compute));
  return history;
}

// Loads `archive` into `inner` as a replacement of its state, all or nothing. LibTorch's
// optimizers load into their state map group by group: one that fails on a later group
// keeps the earlier groups' state and options from the archive, and one that succeeds
// keeps the state of parameters the archive has none for (those that had not stepped when
// it was saved: every momentum buffer in an archive saved before the first step). So the
// load starts from no state, as in a fresh optimizer, and the previous state and options
// go back if it throws. (State an inner optimizer keeps outside state() and its groups'
// options is its own load's to keep consistent.)
void load_replacing_state(torch::optim::Optimizer& inner,
                          torch::serialize::InputArchive& archive) {
  auto previous_state = std::move(inner.state());
  inner.state().clear();  // a moved-from map is only valid, not necessarily empty
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> previous_options;
  for (const auto& group : inner.param_groups()) {
    previous_options.push_back(group.options().clone());
  }
  const auto put_back = [&] {
    inner.state() = std::move(previous_state);
    for (size_t g = 0; g < previous_options.size(); ++g) {
      inner.param_groups()[g].set_options(std::move(previous_options[g]));
    }
  };
  try {
    inner.load(archive);
  } catch (c10::Error& e) {
    put_back();
    // The inner optimizer's message does not say that AADL's load was refused.
    e.add_context("AADL::load: the inner optimizer refused its archive");
    throw;
  } catch (const std::exception& e) {
    // e.g. torch::jit::ObjectAttributeError for a key its archive lacks.
    put_back();
    TORCH_CHECK(false, "AADL::load: the inner optimizer refused its archive: ", e.what());
  } catch (...) {
    put_back();
    throw;
  }
}

}  // namespace

void AADL::save(torch::serialize::OutputArchive& archive) const {
  check_inner_groups("AADL::save");
  archive.write("aadl_format", c10::IValue(kArchiveFormat));
  archive.write("call_counter", c10::IValue(call_counter_));
  archive.write("store_counter", c10::IValue(store_counter_));
  archive.write("accepted", c10::IValue(accepted_));
  archive.write("rejected", c10::IValue(rejected_));
  torch::serialize::OutputArchive inner_archive;
  inner_->save(inner_archive);
  archive.write("inner", inner_archive);
  archive.write("group_count", c10::IValue(static_cast<int64_t>(histories_.size())));
  for (size_t g = 0; g < histories_.size(); ++g) {
    torch::serialize::OutputArchive history_archive;
    const std::vector<torch::Tensor> vectors = histories_[g]->read_host();
    history_archive.write("count", c10::IValue(static_cast<int64_t>(vectors.size())));
    for (size_t i = 0; i < vectors.size(); ++i) {
      history_archive.write("vector_" + std::to_string(i), vectors[i], true);
    }
    history_archive.write("gram", histories_[g]->gram(), true);
    history_archive.write("rhs", histories_[g]->rhs(), true);
    // The group's parameter shapes, which load checks: the history only fixes their total
    // size, and LibTorch's optimizers load per-parameter state without checking its shape
    // (a momentum buffer of another parameter would load and fail the next step).
    const auto& params = inner_->param_groups()[g].params();
    history_archive.write("param_count", c10::IValue(static_cast<int64_t>(params.size())));
    for (size_t i = 0; i < params.size(); ++i) {
      history_archive.write("param_shape_" + std::to_string(i), c10::IValue(params[i].sizes()));
    }
    archive.write("history_" + std::to_string(g), history_archive);
  }
}

// All or nothing: everything is read and checked, and the histories are rebuilt beside
// the current ones, before the inner optimizer loads (load_replacing_state, which puts it
// back if it throws); only then are the histories and counters replaced, which cannot
// fail. A failed load leaves this optimizer as it was, at the cost of holding the old and
// the new history at once while it runs (in the placement: host memory when tiered).
void AADL::load(torch::serialize::InputArchive& archive) {
  check_inner_groups("AADL::load");
  const ArchiveReader reader{archive, ""};
  const int64_t format = reader.integer("aadl_format");
  TORCH_CHECK(format == kArchiveFormat, "AADL::load: aadl_format is ", format,
              " in the archive; this build reads format ", kArchiveFormat);
  const int64_t group_count = reader.integer("group_count");
  TORCH_CHECK(group_count == static_cast<int64_t>(histories_.size()),
              "AADL::load: the archive has ", group_count, " groups, this optimizer ",
              histories_.size());
  // Only the sign is checked. save writes store_counter <= call_counter (calls since the
  // last store) and accepted + rejected <= call_counter × groups, but nothing relies on
  // either: next_step() reads each of the two step counters on its own, against this
  // optimizer's options (store_each_nth, frequency), which need not be those that saved
  // (any value >= 0 then steps correctly), and accepted and rejected are only reported.
  // A negative store_counter or call_counter would silently postpone the next store or
  // the next acceleration by as many calls.
  const int64_t call_counter = reader.non_negative("call_counter");
  const int64_t store_counter = reader.non_negative("store_counter");
  const int64_t accepted = reader.non_negative("accepted");
  const int64_t rejected = reader.non_negative("rejected");
  std::vector<std::unique_ptr<AndersonHistory>> restored;
  for (size_t g = 0; g < histories_.size(); ++g) {
    torch::serialize::InputArchive history_archive;
    TORCH_CHECK(archive.try_read("history_" + std::to_string(g), history_archive),
                "AADL::load: the archive has no history for group ", g);
    restored.push_back(read_history(history_archive, g, *histories_[g],
                                    inner_->param_groups()[g].params()));
  }
  torch::serialize::InputArchive inner_archive;
  TORCH_CHECK(archive.try_read("inner", inner_archive),
              "AADL::load: the archive has no inner optimizer");
  load_replacing_state(*inner_, inner_archive);
  histories_ = std::move(restored);
  call_counter_ = call_counter;
  store_counter_ = store_counter;
  accepted_ = accepted;
  rejected_ = rejected;
}

}  // namespace tidepool::optim
