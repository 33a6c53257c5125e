// AADL acceleration step throughput (issue: "AADL acceleration step, history_depth 5 in
// host memory, 2^28 parameters: <= 1.3x the floor of moving what must cross the link").
//
// One parameter group of mixed tensor sizes, SGD inside AADL (history_depth 5, every step
// accelerates once the history holds three vectors); the history is filled before the
// timed steps, so each timed step pushes into a full ring: the inner SGD step, the pass
// that adds one Gram column, the fp64 solve on the host, and the extrapolation pass.
//
// Where the history lives: resident on the compute device (the arithmetic alone, the
// comparison that shows what the link costs), host-staged (pinned host memory, AADL's
// default for CUDA parameters) and the tiered store (budget: two stored chunks per vector,
// so every pass streams the history over the link).
//
// The floor, on the GPU, measured in the same run (the link's pinned H2D, D2H and
// both-ways rates, timed right before the benchmark's steps): with the history in host
// memory a full step must bring the m − 1 older vectors to the device twice (the Gram
// column pass and the extrapolation each read them; the newest vector is on the device)
// and send the new vector to the host once: H2D 2(m − 1)·4N bytes, D2H 4N bytes. Floor
// time = the largest of H2D/h2d_rate, D2H/d2h_rate and (H2D + D2H)/both_rate. Counters:
// floor_ms, floor_ratio (step time ÷ floor), and B/param actually moved per step. The
// tiered store's host memory is pinned (Note [Benchmark stores are pinned] in
// bench_common.h) and it reports its per-step counters (tiered_step_counters there), with
// chunks_stored (stored chunks per step), chunks_created (of those, the ones stored in
// new buffers: 0 after the first push into a full ring, an untimed step, since each new
// vector is written over the buffers of one the ring dropped, Note [Reusing dropped
// columns] in anderson_history.h; host_allocs, the store's host blocks per step, is 0
// then too) and through_host (of the stored chunks, the ones that went through host
// memory: on CUDA those the store had no device room for, Note [Creating on the device]
// in tiered_placement.cpp; on the CPU all of them, by design). Writing over a buffer the
// store has written back loads nothing (TieredStore::acquire_to_overwrite, Note
// [Overwriting on the device] there): loads_skipped per step, one per such chunk.
// On the CPU there is no link: the counters are params/s, and the resident and tiered
// (host backend) placements compare the store's overhead.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "bench/optimizers/bench_common.h"
#include "optimizers/aadl.h"
#include "optimizers/anderson_history.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "tiering/tiered_store.h"

namespace {

constexpr int64_t kDepth = 5;

using tidepool::bench_optim::LinkRates;
using tidepool::bench_optim::measure_link;
using tidepool::bench_optim::mixed_sizes;
using tidepool::bench_optim::sync;
using tidepool::bench_optim::want_cuda;

enum class Where { resident, host_staged, tiered };

void run_aadl(benchmark::State& state, torch::Device device, Where where) {
  const int64_t n = state.range(0);
  torch::manual_seed(0);
  std::vector<torch::Tensor> params;
  for (int64_t size : mixed_sizes(n)) {
    auto p = torch::randn({size}, torch::TensorOptions().device(device)).set_requires_grad(true);
    p.mutable_grad() = torch::randn_like(p) * 1e-2;
    params.push_back(p);
  }
  // Declared first so it is destroyed last: the store (kept alive by the placement) uses it.
  std::unique_ptr<tidepool::bench_optim::BenchStore> bench_store;
  std::shared_ptr<tidepool::TieredStore> store;
  std::shared_ptr<tidepool::optim::StatePlacement> placement;
  std::shared_ptr<tidepool::optim::HostStagedPlacement> staged;
  std::shared_ptr<tidepool::optim::TieredPlacement> tiered;
  if (where == Where::tiered) {
    // Host memory for the whole history (and the vector on its way in) pinned: Note
    // [Benchmark stores are pinned] in bench_common.h.
    const tidepool::TieredStoreOptions options = tidepool::bench_optim::pinned_store_options(
        static_cast<std::size_t>(2 * kDepth) * tidepool::optim::AndersonHistory::kStoreChunk *
            sizeof(float),
        static_cast<std::size_t>(kDepth + 1) * sizeof(float) * static_cast<std::size_t>(n));
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
  auto sgd = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-4));
  tidepool::optim::AADL aadl(
      sgd, tidepool::optim::AADLOptions().history_depth(kDepth).relaxation(0.5).wait_iterations(0),
      placement);
  // The link first: measure_link empties PyTorch's caches, which after the warm-up steps
  // would give back the staging buffers a host-staged step then allocates again.
  const LinkRates link = device.is_cuda() ? measure_link(device.index()) : LinkRates{};
  // A full ring before timing, and one push into it: the tiered history then holds its
  // spare column, as in every later step (Note [Reusing dropped columns]).
  for (int64_t i = 0; i < kDepth + 1; ++i) aadl.step();
  sync(device);
  const int64_t to_device_before = staged ? staged->traffic().to_device.load() : 0;
  const int64_t to_host_before = staged ? staged->traffic().to_host.load() : 0;
  if (store) store->synchronize();
  const auto store_before = store ? store->stats() : tidepool::TieredStoreStats{};
  // Chunks stored in new buffers, written over kept ones, and through host memory.
  const auto created = [&] {
    const auto& c = tiered->counters();
    return c.created_on_device.load() + c.created_through_host.load();
  };
  const auto overwritten = [&] {
    const auto& c = tiered->counters();
    return c.overwritten_on_device.load() + c.overwritten_through_host.load();
  };
  const auto through_host = [&] {
    const auto& c = tiered->counters();
    return c.created_through_host.load() + c.overwritten_through_host.load();
  };
  const std::uint64_t created_before = tiered ? created() : 0;
  const std::uint64_t overwritten_before = tiered ? overwritten() : 0;
  const std::uint64_t through_host_before = tiered ? through_host() : 0;

