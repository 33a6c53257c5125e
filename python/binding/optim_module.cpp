// tidepool._optim — the Python binding of tidepool::optim (Apollo, AADL), which
// tidepool.optim (python/src/tidepool/optim.py) wraps in torch.optim-style classes.
//
// Why a binding and not the drop-in: the drop-in tiers the state a Python optimizer keeps in
// `optimizer.state`, but the published AADL keeps its history on the optimizer object,
// where no hook sees it, and stacks it on the device every step; and Apollo's Python step
// reads its three state tensors once per operation. Here the C++ optimizers run the step
// (fused kernels, the history streamed chunk by chunk) with their state wherever the chosen
// placement keeps it.
//
// What crosses the boundary, and how:
//   - Parameters are the Python tensors themselves (at::Tensor shares the TensorImpl), so
//     the C++ step updates what the model holds.
//   - Group options are plain dicts (keys as the reference spells them); the Python class
//     sends its param_groups' options before every step, so LR schedulers work.
//   - The GIL is released for the whole step. A Python closure, or AADL's Python inner
//     optimizer, is called with it taken again (Note [Python called from the step]).
//   - Errors: option checks become ValueError, out-of-memory torch.OutOfMemoryError, other
//     c10::Error RuntimeError, without the C++ backtrace.
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "optimizers/aadl.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "tiering/tiered_store.h"

namespace py = pybind11;
using tidepool::optim::AADL;
using tidepool::optim::AADLOptions;
using tidepool::optim::Apollo;
using tidepool::optim::ApolloOptions;
using tidepool::optim::ApolloSavedParam;
using tidepool::optim::StatePlacement;

