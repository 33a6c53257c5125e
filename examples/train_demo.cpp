// tidepool_train_demo: trains a small MLP on synthetic data (a random "teacher" network, no
// downloads) first with tidepool::optim::Apollo, then with tidepool::optim::AADL around SGD,
// with Apollo's state and AADL's Anderson history in tidepool's tiered store: kept in host
// memory, brought onto the compute device around each use under a device budget smaller
// than the state, the device buffers taken from tidepool's caching allocator under their
// own tags (optimizer_state, aadl_history).
//
// Per step it prints the loss, the device memory per tag (tidepool's per-tag counters for
// the tiered state; LibTorch's own tensors for parameters and gradients), the most device
// memory the tiered state held during the step, the bytes moved each way and the rate the
// copy engine achieved while moving them.
//
// Runs on the GPU when one is present (cuda backend), on the host backend otherwise (the
// "device" is then host memory standing in for it), and says which.
// Usage: tidepool_train_demo [--steps N] [--device cpu|cuda] [--hidden H]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "optimizers/aadl.h"
#include "optimizers/anderson_history.h"
#include "optimizers/apollo.h"
#include "optimizers/tiered_placement.h"
#include "tiering/pinned_budget.h"
#include "tiering/tiered_store.h"

namespace {

struct Args {
  int steps = 12;
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
  if (!a.device.empty() && a.device != "cpu" && a.device != "cuda") {
    std::fprintf(stderr, "--device must be cpu or cuda, got '%s'\n", a.device.c_str());
    std::exit(2);
  }
  return a;
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

int64_t bytes_of(const std::vector<torch::Tensor>& tensors, bool grads) {
  int64_t total = 0;
  for (const auto& t : tensors) {
    const torch::Tensor& x = grads ? t.grad() : t;
    if (x.defined()) total += static_cast<int64_t>(x.nbytes());
  }
  return total;
}

// tidepool's counters for one tag on device 0: bytes held now and the peak since the
// last reset.
std::pair<double, double> tag_mib(int tag) {
  tidepool_stats_v1 stats{};
  stats.struct_size = sizeof(stats);
  if (tidepool_get_stats_v1(0, &stats) != 0) return {0.0, 0.0};
  const auto& s = stats.tags[tag].bytes;
  return {mib(static_cast<double>(s.current)), mib(static_cast<double>(s.peak))};
}

// What tidepool's caching allocator holds on device 0 at the end: reserved, live and cached
// memory, and whose the cache is (the tags it is kept under, Note [Cached memory by tag]).
void print_allocator_report() {
  tidepool_stats_v1 s{};
  s.struct_size = sizeof(s);
  if (tidepool_get_stats_v1(0, &s) != 0) return;
  std::printf("\nallocator (device 0, %s backend): reserved %.2f MiB (peak %.2f), allocated "
              "%.2f MiB (peak %.2f), cached %.2f MiB (largest free block %.2f MiB, "
              "fragmentation %.2f); cached by tag:",
              s.backend == 1 ? "cuda" : "host", mib(static_cast<double>(s.reserved.current)),
              mib(static_cast<double>(s.reserved.peak)),
              mib(static_cast<double>(s.allocated.current)),
              mib(static_cast<double>(s.allocated.peak)), mib(static_cast<double>(s.cached_bytes)),
              mib(static_cast<double>(s.largest_free_block)), s.fragmentation);
  bool any = false;
  for (int t = 0; t < TIDEPOOL_TAG_MAX; ++t) {
    if (s.tag_cache[t].cached_bytes == 0) continue;
    std::printf("%s %s %.2f MiB", any ? "," : "", tidepool_tag_name(t),
                mib(static_cast<double>(s.tag_cache[t].cached_bytes)));
    any = true;
  }
  std::printf("%s\n", any ? "" : " nothing cached");
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// One tiered store over tidepool's allocator for device 0, its buffers tagged `tag`.
std::shared_ptr<tidepool::TieredStore> make_store(std::size_t budget, int tag) {
  tidepool::CachingAllocator& allocator = tidepool::device_allocator(0);
  tidepool::TieredStoreOptions options;
  options.device_budget_bytes = budget;
  return std::make_shared<tidepool::TieredStore>(
      allocator.backend(), options, tidepool::caching_allocator_source(allocator, tag));
}

// Bytes moved each way, and for the rate while copying the bytes whose copy time is in
// busy_ms (Note [Rates from timed bytes] in tiering/copy_engine.h).
struct Traffic {
  std::uint64_t h2d = 0, d2h = 0, timed = 0;
  double busy_ms = 0;
};

Traffic traffic(tidepool::TieredStore& store) {
  const auto s = store.stats();
  return {s.copy.h2d.bytes, s.copy.d2h.bytes, s.copy.h2d.timed_bytes + s.copy.d2h.timed_bytes,
          s.copy.h2d.busy_ms + s.copy.d2h.busy_ms};
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool cuda = args.device.empty() ? torch::cuda::is_available() : args.device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "--device cuda requested but no CUDA device is available\n");
    return 2;
  }
  // LibTorch seeing a GPU does not mean tidepool can use it: a tidepool built where nvcc
  // was missing has no cuda backend (scripts/setup goes on without one), and the first
  // tiered store would throw out of main. Asked before anything is built on a backend.
  std::string no_cuda_backend;
  if (cuda) {
    try {
      (void)tidepool::make_cuda_backend(0);
    } catch (const tidepool::BackendError& e) {
      no_cuda_backend = e.what();
    }
  }
  if (!no_cuda_backend.empty()) {
    if (!args.device.empty()) {
      std::fprintf(stderr, "--device cuda requested, but tidepool cannot use the GPU: %s\n",
                   no_cuda_backend.c_str());
      return 2;
    }
    cuda = false;
  }
  // The tiered store's backend must match where LibTorch computes (tiered_placement.h).
  if (tidepool_set_backend(cuda ? "cuda" : "host") != 0) {
    std::fprintf(stderr, "cannot select the %s backend: %s\n", cuda ? "cuda" : "host",
                 tidepool_last_error());
    return 1;
  }
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  // On the host backend the "device" copies run on the backend's stream threads, and
  // LibTorch's OpenMP workers spin-wait between ops: on a small machine they starve the
  // copies (a 24x slower run measured on 2 cores). One compute thread; the model is small.
  if (!cuda) torch::set_num_threads(1);
  std::string backend = "cuda backend";
  if (!cuda) {
    backend = no_cuda_backend.empty()
                  ? "host backend; no GPU found or requested"
                  : "host backend; a GPU is present but tidepool cannot use it: " +
                        no_cuda_backend +
                        "; rebuild tidepool with the CUDA toolkit (nvcc) for the GPU";
  }
  std::printf("tidepool_train_demo: running on %s (%s)\n", cuda ? "the GPU" : "the host",
              backend.c_str());

