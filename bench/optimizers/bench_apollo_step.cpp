// Apollo step throughput. Baseline in the same run: the reference's sequence of LibTorch
// ops written out plainly (no tidepool), with its state resident in plain tensors. Compared:
// tidepool's Apollo (the fused step; with resident state the ops path too) with resident
// state, with host-staged state and with state in the tiered store (host backend on the CPU, cuda
// backend over tidepool's caching allocator on the GPU), and on CUDA the seeds' approach
// (state in pageable CPU tensors, .to() per parameter) and pinned host state copied over
// and back per parameter with non-blocking copies on the compute stream, no overlap
// (issue 5's two comparisons for the tiered step). On the GPU the same run also
// measures the link: pinned copies in both directions at once (the tiered step's floor is
// 24 B/param at that rate). Sizes: 2^16 … 2^22 parameters on the CPU; 2^28 parameters in
// mixed tensor sizes on the GPU (skipped when no CUDA device is present). Every tidepool
// case takes one step before timing, reported as first_step_ms: it creates the state
// (and, tiered, records the prefetch schedule; fused, it has no carried sums yet), which
// the timed steps, the steady state a training run sees, must not average in. Counters:
// parameters per second, bytes/param moved where state crosses the link, and for tiered
// state staging_MiB, the most device memory the store held during the timed steps, and
// the store's per-step counters (bench_common.h: tiered_step_counters), its host memory
// pinned (Note [Benchmark stores are pinned] there). The fused
// step with resident state on the GPU also reports floor_ratio against its HBM floor: the
// 36 B/param (fp32) the update must read and write (θ, g, m, B, d in; θ, m, B, d out) at
// the rate of a plain device-to-device copy measured in the same run (hbm_GB/s, read +
// write). Its steady state moves 44 B/param (Note [carried sums] in
// optimizers/apollo_step_math.h), so 1.22× is the least it can show. The host-staged and
// tiered cases on the GPU report floor_ratio against their link floor: 24 B/param (m, B,
// d in and out) at the rate of pinned copies both ways at once, measured right before
// their steps (link_GB/s; BM_Gpu_PinnedBidirectional measures the same on its own). On
// the CPU, the
// fused host step and the ops path (Resident vs Resident_Ops) compare in the same run.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "bench/optimizers/bench_common.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::bench_optim::layer_sizes;
using tidepool::bench_optim::mixed_sizes;
using tidepool::bench_optim::sync;
using tidepool::bench_optim::want_cuda;

// Note [Two shapes for the tiered step]
// The parameters' sizes: mixed_sizes (one tensor of half the parameters, one of a
// quarter, ...) or layer_sizes (32 alike). Over a modelled link without a GPU
// (tidepool_bench_modeled_link, the store's step as Apollo makes it, a parameter's three
// handles at a time), the halving shape under this benchmark's budget of two thirds of
// the state comes to 1.19x its link floor when the device is waited for after every
// step, and to 1.12x with 4 steps per wait; the layers to 1.01x either way. Loading the
// first parameter's state, half of it, is a fill nothing overlaps unless the previous
// step's write-backs are still draining (Note [Isolated and steady steps] in
// bench/tiering/store_steps.h). The tiered step is timed in both shapes, both ways.
enum class Shape { mixed, layers };

struct Problem {
  std::vector<torch::Tensor> params;
  Problem(int64_t total, torch::Device device, Shape shape = Shape::mixed) {
    torch::manual_seed(0);
    for (int64_t n : shape == Shape::mixed ? mixed_sizes(total) : layer_sizes(total)) {
      auto p = torch::randn({n}, torch::TensorOptions().device(device)).set_requires_grad(true);
      p.mutable_grad() = torch::randn_like(p) * 1e-2;
      params.push_back(p);
    }
  }
};

// The reference step (constant rebound, L2 decay 0), state in plain tensors on `location`.
struct ReferenceState {
  torch::Tensor m, B, d;
  int64_t step = 0;
};

void reference_step(torch::Tensor& p, ReferenceState& s, double lr) {
  torch::NoGradGuard no_grad;
  const double beta = 0.9, eps = 1e-4 / 0.01;
  s.step += 1;
  const double alpha = (1 - beta) / (1 - std::pow(beta, static_cast<double>(s.step)));
  torch::Tensor delta_grad = p.grad() - s.m;
  s.m.add_(delta_grad, alpha);
  const torch::Tensor denom = torch::linalg_vector_norm(s.d, 4).add(eps);
  s.d.div_(denom);
  const torch::Tensor v_sq = s.d.mul(s.d);
  const torch::Tensor delta =
      delta_grad.div_(denom).mul_(s.d).sum().mul(-alpha) - s.B.mul(v_sq).sum();
  s.B.addcmul_(v_sq, delta);
  s.d.copy_(s.m.div(s.B.abs().clamp_(0.01)));
  p.add_(s.d, -lr);
}