namespace {

// ---- placements -----------------------------------------------------------------------------

// The device index a placement's store works for, checked against the backend tidepool's
// allocators use: the store copies with that backend, so it must be where LibTorch computes.
int tiered_device(const torch::Tensor& first_param) {
  const bool cuda_backend = tidepool::selected_backend() == tidepool::BackendKind::cuda;
  if (first_param.is_cuda() != cuda_backend) {
    throw py::value_error(std::string("tidepool.optim: tiered state lives in tidepool's store, "
                                      "whose backend in this process is '") +
                          (cuda_backend ? "cuda" : "host") + "', but the parameters are on " +
                          first_param.device().str() + " (use 'device' or 'host' there)");
  }
  return first_param.is_cuda() ? first_param.get_device() : 0;
}

// `where`: "device" (resident), "host" (host-staged: pinned host memory on CUDA, staged
// onto the device around each use) or "tiered" (tidepool's tiered store under
// `budget` bytes of device memory; None: tidepool.state_budget when it is above 0, else
// the store's own default of 1 GiB).
std::shared_ptr<StatePlacement> make_placement(const std::string& where,
                                               std::optional<int64_t> budget,
                                               const torch::Tensor& first_param, int tag,
                                               tidepool::optim::WriteBack write_back) {
  if (where == "device") return std::make_shared<tidepool::optim::ResidentPlacement>();
  if (where == "host") return std::make_shared<tidepool::optim::HostStagedPlacement>();
  if (where != "tiered") {
    throw py::value_error("tidepool.optim: state placement '" + where +
                          "' is not one of 'device', 'host', 'tiered'");
  }
  if (budget && *budget <= 0) {
    throw py::value_error(
        "tidepool.optim: a tiered budget must be a positive number of bytes, not " +
        std::to_string(*budget));
  }
  tidepool::CachingAllocator& allocator = tidepool::device_allocator(tiered_device(first_param));
  tidepool::TieredStoreOptions options;
  if (budget) options.device_budget_bytes = static_cast<std::size_t>(*budget);
  auto store = std::make_shared<tidepool::TieredStore>(
      allocator.backend(), options, tidepool::caching_allocator_source(allocator, tag));
  return std::make_shared<tidepool::optim::TieredPlacement>(store, tidepool::Stream{}, tag,
                                                           write_back);
}

// What a placement moved and holds, for tidepool.optim's placement_stats().
py::dict placement_stats(const StatePlacement& placement) {
  py::dict stats;
  stats["placement"] = placement.name();
  if (const auto* staged = dynamic_cast<const tidepool::optim::HostStagedPlacement*>(&placement)) {
    stats["bytes_to_device"] = staged->traffic().to_device.load();
    stats["bytes_to_host"] = staged->traffic().to_host.load();
  } else if (const auto* tiered =
                 dynamic_cast<const tidepool::optim::TieredPlacement*>(&placement)) {
    const tidepool::TieredStoreStats s = tiered->store().stats();
    stats["bytes_to_device"] = s.copy.h2d.bytes;
    stats["bytes_to_host"] = s.copy.d2h.bytes;
    stats["state_bytes"] = tiered->live_bytes();
    stats["pageable_bytes"] = tiered->pageable_bytes();
    stats["device_budget_bytes"] = s.device_budget_bytes;
    stats["device_bytes"] = s.device_bytes;
    stats["device_peak_bytes"] = s.device_peak_bytes;
    stats["prefetch_hits"] = s.prefetch_hits;
    stats["misses"] = s.misses;
    stats["evictions"] = s.evictions;
    stats["acquire_wait_seconds"] = tiered->acquire_wait_seconds();
  }
  return stats;
}

// ---- Python called from the step ------------------------------------------------------------

// Note [Python called from the step]: step() runs with the GIL released, so whatever calls
// back into Python (a closure, AADL's Python inner optimizer) takes it first. The closure
// is held by a strong reference, shared by every copy of the std::function: a Python inner
// optimizer may keep the callable it was given (ours wraps the std::function) past the
// step, and a borrowed pointer would then dangle once the caller dropped its closure. The
// last copy may be destroyed in any thread, so the reference is dropped with the GIL taken
// (and not at all once the interpreter is finalizing, when taking it is unsafe). A Python
// exception leaves as py::error_already_set through the C++ step (which unwinds as for any
// error) and is raised again in the caller.

// A closure's result as the loss tensor: a tensor, a Python number (as fp64), or None.
torch::Tensor loss_from_python(const py::object& result) {
  if (result.is_none()) return {};
  if (THPVariable_Check(result.ptr())) return THPVariable_Unpack(result.ptr());
  if (py::isinstance<py::float_>(result) || py::isinstance<py::int_>(result)) {
    return torch::scalar_tensor(result.cast<double>(), torch::kFloat64);
  }
  throw py::type_error("tidepool.optim: a closure must return a tensor, a number or None, not " +
                       std::string(py::str(py::type::of(result).attr("__name__"))));
}

// The loss back to Python: the tensor, or None when there is none.
py::object loss_to_python(const torch::Tensor& loss) {
  return loss.defined() ? py::cast(loss) : py::none();
}

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// A strong reference to a Python object that may be dropped in a thread without the GIL.
std::shared_ptr<PyObject> owned_with_gil_on_release(const py::object& object) {
  return std::shared_ptr<PyObject>(object.inc_ref().ptr(), [](PyObject* held) {
    if (Py_IsInitialized() == 0 || interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    Py_DECREF(held);
  });
}

torch::optim::Optimizer::LossClosure closure_from_python(const py::object& closure) {
  if (closure.is_none()) return nullptr;
  return [held = owned_with_gil_on_release(closure)]() -> torch::Tensor {
    py::gil_scoped_acquire gil;
    return loss_from_python(py::reinterpret_borrow<py::object>(held.get())());
  };
}

// AADL's inner optimizer when it is a Python one: its step is the Python optimizer's step
// (global and per-optimizer step hooks included), called with the GIL taken. Its state is
// the Python optimizer's, saved by the Python side: save/load here write and read nothing.
struct PythonInnerOptions
    : public torch::optim::OptimizerCloneableOptions<PythonInnerOptions> {};

class PythonInnerOptimizer final : public torch::optim::Optimizer {
 public:
  PythonInnerOptimizer(const std::vector<std::vector<torch::Tensor>>& groups, py::object step)
      : torch::optim::Optimizer(as_groups(groups), std::make_unique<PythonInnerOptions>()),
        step_(std::move(step)) {}
  // The Python step function is released by whoever drops the last reference to this
  // optimizer: the AADL, owned by a Python object, which is destroyed with the GIL held.
  ~PythonInnerOptimizer() override = default;

  torch::Tensor step(LossClosure closure) override {
    py::gil_scoped_acquire gil;
    if (!closure) return loss_from_python(step_());
    // The Python optimizer calls this with the GIL held; the closure takes it again
    // (re-entrant) around the user's Python closure.
    py::cpp_function call([closure]() -> py::object { return loss_to_python(closure()); });
    return loss_from_python(step_(call));
  }
  void save(torch::serialize::OutputArchive& /*archive*/) const override {}
  void load(torch::serialize::InputArchive& /*archive*/) override {}

 private:
  static std::vector<torch::optim::OptimizerParamGroup> as_groups(
      const std::vector<std::vector<torch::Tensor>>& groups) {
    std::vector<torch::optim::OptimizerParamGroup> result;
    result.reserve(groups.size());
    for (const auto& params : groups) result.emplace_back(params);
    return result;
  }
  py::object step_;
};

// Apollo's or AADL's step, with the GIL released (Note [Python called from the step]).
py::object step_optimizer(torch::optim::Optimizer& optimizer, const py::object& closure) {
  torch::Tensor loss;
  {
    auto cpp_closure = closure_from_python(closure);
    py::gil_scoped_release released;
    loss = optimizer.step(cpp_closure);
  }
  return loss_to_python(loss);
}

// ---- options ---------------------------------------------------------------------------------

template <typename T>
T required(const py::dict& options, const char* key) {
  if (!options.contains(key)) {
    throw py::value_error(std::string("tidepool.optim: option '") + key + "' is missing");
  }
  try {
    return options[key].cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("tidepool.optim: option '") + key + "' has the wrong type (" +
                         std::string(py::str(options[key])) + ")");
  }
}

template <typename T>
std::optional<T> optional_option(const py::dict& options, const char* key) {
  if (!options.contains(key) || options[key].is_none()) return std::nullopt;
  return required<T>(options, key);
}

// Runs `check` and turns what it refuses (c10::Error) into ValueError with its message.
template <typename Check>
auto refused_as_value_error(Check&& check) {
  try {
    return check();
  } catch (const c10::OutOfMemoryError&) {
    throw;  // a c10::Error too, but not a refusal: it stays torch.OutOfMemoryError
  } catch (const c10::Error& e) {
    throw py::value_error(e.what_without_backtrace());
  }
}

ApolloOptions apollo_options(const py::dict& d) {
  return refused_as_value_error([&] {
    ApolloOptions o(required<double>(d, "lr"));
    o.beta(required<double>(d, "beta"));
    o.eps(required<double>(d, "eps"));
    o.rebound(required<std::string>(d, "rebound"));
    o.warmup(required<int64_t>(d, "warmup"));
    o.weight_decay(required<double>(d, "weight_decay"));
    if (auto v = optional_option<double>(d, "init_lr")) o.init_lr(*v);
    if (auto v = optional_option<double>(d, "base_lr")) o.base_lr(*v);
    if (auto v = optional_option<std::string>(d, "weight_decay_type")) o.weight_decay_type(*v);
    return o;
  });
}

// Options as a constructor's defaults or a group joining an optimizer need them: checked
// (a refusal is a ValueError; a group's lr may be 0, frozen from the start, which the
// reference, checking only its constructor's lr, takes), with the lr-dependent defaults
// filled in.
ApolloOptions joining_apollo_options(const py::dict& d,
                                     ApolloOptions::Check check = ApolloOptions::Check::group) {
  ApolloOptions o = apollo_options(d);
  refused_as_value_error([&] { o.validate(check); });
  return o.resolve_defaults();
}

py::dict apollo_options_dict(const ApolloOptions& o) {
  py::dict d;
  d["lr"] = o.lr();
  d["beta"] = o.beta();
  d["eps"] = o.eps();
  d["rebound"] = tidepool::optim::to_string(o.rebound());
  d["warmup"] = o.warmup();
  d["init_lr"] = o.init_lr() ? py::cast(*o.init_lr()) : py::none();
  d["base_lr"] = o.base_lr() ? py::cast(*o.base_lr()) : py::none();
  d["weight_decay"] = o.weight_decay();
  d["weight_decay_type"] =
      o.weight_decay_type() ? py::cast(tidepool::optim::to_string(*o.weight_decay_type()))
                            : py::none();
  return d;
}

AADLOptions aadl_options(const py::dict& d) {
  return refused_as_value_error([&] {
    AADLOptions o;
    o.acceleration_type(required<std::string>(d, "acceleration_type"));
    o.relaxation(required<double>(d, "relaxation"));
    o.wait_iterations(required<int64_t>(d, "wait_iterations"));
    o.history_depth(required<int64_t>(d, "history_depth"));
    o.store_each_nth(required<int64_t>(d, "store_each_nth"));
    o.frequency(required<int64_t>(d, "frequency"));
    o.reg_acc(required<double>(d, "reg_acc"));
    o.validate();
    return o;
  });
}

// ---- Apollo ------------------------------------------------------------------------------------

using ParamGroups = std::vector<std::pair<std::vector<torch::Tensor>, py::dict>>;

// `defaults`: the constructor's options (the Python optimizer's defaults), which are
// checked as a constructor's; each group's own are checked as a group's. The first group's
// options stood in for the defaults before, so a first group at lr 0 (a frozen backbone
// listed first) or an empty first group was refused, where torch.optim takes them.
std::unique_ptr<Apollo> make_apollo(const ParamGroups& groups, const std::string& where,
                                    std::optional<int64_t> budget, const py::dict& defaults) {
  const torch::Tensor* first = nullptr;
  for (const auto& [params, options] : groups) {
    if (!params.empty()) {
      first = &params.front();
      break;
    }
  }
  if (first == nullptr) throw py::value_error("tidepool.optim.Apollo: no parameters to optimize");
  const ApolloOptions resolved_defaults =
      joining_apollo_options(defaults, ApolloOptions::Check::construction);
  std::vector<torch::optim::OptimizerParamGroup> cpp_groups;
  for (const auto& [params, options] : groups) {
    cpp_groups.emplace_back(params,
                            std::make_unique<ApolloOptions>(joining_apollo_options(options)));
  }
  auto placement = make_placement(where, budget, *first, TIDEPOOL_TAG_OPTIMIZER_STATE,
                                  tidepool::optim::WriteBack::automatic);
  return std::make_unique<Apollo>(cpp_groups, resolved_defaults, placement);
}

py::object saved_param_tuple(const std::optional<ApolloSavedParam>& s) {
  if (!s) return py::none();
  return py::make_tuple(s->step, s->exp_avg_grad, s->approx_hessian, s->update);
}

py::list saved_apollo_state(const Apollo& apollo) {
  std::vector<std::optional<ApolloSavedParam>> saved;
  {
    py::gil_scoped_release released;  // read_host copies from wherever the state lives
    saved = apollo.saved_state();
  }
  py::list result;
  for (const auto& s : saved) result.append(saved_param_tuple(s));
  return result;
}

py::object saved_apollo_param_state(const Apollo& apollo, size_t index) {
  std::optional<ApolloSavedParam> saved;
  {
    py::gil_scoped_release released;
    saved = apollo.saved_state(index);
  }
  return saved_param_tuple(saved);
}

void restore_apollo_state(Apollo& apollo, const std::vector<py::dict>& options,
                          const std::vector<std::optional<py::tuple>>& state) {
  std::vector<ApolloOptions> cpp_options;
  for (const auto& o : options) cpp_options.push_back(apollo_options(o));
  std::vector<std::optional<ApolloSavedParam>> cpp_state;
  for (const auto& s : state) {
    auto& saved = cpp_state.emplace_back();
    if (!s) continue;
    if (s->size() != 4) throw py::value_error("tidepool.optim.Apollo: a saved state has 4 entries");
    saved = ApolloSavedParam{(*s)[0].cast<int64_t>(), (*s)[1].cast<torch::Tensor>(),
                             (*s)[2].cast<torch::Tensor>(), (*s)[3].cast<torch::Tensor>()};
  }
  py::gil_scoped_release released;
  refused_as_value_error([&] { apollo.restore_state(std::move(cpp_options), cpp_state); });
}

// ---- AADL --------------------------------------------------------------------------------------

std::unique_ptr<AADL> make_aadl(const std::vector<std::vector<torch::Tensor>>& groups,
                                py::object inner_step, const py::dict& options,
                                const std::string& where, std::optional<int64_t> budget) {
  if (groups.empty()) throw py::value_error("tidepool.optim.AADL: the optimizer has no parameters");
  for (const auto& params : groups) {
    if (params.empty()) {
      throw py::value_error("tidepool.optim.AADL: a parameter group of the optimizer is empty");
    }
  }
  const AADLOptions o = aadl_options(options);
  std::shared_ptr<StatePlacement> placement;
  // "host" is AADL's own default (host-staged for CUDA parameters, resident for CPU ones).
  if (where != "host") {
    // The history is only read between writes: dropped after each pass (it is clean), so
    // between passes it lives in host memory only.
    placement = make_placement(where, budget, groups.front().front(),
                               tidepool_tag_id("aadl_history"),
                               tidepool::optim::WriteBack::on_release);
  }
  auto inner = std::make_shared<PythonInnerOptimizer>(groups, std::move(inner_step));
  return refused_as_value_error([&] { return std::make_unique<AADL>(inner, o, placement); });
}

// The saved history as a 1-D uint8 CPU tensor that owns the archive's bytes (written once,
// not copied): torch.save stores a tensor as its own record, where bytes went through
// pickle protocol 2 as a latin-1 string (about 1.5x the size, and refused beyond 4 GiB:
// a history of 15 vectors of a 50M-parameter fp32 model is 3 GB; review finding).
torch::Tensor save_aadl(const AADL& aadl) {
  auto bytes = std::make_unique<std::vector<char>>();
  {
    py::gil_scoped_release released;
    torch::serialize::OutputArchive archive;
    aadl.save(archive);
    archive.save_to([&bytes](const void* data, size_t size) {
      const auto* first = static_cast<const char*>(data);
      bytes->insert(bytes->end(), first, first + size);
      return size;
    });
  }
  std::vector<char>* owned = bytes.get();
  auto saved = torch::from_blob(
      owned->data(), {static_cast<int64_t>(owned->size())},
      [owned](void*) { delete owned; }, torch::TensorOptions().dtype(torch::kUInt8));
  bytes.release();  // the tensor's deleter owns it now
  return saved;
}

// `saved`: what save_aadl returned, as a contiguous 1-D uint8 CPU tensor (optim.py checks
// and converts, the bytes earlier versions saved among them).
void load_aadl(AADL& aadl, const torch::Tensor& saved) {
  const torch::Tensor bytes = saved.contiguous();
  const char* first = static_cast<const char*>(bytes.data_ptr());
  const auto size = static_cast<std::size_t>(bytes.numel());
  py::gil_scoped_release released;
  torch::serialize::InputArchive archive;
  refused_as_value_error([&] {
    // PyTorch's reader names neither AADL nor the state_dict's key.
    try {
      archive.load_from(first, size);
    } catch (const c10::Error& e) {
      throw py::value_error(std::string("tidepool.optim.AADL: the state_dict's 'aadl' is not "
                                        "a saved AADL history (nothing was loaded): ") +
                            e.what_without_backtrace());
    }
    aadl.load(archive);
  });
}

}  // namespace