  torch::manual_seed(0);
  const int64_t in = 32, out = 8, batch = 512, hidden_layers = 4;
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
    torch::nn::Sequential model(torch::nn::Linear(in, args.hidden), torch::nn::Tanh());
    for (int64_t l = 0; l < hidden_layers; ++l) {
      model->push_back(torch::nn::Linear(args.hidden, args.hidden));
      model->push_back(torch::nn::Tanh());
    }
    model->push_back(torch::nn::Linear(args.hidden, out));
    model->to(device);
    return model;
  };

  const auto train = [&](const char* label, torch::nn::Sequential& model,
                         torch::optim::Optimizer& optimizer,
                         tidepool::optim::TieredPlacement& placement, int tag) {
    const std::vector<torch::Tensor> params = model->parameters();
    tidepool::TieredStore& store = placement.store();
    for (int step = 1; step <= args.steps; ++step) {
      const Traffic before = traffic(store);
      placement.reset_peak_device_bytes();
      const auto start = std::chrono::steady_clock::now();
      const torch::Tensor loss = optimizer.step([&] {
        const bool grad = torch::GradMode::is_enabled();
        if (grad) optimizer.zero_grad();
        torch::Tensor l = torch::mse_loss(model->forward(X), Y);
        if (grad) l.backward();
        return l;
      });
      synchronize(device);
      store.synchronize();  // the step's write-backs are part of its traffic
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const Traffic after = traffic(store);
      const double moved = static_cast<double>((after.h2d - before.h2d) + (after.d2h - before.d2h));
      const double busy_ms = after.busy_ms - before.busy_ms;
      const double timed = static_cast<double>(after.timed - before.timed);
      const auto [tag_now, tag_peak] = tag_mib(tag);
      std::printf("%-6s step %3d  loss %.6f  device MiB: parameter %.2f gradient %.2f %s %.2f "
                  "(peak %.2f, tiered peak this step %.2f of budget %.2f)  moved in %.2f out %.2f "
                  "MiB  %.2f GB/s while copying, %.2f GB/s over the step (%.1f ms)\n",
                  label, step, loss.item<double>(),
                  mib(static_cast<double>(bytes_of(params, false))),
                  mib(static_cast<double>(bytes_of(params, true))), tidepool_tag_name(tag), tag_now,
                  tag_peak, mib(static_cast<double>(placement.peak_device_bytes())),
                  mib(static_cast<double>(store.device_budget_bytes())),
                  mib(static_cast<double>(after.h2d - before.h2d)),
                  mib(static_cast<double>(after.d2h - before.d2h)),
                  busy_ms > 0 ? timed / (busy_ms * 1e6) : 0.0, moved / seconds / 1e9,
                  seconds * 1e3);
    }
    const auto s = store.stats();
    // acquire wait: host time the optimizer spent blocked in acquires (what loading ahead
    // of use hides; tiered_placement.h).
    std::printf("%s: tiered store: %llu acquires, %llu prefetch hits (%llu late), %llu misses, "
                "acquire wait %.1f ms, %llu evictions, device peak %.2f MiB of %.2f MiB budget\n",
                label, static_cast<unsigned long long>(s.acquires),
                static_cast<unsigned long long>(s.prefetch_hits),
                static_cast<unsigned long long>(s.prefetch_late),
                static_cast<unsigned long long>(s.misses), placement.acquire_wait_seconds() * 1e3,
                static_cast<unsigned long long>(s.evictions),
                mib(static_cast<double>(s.device_peak_bytes)),
                mib(static_cast<double>(s.device_budget_bytes)));
    // Where the state lives off the device: pinned (copied at the link's rate, overlapped)
    // or pageable (the fallback when the pinned budget is spent; slower, synchronous).
    std::printf("%s: host memory: %.2f MiB pinned, %.2f MiB pageable; the process pins "
                "%.2f MiB of its %.2f MiB pinned budget (tidepool.pinned_budget)\n",
                label, mib(static_cast<double>(s.host.pinned_in_use_bytes)),
                mib(static_cast<double>(s.host.pageable_in_use_bytes)),
                mib(static_cast<double>(tidepool::process_pinned_bytes())),
                mib(static_cast<double>(tidepool::process_pinned_budget().bytes)));
  };

