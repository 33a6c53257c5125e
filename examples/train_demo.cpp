// tidepool_train_demo: trains a small MLP on synthetic data (a random "teacher" network, no
// downloads) first with tidepool::optim::Apollo, then with tidepool::optim::AADL around SGD,
// with the optimizer state / Anderson history kept in host memory (HostStagedPlacement) and
// staged onto the compute device around each use. Per step it prints the loss, the memory
// the step's tensors hold on the compute device by role, the bytes the placement moved and
// the rate it moved them at, and tidepool's own per-tag counters.
//
// Runs on the GPU when one is present (cuda), on the host otherwise, and says which.
// Usage: tidepool_train_demo [--steps N] [--device cpu|cuda] [--hidden H]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "allocator/c_api.h"
#include "optimizers/aadl.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"

namespace {

struct Args {
  int steps = 25;
  int hidden = 256;
  std::string device;  // empty: cuda if available
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (std::strcmp(argv[i], "--steps") == 0 && has_value) {
      a.steps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--hidden") == 0 && has_value) {
      a.hidden = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--device") == 0 && has_value) {
      a.device = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--device cpu|cuda] [--hidden H]\n", argv[0]);
      std::exit(2);
    }
  }
  if (a.steps < 1 || a.hidden < 1) {
    std::fprintf(stderr, "--steps and --hidden must be positive\n");
    std::exit(2);
  }
  return a;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

int64_t bytes_of(const std::vector<torch::Tensor>& tensors, bool grads) {
  int64_t total = 0;
  for (const auto& t : tensors) {
    const torch::Tensor& x = grads ? t.grad() : t;
    if (x.defined()) total += static_cast<int64_t>(x.nbytes());
  }
  return total;
}

// tidepool's per-tag counters for the device (allocations that went through tidepool).
std::string tidepool_tags(int device) {
  tidepool_stats_v1 stats{};
  stats.struct_size = sizeof(stats);
  if (tidepool_get_stats_v1(device, &stats) != 0) return "tidepool stats: unavailable";
  char line[256];
  std::snprintf(line, sizeof(line),
                "tidepool tags (MiB, allocations made through tidepool; LibTorch tensors here use "
                "torch's own allocator): parameter %.2f gradient %.2f activation %.2f "
                "optimizer_state %.2f",
                mib(static_cast<int64_t>(stats.tags[TIDEPOOL_TAG_PARAMETER].bytes.current)),
                mib(static_cast<int64_t>(stats.tags[TIDEPOOL_TAG_GRADIENT].bytes.current)),
                mib(static_cast<int64_t>(stats.tags[TIDEPOOL_TAG_ACTIVATION].bytes.current)),
                mib(static_cast<int64_t>(stats.tags[TIDEPOOL_TAG_OPTIMIZER_STATE].bytes.current)));
  return line;
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const bool cuda = args.device.empty() ? torch::cuda::is_available() : args.device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "--device cuda requested but no CUDA device is available\n");
    return 2;
  }
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  std::printf("tidepool_train_demo: running on %s (%s)\n", cuda ? "the GPU" : "the host",
              cuda ? "cuda backend" : "host backend; no GPU found or requested");

  torch::manual_seed(0);
  const int64_t in = 32, out = 8, batch = 512;
  torch::nn::Sequential teacher(torch::nn::Linear(in, 64), torch::nn::Tanh(),
                                torch::nn::Linear(64, out));
  const torch::Tensor X = torch::randn({batch, in}).to(device);
  torch::Tensor Y;
  {
    torch::NoGradGuard no_grad;
    teacher->to(device);
    Y = teacher->forward(X);
  }

  const auto make_model = [&] {
    torch::manual_seed(1);
    torch::nn::Sequential model(torch::nn::Linear(in, args.hidden), torch::nn::Tanh(),
                                torch::nn::Linear(args.hidden, args.hidden), torch::nn::Tanh(),
                                torch::nn::Linear(args.hidden, out));
    model->to(device);
    return model;
  };

  const auto train = [&](const char* label, torch::nn::Sequential& model,
                         torch::optim::Optimizer& optimizer,
                         const tidepool::optim::HostStagedPlacement& placement) {
    const std::vector<torch::Tensor> params = model->parameters();
    std::printf("\n== %s: %lld parameters, state in host memory (%s placement)\n", label,
                static_cast<long long>(bytes_of(params, false) / 4), placement.name().c_str());
    for (int step = 1; step <= args.steps; ++step) {
      const int64_t in_before = placement.traffic().to_device.load();
      const int64_t out_before = placement.traffic().to_host.load();
      const auto start = std::chrono::steady_clock::now();
      const torch::Tensor loss = optimizer.step([&] {
        const bool grad = torch::GradMode::is_enabled();
        if (grad) optimizer.zero_grad();
        torch::Tensor l = torch::mse_loss(model->forward(X), Y);
        if (grad) l.backward();
        return l;
      });
      synchronize(device);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const int64_t moved_in = placement.traffic().to_device.load() - in_before;
      const int64_t moved_out = placement.traffic().to_host.load() - out_before;
      std::printf("%-6s step %3d  loss %.6f  %s MiB: param %.2f grad %.2f  moved in %.2f "
                  "out %.2f MiB  %.2f GB/s over the step (%.1f ms)\n",
                  label, step, loss.item<double>(), cuda ? "device" : "host",
                  mib(bytes_of(params, false)), mib(bytes_of(params, true)), mib(moved_in),
                  mib(moved_out), static_cast<double>(moved_in + moved_out) / seconds / 1e9,
                  seconds * 1e3);
    }
    std::printf("%s\n", tidepool_tags(0).c_str());
  };

  {
    auto model = make_model();
    auto placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
    tidepool::optim::Apollo apollo(model->parameters(),
                                   tidepool::optim::ApolloOptions(0.01).warmup(10), placement);
    train("apollo", model, apollo, *placement);
  }
  {
    auto model = make_model();
    auto placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
    auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(),
                                                   torch::optim::SGDOptions(0.1));
    tidepool::optim::AADL aadl(sgd, tidepool::optim::AADLOptions().relaxation(0.5).history_depth(5),
                               placement);
    train("aadl", model, aadl, *placement);
    std::printf("aadl: %lld accelerated iterates kept, %lld rejected by the safeguard\n",
                static_cast<long long>(aadl.accepted()), static_cast<long long>(aadl.rejected()));
  }
  return 0;
}