PYBIND11_MODULE(_optim, m) {
  m.doc() = "tidepool::optim (Apollo, AADL) for tidepool.optim; use that module, not this one";

  // Local translators run before pybind11's own and torch's: the Python exception
  // matches the kind of error, and the message is the C++ one without its backtrace.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::OutOfMemoryError& e) {
      py::object oom = py::module_::import("torch").attr("OutOfMemoryError");
      PyErr_SetString(oom.ptr(), e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  m.def("has_fused_cuda_kernels", &Apollo::has_fused_kernels);
  // The options checked as a constructor checks them, with the lr-dependent defaults
  // filled in (ApolloOptions::resolve_defaults): tidepool.optim.Apollo's defaults, which
  // its groups inherit, as the reference's do.
  m.def("resolved_apollo_options", [](const py::dict& options) {
    return apollo_options_dict(joining_apollo_options(options, ApolloOptions::Check::construction));
  });

  py::class_<Apollo>(m, "Apollo")
      .def(py::init(&make_apollo), py::arg("groups"), py::arg("placement"), py::arg("budget"),
           py::arg("defaults"))
      .def("step", [](Apollo& a, const py::object& c) { return step_optimizer(a, c); },
           py::arg("closure"))
      .def("set_options",
           [](Apollo& apollo, size_t group, const py::dict& options) {
             ApolloOptions o = apollo_options(options);
             // As the step would check them, but a ValueError naming the option (the
             // step's check is a RuntimeError), sent before the step changes anything.
             refused_as_value_error([&] { o.validate(ApolloOptions::Check::training); });
             o.resolve_defaults();
             apollo.param_groups().at(group).set_options(std::make_unique<ApolloOptions>(o));
           })
      .def("options",
           [](Apollo& apollo, size_t group) {
             return apollo_options_dict(
                 static_cast<const ApolloOptions&>(apollo.param_groups().at(group).options()));
           })
      .def("add_param_group",
           [](Apollo& apollo, const std::vector<torch::Tensor>& params, const py::dict& options) {
             apollo.add_param_group(torch::optim::OptimizerParamGroup(
                 params, std::make_unique<ApolloOptions>(joining_apollo_options(options))));
           })
      .def("saved_state", &saved_apollo_state)
      .def("saved_param_state", &saved_apollo_param_state, py::arg("index"))
      .def("parameters_with_state", &Apollo::parameters_with_state)
      .def("restore_state", &restore_apollo_state)
      .def_property("fused", &Apollo::fused_kernels, &Apollo::set_fused_kernels)
      .def("placement_stats", [](const Apollo& a) { return placement_stats(a.placement()); });

  py::class_<AADL>(m, "AADL")
      .def(py::init(&make_aadl), py::arg("groups"), py::arg("inner_step"), py::arg("options"),
           py::arg("placement"), py::arg("budget"))
      .def("step", [](AADL& a, const py::object& c) { return step_optimizer(a, c); },
           py::arg("closure"))
      .def("prefetch",
           [](const AADL& aadl) {
             py::gil_scoped_release released;
             aadl.prefetch();
           })
      .def_property_readonly("accepted", &AADL::accepted)
      .def_property_readonly("rejected", &AADL::rejected)
      .def("placement_stats",
           [](const AADL& aadl, size_t group) {
             return placement_stats(aadl.history(group).placement());
           })
      .def("history_size",
           [](const AADL& aadl, size_t group) { return aadl.history(group).size(); })
      .def("save", &save_aadl)
      .def("load", &load_aadl);
}