  // Both stores live until the end of main: the caching allocator keeps the blocks a
  // store gave back associated with the store's copy streams, which die with the store.
  std::shared_ptr<tidepool::TieredStore> apollo_store, history_store;
  {
    auto model = make_model();
    const auto params = model->parameters();
    int64_t largest = 0;
    for (const auto& p : params)
      largest = std::max<int64_t>(largest, static_cast<int64_t>(p.nbytes()));
    const int64_t state_bytes = 3 * bytes_of(params, false);
    // Room for the parameter being computed and two more (m, B, d each): well below the
    // whole state, so the step streams it.
    const auto budget = static_cast<std::size_t>(3 * 3 * largest);
    apollo_store = make_store(budget, TIDEPOOL_TAG_OPTIMIZER_STATE);
    auto placement = std::make_shared<tidepool::optim::TieredPlacement>(apollo_store);
    tidepool::optim::Apollo apollo(params, tidepool::optim::ApolloOptions(0.01).warmup(10),
                                   placement);
    std::printf("\n== apollo: %lld parameters, state %.2f MiB in the tiered store, device budget "
                "%.2f MiB\n",
                static_cast<long long>(bytes_of(params, false) / 4),
                mib(static_cast<double>(state_bytes)), mib(static_cast<double>(budget)));
    train("apollo", model, apollo, *placement, TIDEPOOL_TAG_OPTIMIZER_STATE);
  }
  {
    auto model = make_model();
    const auto params = model->parameters();
    const int64_t depth = 5;
    const int64_t vector_bytes = bytes_of(params, false);
    const int64_t chunk_bytes =
        std::min<int64_t>(vector_bytes, tidepool::optim::AndersonHistory::kStoreChunk * 4);
    // A pass holds chunk c of every vector and prefetches chunk c+1.
    const auto budget = static_cast<std::size_t>(2 * depth * chunk_bytes);
    const int tag = tidepool_tag_id("aadl_history");
    history_store = make_store(budget, tag);
    // The history is only read between writes: written back (dropped: it is clean) after
    // each pass, so between passes it lives in host memory only.
    auto placement = std::make_shared<tidepool::optim::TieredPlacement>(
        history_store, tidepool::Stream{}, tag, tidepool::optim::WriteBack::on_release);
    auto sgd = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
    tidepool::optim::AADL aadl(
        sgd, tidepool::optim::AADLOptions().relaxation(0.5).history_depth(depth), placement);
    std::printf("\n== aadl (SGD inside): %lld parameters, history of %lld vectors (%.2f MiB) in "
                "the tiered store, device budget %.2f MiB\n",
                static_cast<long long>(vector_bytes / 4), static_cast<long long>(depth),
                mib(static_cast<double>(depth * vector_bytes)), mib(static_cast<double>(budget)));
    train("aadl", model, aadl, *placement, tag);
    std::printf("aadl: %lld accelerated iterates kept, %lld rejected by the safeguard\n",
                static_cast<long long>(aadl.accepted()), static_cast<long long>(aadl.rejected()));
  }
  print_allocator_report();
  return 0;
}
