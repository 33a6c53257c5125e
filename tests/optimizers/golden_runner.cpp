// Golden-trajectory runner: builds the MLP problem and the optimizer a golden file
// describes, runs the file's step protocol, and compares against the reference.
#include "golden_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <stdexcept>

#include "archive_bytes.h"
#include "optimizers/aadl.h"
#include "optimizers/apollo.h"

namespace tidepool::testing {

namespace {

std::vector<int64_t> shape_of(const JsonValue& v) {
  std::vector<int64_t> shape;
  for (double d : v.numbers()) shape.push_back(static_cast<int64_t>(d));
  return shape;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

torch::Tensor to_tensor(const std::vector<double>& values, const std::vector<int64_t>& shape,
                        const RunOptions& o) {
  return torch::tensor(values, torch::kFloat64).reshape(shape).to(o.device, o.dtype);
}

// ---- the optimizers a golden file can name ------------------------------------------------

optim::ApolloOptions apollo_options(const JsonValue& j) {
  optim::ApolloOptions o(j["lr"].number());
  if (j.has("beta")) o.beta(j["beta"].number());
  if (j.has("eps")) o.eps(j["eps"].number());
  if (j.has("rebound")) o.rebound(j["rebound"].string());
  if (j.has("warmup")) o.warmup(static_cast<int64_t>(j["warmup"].number()));
  if (j.has("init_lr") && !j["init_lr"].is_null()) o.init_lr(j["init_lr"].number());
  if (j.has("weight_decay")) o.weight_decay(j["weight_decay"].number());
  if (j.has("weight_decay_type") && !j["weight_decay_type"].is_null()) {
    o.weight_decay_type(j["weight_decay_type"].string());
  }
  return o;
}

std::shared_ptr<torch::optim::Optimizer> base_optimizer(const JsonValue& j,
                                                        const std::vector<torch::Tensor>& params) {
  const std::string& type = j["base"].string();
  const JsonValue& b = j["base_options"];
  const auto get = [&](const char* key, double fallback) {
    return b.has(key) ? b[key].number() : fallback;
  };
  if (type == "SGD") {
    torch::optim::SGDOptions o(get("lr", 1e-3));
    o.momentum(get("momentum", 0.0)).dampening(get("dampening", 0.0));
    o.weight_decay(get("weight_decay", 0.0));
    if (b.has("nesterov")) o.nesterov(b["nesterov"].boolean());
    return std::make_shared<torch::optim::SGD>(params, o);
  }
  if (type == "Adam") {
    torch::optim::AdamOptions o(get("lr", 1e-3));
    if (b.has("betas")) {
      const auto betas = b["betas"].numbers();
      o.betas({betas.at(0), betas.at(1)});
    }
    o.eps(get("eps", 1e-8)).weight_decay(get("weight_decay", 0.0));
    if (b.has("amsgrad")) o.amsgrad(b["amsgrad"].boolean());
    return std::make_shared<torch::optim::Adam>(params, o);
  }
  throw std::runtime_error("golden: unknown base optimizer '" + type + "'");
}

optim::AADLOptions aadl_options(const JsonValue& a) {
  optim::AADLOptions o;
  if (a.has("acceleration_type")) o.acceleration_type(a["acceleration_type"].string());
  if (a.has("relaxation")) o.relaxation(a["relaxation"].number());
  if (a.has("wait_iterations"))
    o.wait_iterations(static_cast<int64_t>(a["wait_iterations"].number()));
  if (a.has("history_depth")) o.history_depth(static_cast<int64_t>(a["history_depth"].number()));
  if (a.has("store_each_nth")) o.store_each_nth(static_cast<int64_t>(a["store_each_nth"].number()));
  if (a.has("frequency")) o.frequency(static_cast<int64_t>(a["frequency"].number()));
  if (a.has("reg_acc")) o.reg_acc(a["reg_acc"].number());
  return o;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const GoldenCase& golden,
                                                        const std::vector<torch::Tensor>& params,
                                                        const RunOptions& run) {
  const JsonValue& j = golden.optimizer;
  const std::string& type = j["type"].string();
  if (type == "Apollo") {
    auto apollo = std::make_unique<optim::Apollo>(
        params, apollo_options(j),
        run.placement ? run.placement : optim::default_placement());
    apollo->set_fused_kernels(run.fused_kernels);
    return apollo;
  }
  if (type == "AADL") {
    return std::make_unique<optim::AADL>(base_optimizer(j, params), aadl_options(j["accelerate"]),
                                         run.placement);
  }
  throw std::runtime_error(golden.path + ": unknown optimizer type '" + type + "'");
}

}  // namespace

std::vector<std::string> golden_files(const std::string& shared_dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(shared_dir) / "golden", ec)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

GoldenCase load_golden(const std::string& path) {
  const JsonValue root = JsonValue::parse_file(path);
  GoldenCase g;
  g.path = path;
  try {
    g.name = root["name"].string();
    g.optimizer = root["optimizer"];
    const JsonValue& p = root["problem"];
    if (p["kind"].string() != "mlp_tanh") {
      throw std::runtime_error("unknown problem kind '" + p["kind"].string() + "'");
    }
    g.closure_protocol = p["step_protocol"].string().rfind("closure", 0) == 0;
    g.X = p["X"].numbers();
    g.Y = p["Y"].numbers();
    g.X_shape = shape_of(p["X_shape"]);
    g.Y_shape = shape_of(p["Y_shape"]);
    for (const auto& s : p["param_shapes"].array()) g.param_shapes.push_back(shape_of(s));
    for (const auto& v : p["init_params"].array()) g.init_params.push_back(v.numbers());
    if (g.param_shapes.size() != 4 || g.init_params.size() != 4) {
      throw std::runtime_error("expected the four parameters W1, b1, W2, b2");
    }
    for (size_t i = 0; i < 4; ++i) {
      if (numel_of(g.param_shapes[i]) != static_cast<int64_t>(g.init_params[i].size())) {
        throw std::runtime_error("init_params[" + std::to_string(i) + "] does not fit its shape");
      }
    }
    if (numel_of(g.X_shape) != static_cast<int64_t>(g.X.size()) ||
        numel_of(g.Y_shape) != static_cast<int64_t>(g.Y.size())) {
      throw std::runtime_error("X or Y does not fit its shape");
    }
    for (const auto& s : root["steps"].array()) {
      GoldenStep step;
      step.loss = s["loss"].number();
      for (const auto& v : s["params"].array()) step.params.push_back(v.numbers());
      if (step.params.size() != 4) throw std::runtime_error("a step without four parameters");
      g.steps.push_back(std::move(step));
    }
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return g;
}

Trajectory run_golden(const GoldenCase& golden, const RunOptions& run) {
  const torch::Tensor X = to_tensor(golden.X, golden.X_shape, run);
  const torch::Tensor Y = to_tensor(golden.Y, golden.Y_shape, run);
  std::vector<torch::Tensor> params;
  for (size_t i = 0; i < golden.init_params.size(); ++i) {
    params.push_back(to_tensor(golden.init_params[i], golden.param_shapes[i], run)
                         .set_requires_grad(true));
  }
  const auto loss_fn = [&] {
    const torch::Tensor hidden = torch::tanh(X.matmul(params[0].t()) + params[1]);
    const torch::Tensor y = hidden.matmul(params[2].t()) + params[3];
    return (y - Y).pow(2).mean();
  };
  std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(golden, params, run);
  const int64_t steps = run.steps > 0 ? run.steps : static_cast<int64_t>(golden.steps.size());

  Trajectory out;
  for (int64_t k = 1; k <= steps; ++k) {
    if (golden.closure_protocol) {
      // The closure zeroes grads and calls backward only with grad mode on: AADL's safeguard
      // calls it again with grad mode off just to evaluate the loss.
      optimizer->step([&] {
        const bool grad = torch::GradMode::is_enabled();
        if (grad) optimizer->zero_grad();
        torch::Tensor loss = loss_fn();
        if (grad) loss.backward();
        return loss;
      });
    } else {
      optimizer->zero_grad();
      loss_fn().backward();
      optimizer->step();
    }
    {
      torch::NoGradGuard no_grad;
      out.losses.push_back(loss_fn().item<double>());
      std::vector<torch::Tensor> snapshot;
      for (const auto& p : params) snapshot.push_back(p.detach().to(torch::kCPU).clone());
      out.params.push_back(std::move(snapshot));
    }
    if (k == run.reload_after) {
      const std::string bytes = archive_bytes(*optimizer);
      optimizer = make_optimizer(golden, params, run);
      load_archive_bytes(*optimizer, bytes);
    }
  }
  return out;
}

Deviation compare(const GoldenCase& golden, const Trajectory& run) {
  Deviation d;
  d.steps = static_cast<int64_t>(std::min(golden.steps.size(), run.params.size()));
  const auto scaled = [](double x, double ref) {
    const double diff = std::abs(x - ref);
    // NaN never passes.
    return std::isnan(diff) ? std::numeric_limits<double>::infinity()
                            : diff / (kGoldenFloor + std::abs(ref));
  };
  for (int64_t k = 0; k < d.steps; ++k) {
    const GoldenStep& ref = golden.steps[static_cast<size_t>(k)];
    double worst = 0.0;
    for (size_t i = 0; i < ref.params.size(); ++i) {
      const torch::Tensor got =
          run.params[static_cast<size_t>(k)][i].to(torch::kFloat64).reshape(-1);
      if (got.numel() != static_cast<int64_t>(ref.params[i].size())) {
        throw std::runtime_error(golden.path + ": parameter size mismatch");
      }
      const auto a = got.accessor<double, 1>();
      for (int64_t e = 0; e < got.numel(); ++e) {
        const double r = ref.params[i][static_cast<size_t>(e)];
        worst = std::max(worst, scaled(a[e], r));
        const double diff = std::abs(a[e] - r);
        d.max_abs = std::isnan(diff) ? std::numeric_limits<double>::infinity()
                                     : std::max(d.max_abs, diff);
      }
    }
    if (worst > d.max_scaled) {
      d.max_scaled = worst;
      d.worst_step = k + 1;
    }
    d.max_loss_scaled =
        std::max(d.max_loss_scaled, scaled(run.losses[static_cast<size_t>(k)], ref.loss));
  }
  return d;
}

Verdict judge(const GoldenCase& golden, const Deviation& d, torch::Dtype dtype) {
  Verdict v;
  const bool all_steps = d.steps == static_cast<int64_t>(golden.steps.size());
  if (dtype == torch::kFloat64) {
    v.measure = "scaled";
    v.measured = std::max(d.max_scaled, d.max_loss_scaled);
    v.bound = kGoldenTolerance;
  } else {
    v.measure = "absolute";
    v.measured = d.max_abs;
    v.bound = golden.name == "aadl_sgd_anderson_closure" ? 1.3e-2 : kFloat32Tolerance;
  }
  v.pass = all_steps && v.measured <= v.bound;
  return v;
}

bool bitwise_equal(const Trajectory& a, const Trajectory& b) {
  if (a.params.size() != b.params.size()) return false;
  for (size_t k = 0; k < a.params.size(); ++k) {
    for (size_t i = 0; i < a.params[k].size(); ++i) {
      if (!torch::equal(a.params[k][i], b.params[k][i])) return false;
    }
  }
  return true;
}

}  // namespace tidepool::testing