  double elapsed_s = 0;  // the same wall time the benchmark reports (UseRealTime)
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    aadl.step();
    sync(device);
    elapsed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  const auto steps = static_cast<double>(state.iterations());
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(n),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  double moved = 0;
  if (staged) {
    moved = static_cast<double>(staged->traffic().to_device.load() - to_device_before +
                                staged->traffic().to_host.load() - to_host_before);
  }
  if (moved > 0) state.counters["B/param"] = moved / steps / static_cast<double>(n);
  if (store) {
    // B/param from the store's copies: the new vector's write-back included (it goes
    // through the store on CUDA: Note [Creating on the device] in tiered_placement.cpp).
    store->synchronize();
    tidepool::bench_optim::tiered_step_counters(state, store_before, store->stats(), steps,
                                                static_cast<double>(n));
    // Stored chunks per step; of those, the ones in new buffers and the ones that went
    // through host memory (no room on the device): 0 and 0 are the fast path.
    const auto per_step = [&](std::uint64_t now, std::uint64_t before) {
      return static_cast<double>(now - before) / steps;
    };
    state.counters["chunks_stored"] =
        per_step(created() + overwritten(), created_before + overwritten_before);
    state.counters["chunks_created"] = per_step(created(), created_before);
    state.counters["through_host"] = per_step(through_host(), through_host_before);
  }
  if (device.is_cuda() && where != Where::resident) {
    const double h2d = 2.0 * (kDepth - 1) * 4.0 * static_cast<double>(n);
    const double d2h = 4.0 * static_cast<double>(n);
    const double floor_s = std::max({h2d / link.h2d, d2h / link.d2h, (h2d + d2h) / link.both});
    state.counters["floor_ms"] = floor_s * 1e3;
    state.counters["floor_ratio"] = elapsed_s / steps / floor_s;
    state.counters["link_h2d_GB/s"] = link.h2d * 1e-9;
    state.counters["link_both_GB/s"] = link.both * 1e-9;
  }
}

// ---- CPU ----------------------------------------------------------------------------------

void BM_Cpu_AADL_Resident(benchmark::State& s) { run_aadl(s, torch::kCPU, Where::resident); }
void BM_Cpu_AADL_Tiered(benchmark::State& s) { run_aadl(s, torch::kCPU, Where::tiered); }
BENCHMARK(BM_Cpu_AADL_Resident)
    ->RangeMultiplier(4)->Range(1 << 18, 1 << 22)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Cpu_AADL_Tiered)
    ->RangeMultiplier(4)->Range(1 << 18, 1 << 22)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- GPU (2^28 parameters; skipped without CUDA) -------------------------------------------

void BM_Gpu_AADL_Resident(benchmark::State& s) {
  if (want_cuda(s)) run_aadl(s, torch::Device(torch::kCUDA, 0), Where::resident);
}
void BM_Gpu_AADL_HostStaged(benchmark::State& s) {
  if (want_cuda(s)) run_aadl(s, torch::Device(torch::kCUDA, 0), Where::host_staged);
}
void BM_Gpu_AADL_Tiered(benchmark::State& s) {
  if (want_cuda(s)) run_aadl(s, torch::Device(torch::kCUDA, 0), Where::tiered);
}

constexpr int64_t kGpuParams = int64_t{1} << 28;
BENCHMARK(BM_Gpu_AADL_Resident)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_Gpu_AADL_HostStaged)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_Gpu_AADL_Tiered)
    ->Arg(kGpuParams)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