// Where the reference keeps its state between steps: on the device (resident), or in host
// tensors brought over and back per parameter, pageable with .to() (the seeds' approach)
// or pinned with non-blocking copies on the compute stream (so no copy overlaps compute).
enum class ReferenceStateAt { device, pageable_host, pinned_host };

void run_reference(benchmark::State& state, torch::Device device, ReferenceStateAt at) {
  Problem problem(state.range(0), device);
  std::vector<ReferenceState> states;
  const bool round_trip = at != ReferenceStateAt::device;
  const auto where = round_trip ? torch::Device(torch::kCPU) : device;
  const bool pinned = at == ReferenceStateAt::pinned_host;
  for (const auto& p : problem.params) {
    const auto opts = p.options().device(where).pinned_memory(pinned);
    states.push_back({torch::zeros(p.sizes(), opts), torch::zeros(p.sizes(), opts),
                      torch::zeros(p.sizes(), opts)});
  }
  const auto one_step = [&] {
    for (size_t i = 0; i < problem.params.size(); ++i) {
      if (!round_trip) {
        reference_step(problem.params[i], states[i], 1e-3);
        continue;
      }
      ReferenceState& host = states[i];
      ReferenceState on_device{host.m.to(device, pinned), host.B.to(device, pinned),
                               host.d.to(device, pinned), host.step};
      reference_step(problem.params[i], on_device, 1e-3);
      if (pinned) {
        // Back into the same pinned tensors, ordered on the compute stream after the step.
        host.m.copy_(on_device.m, true);
        host.B.copy_(on_device.B, true);
        host.d.copy_(on_device.d, true);
        host.step = on_device.step;
      } else {
        // The seeds' approach: .to() both ways, the state replaced by the copies.
        host = {on_device.m.to(torch::kCPU), on_device.B.to(torch::kCPU),
                on_device.d.to(torch::kCPU), on_device.step};
      }
    }
    sync(device);
  };
  // Untimed, as every tidepool case takes one: first-use costs (kernel loading, the
  // caching allocator's first segments, pinning) are not the step's.
  one_step();
  for (auto _ : state) one_step();
  state.counters["params/s"] = benchmark::Counter(
      static_cast<double>(state.range(0)), benchmark::Counter::kIsIterationInvariantRate);
}

enum class Where { resident, host_staged, tiered };

// Bytes per second read plus written by a plain copy between two 1 GiB device buffers:
// the rate at which the HBM floor of a step is counted.
double device_copy_rate(const torch::Device& device) {
  const int64_t elements = int64_t{1} << 28;
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  torch::Tensor from = torch::ones({elements}, opts);
  torch::Tensor to = torch::empty({elements}, opts);
  to.copy_(from);
  sync(device);
  constexpr int kCopies = 10;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCopies; ++i) to.copy_(from);
  sync(device);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 2.0 * static_cast<double>(from.nbytes()) * kCopies / seconds;
}

// fp32 bytes per parameter the fused update cannot avoid: θ, g, m, B, d read, θ, m, B, d
// written.
constexpr double kUpdateFloorBytesPerParam = 36.0;
// fp32 bytes per parameter that state kept in host memory moves over the link per step:
// m, B, d to the device and back.
constexpr double kLinkFloorBytesPerParam = 24.0;

// steps_per_sync: steps run back to back before the device is waited for (Note [Isolated
// and steady steps] in bench/tiering/store_steps.h). The counters and the Time column are
// per step: a row of several steps per sync is registered with UseManualTime, and each
// iteration's time is set to its wall time over its steps.
void run_tidepool(benchmark::State& state, torch::Device device, Where where, bool fused,
                  Shape shape = Shape::mixed, int steps_per_sync = 1) {
  Problem problem(state.range(0), device, shape);
  // Declared first so it is destroyed last: the store (kept alive by the placement) uses it.
  std::unique_ptr<tidepool::bench_optim::BenchStore> bench_store;
  std::shared_ptr<tidepool::TieredStore> store;
  std::shared_ptr<tidepool::optim::StatePlacement> placement;
  std::shared_ptr<tidepool::optim::HostStagedPlacement> staged;
  std::shared_ptr<tidepool::optim::TieredPlacement> tiered;
  if (where == Where::tiered) {
    // Budget: two thirds of the state (8 of 12 B/param), so the step streams it; it must
    // hold the three states of the largest tensor (half the parameters) at once: 6 B/param.
    const auto params = static_cast<std::size_t>(state.range(0));
    const auto elements = static_cast<std::size_t>(torch::elementSize(torch::kFloat32));
    const tidepool::TieredStoreOptions options =
        tidepool::bench_optim::pinned_store_options(params * 8, 3 * elements * params);
    bench_store = std::make_unique<tidepool::bench_optim::BenchStore>(device, options);
    store = bench_store->store;
    tiered = std::make_shared<tidepool::optim::TieredPlacement>(store);
    placement = tiered;
  } else if (where == Where::host_staged) {
    staged = std::make_shared<tidepool::optim::HostStagedPlacement>();
    placement = staged;
  } else {
    placement = std::make_shared<tidepool::optim::ResidentPlacement>();
  }
  tidepool::optim::Apollo apollo(problem.params,
                                 tidepool::optim::ApolloOptions(1e-3).warmup(0), placement);
  apollo.set_fused_kernels(fused);
  // The link first: measure_link empties PyTorch's caches, which after the first step
  // would give back the staging buffers a host-staged step then allocates again.
  const bool over_link = device.is_cuda() && where != Where::resident;
  const double link_both =
      over_link ? tidepool::bench_optim::measure_link(device.index()).both : 0.0;
  // The first step: see the top of this file.
  const auto first_start = std::chrono::steady_clock::now();
  apollo.step();
  sync(device);
  const double first_step_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - first_start).count();
  const int64_t to_device_before = staged ? staged->traffic().to_device.load() : 0;
  const int64_t to_host_before = staged ? staged->traffic().to_host.load() : 0;
  tidepool::TieredStoreStats store_before;
  if (tiered) {
    store->synchronize();
    store_before = store->stats();
    tiered->reset_peak_device_bytes();
  }
  const double acquire_wait_before = tiered ? tiered->acquire_wait_seconds() : 0.0;
  double elapsed_s = 0.0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < steps_per_sync; ++k) apollo.step();
    sync(device);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    elapsed_s += seconds;
    state.SetIterationTime(seconds / steps_per_sync);  // read only by UseManualTime rows
  }
  const auto steps = static_cast<double>(state.iterations()) * steps_per_sync;
  // Per step: steps_per_sync > 1 only in UseManualTime rows, whose time is per step.
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(state.range(0)),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["first_step_ms"] = first_step_s * 1e3;
  state.counters["steps_per_sync"] = steps_per_sync;
  if (device.is_cuda() && where == Where::resident && fused) {
    const double rate = device_copy_rate(device);
    const double floor_s = kUpdateFloorBytesPerParam * static_cast<double>(state.range(0)) / rate;
    state.counters["hbm_GB/s"] = rate * 1e-9;
    state.counters["floor_ms"] = floor_s * 1e3;
    state.counters["floor_ratio"] = elapsed_s / steps / floor_s;
  }
  if (over_link && link_both > 0) {
    const double floor_s = kLinkFloorBytesPerParam * static_cast<double>(state.range(0)) /
                           link_both;
    state.counters["link_GB/s"] = link_both * 1e-9;
    state.counters["floor_ms"] = floor_s * 1e3;
    state.counters["floor_ratio"] = elapsed_s / steps / floor_s;
  }
  if (staged) {
    const double moved = static_cast<double>(staged->traffic().to_device.load() -
                                             to_device_before +
                                             staged->traffic().to_host.load() - to_host_before);
    state.counters["B/param"] = moved / steps / static_cast<double>(state.range(0));
  }
  if (tiered) {
    store->synchronize();
    tidepool::bench_optim::tiered_step_counters(state, store_before, store->stats(), steps,
                                                static_cast<double>(state.range(0)));
    state.counters["staging_MiB"] =
        static_cast<double>(tiered->peak_device_bytes()) / (1024.0 * 1024.0);
    // Host time inside acquire per step (on CUDA only a wait for room shows here).
    state.counters["acquire_wait_ms"] =
        (tiered->acquire_wait_seconds() - acquire_wait_before) * 1e3 / steps;
  }
}

// The link's rate with pinned host memory, both directions at once on two streams of the
// backend: the floor of a tiered step is 24 B/param at this rate.
void run_pinned_bidirectional(benchmark::State& state, int device) {
  tidepool::bench_optim::LinkCopies link(device, state.range(0));
  for (auto _ : state) link.copy(true, true);
  state.counters["GB/s"] = benchmark::Counter(2.0 * static_cast<double>(link.bytes()),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// ---- CPU ----------------------------------------------------------------------------------

void BM_Cpu_Reference(benchmark::State& s) {
  run_reference(s, torch::kCPU, ReferenceStateAt::device);
}
void BM_Cpu_Apollo_Resident(benchmark::State& s) {
  run_tidepool(s, torch::kCPU, Where::resident, true);
}
void BM_Cpu_Apollo_Resident_Ops(benchmark::State& s) {
  run_tidepool(s, torch::kCPU, Where::resident, false);
}
void BM_Cpu_Apollo_HostStaged(benchmark::State& s) {
  run_tidepool(s, torch::kCPU, Where::host_staged, true);
}
void BM_Cpu_Apollo_Tiered(benchmark::State& s) {
  run_tidepool(s, torch::kCPU, Where::tiered, true);
}


BENCHMARK(BM_Cpu_Reference)
    ->RangeMultiplier(4)->Range(1 << 16, 1 << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Cpu_Apollo_Resident)
    ->RangeMultiplier(4)->Range(1 << 16, 1 << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Cpu_Apollo_Resident_Ops)
    ->RangeMultiplier(4)->Range(1 << 16, 1 << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Cpu_Apollo_HostStaged)
    ->RangeMultiplier(4)->Range(1 << 16, 1 << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Cpu_Apollo_Tiered)
    ->RangeMultiplier(4)->Range(1 << 16, 1 << 22)->Unit(benchmark::kMillisecond);

// ---- GPU (2^28 parameters; skipped without CUDA) -------------------------------------------

void BM_Gpu_Reference(benchmark::State& s) {
  if (want_cuda(s)) run_reference(s, torch::Device(torch::kCUDA, 0), ReferenceStateAt::device);
}
void BM_Gpu_SeedsPageableTo(benchmark::State& s) {
  if (want_cuda(s))
    run_reference(s, torch::Device(torch::kCUDA, 0), ReferenceStateAt::pageable_host);
}
void BM_Gpu_PinnedNoOverlap(benchmark::State& s) {
  if (want_cuda(s)) run_reference(s, torch::Device(torch::kCUDA, 0), ReferenceStateAt::pinned_host);
}
void BM_Gpu_Apollo_Fused_Resident(benchmark::State& s) {
  if (want_cuda(s)) run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::resident, true);
}
void BM_Gpu_Apollo_Ops_Resident(benchmark::State& s) {
  if (want_cuda(s)) run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::resident, false);
}
void BM_Gpu_Apollo_Fused_HostStaged(benchmark::State& s) {
  if (want_cuda(s)) run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::host_staged, true);
}
void BM_Gpu_Apollo_Fused_Tiered(benchmark::State& s) {
  if (want_cuda(s)) run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::tiered, true);
}
// The same over 32 tensors alike (a transformer's layers), where the pipeline is not held
// up by one tensor of half the parameters (Note [Two shapes for the tiered step]).
void BM_Gpu_Apollo_Fused_Tiered_Layers(benchmark::State& s) {
  if (want_cuda(s)) {
    run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::tiered, true, Shape::layers);
  }
}
// Both shapes again, kSteadySteps steps per wait for the device, as a training loop runs
// them: one step's last write-backs beside the next step's first loads (Note [Isolated
// and steady steps] in bench/tiering/store_steps.h).
constexpr int kSteadySteps = 4;
void BM_Gpu_Apollo_Fused_Tiered_Steady(benchmark::State& s) {
  if (want_cuda(s)) {
    run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::tiered, true, Shape::mixed,
                 kSteadySteps);
  }
}
void BM_Gpu_Apollo_Fused_Tiered_Layers_Steady(benchmark::State& s) {
  if (want_cuda(s)) {
    run_tidepool(s, torch::Device(torch::kCUDA, 0), Where::tiered, true, Shape::layers,
                 kSteadySteps);
  }
}
void BM_Gpu_PinnedBidirectional(benchmark::State& s) {
  if (want_cuda(s)) run_pinned_bidirectional(s, 0);
}

constexpr int64_t kGpuParams = int64_t{1} << 28;
// Real time: the rate counters (params/s, GB/s) are divided by it, not by the CPU time of
// a thread that sleeps in its device synchronizations.
BENCHMARK(BM_Gpu_Reference)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
// One iteration: about 3 s each, of the 60 s device-check gives this binary.
BENCHMARK(BM_Gpu_SeedsPageableTo)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(1)->UseRealTime();
BENCHMARK(BM_Gpu_PinnedNoOverlap)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_Gpu_Apollo_Fused_Resident)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_Gpu_Apollo_Ops_Resident)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_Gpu_Apollo_Fused_HostStaged)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_Gpu_Apollo_Fused_Tiered)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(4)->UseRealTime();
BENCHMARK(BM_Gpu_Apollo_Fused_Tiered_Layers)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(4)->UseRealTime();
BENCHMARK(BM_Gpu_PinnedBidirectional)
    ->Arg(int64_t{1} << 30)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
// Last: device-check's time cap for this binary cuts the run from the end.
BENCHMARK(BM_Gpu_Apollo_Fused_Tiered_Steady)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(2)->UseManualTime();
BENCHMARK(BM_Gpu_Apollo_Fused_Tiered_Layers_Steady)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(2)->UseManualTime();

}  // namespace

BENCHMARK_MAIN();
