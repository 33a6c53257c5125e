// The tiered store's optimizer step over a modelled PCIe link (link_model_backend.h), on
// the host backend: how close the pipeline comes to the link's floor when the host never
// blocks on compute, as with GPU kernels. Measured without a GPU, so that a pipeline that
// leaves the link idle (loads started late, write-backs waited for) shows on any machine
// and not only on the device.
//
// One iteration is one step over the state, as the optimizers make it: every handle
// acquired in order on a compute stream, "computed" there (a host function that holds the
// stream for the handle's bytes at kComputeRate, far above the link's, as a GPU kernel's
// time is far below the copy's), released dirty, and with the state larger than the
// budget evicted at once (TieredPlacement's WriteBack::on_release), the recorded schedule
// prefetching ahead. The host thread only enqueues. Rows, each with 64 MiB of state and a
// budget of a quarter of it unless said:
//   step/layers     32 tensors of one size (a transformer's layers);
//   step/mixed      bench_state.h's log-uniform 64 KiB-8 MiB sizes;
//   step/halving    bench_apollo_step's GPU shape (budget two thirds of the state), one
//                   handle at a time; step/halving/apollo takes each parameter's three
//                   handles together, as Apollo does.
// Each row is timed twice (Note [Isolated and steady steps] in store_steps.h): one step
// per wait, as bench_apollo_step times the GPU step, and, as .../steady, kSteadySteps
// steps per wait, as a training loop runs them (write-backs of one step beside the first
// loads of the next).
// Counters: floor_ratio, the step's time over the time the state's bytes take one way at
// the modelled rate (each direction moves them at once: 1 at best; the target for a
// tiered step is 1.15; the floor is the state's bytes, not the bytes moved, so that copies
// beyond them count against the step instead of raising its floor); link_busy_share,
// both directions' modelled busy time over twice the step's (1: both busy all along);
// B_per_state_byte, bytes moved per byte of state (2: everything in and out once); and
// the store's budget_waits and exposed_ms per step.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "bench/tiering/bench_state.h"
#include "bench/tiering/link_model_backend.h"
#include "bench/tiering/store_steps.h"
#include "tiering/tiered_store.h"

namespace {

using namespace tidepool;
using namespace tidepool::bench_state;

constexpr std::size_t kState = std::size_t{64} << 20;
constexpr std::size_t kBudget = kState / 4;
constexpr double kLinkRate = 1e9;     // bytes per second each way
constexpr double kComputeRate = 8e9;  // bytes of state per second of "kernel"

// A host function on the compute stream standing in for the kernel that uses a handle.
void compute(void* arg) {
  const auto bytes = reinterpret_cast<std::uintptr_t>(arg);
  std::this_thread::sleep_for(std::chrono::duration<double>(double(bytes) / kComputeRate));
}

std::vector<std::size_t> layer_sizes() {
  return std::vector<std::size_t>(32, kState / 32);
}
std::vector<std::size_t> mixed_sizes() {
  // The shared generator's sizes up to 8 MiB (a quarter budget must hold the largest).
  std::vector<std::size_t> sizes;
  for (std::size_t s : mixed_tensor_sizes(kState)) {
    while (s > (std::size_t{8} << 20)) {
      sizes.push_back(std::size_t{8} << 20);
      s -= std::size_t{8} << 20;
    }
    if (s >= kTensorAlign) sizes.push_back(s);
  }
  return sizes;
}

// The shape of bench_apollo_step's GPU problem: parameter tensors of half, a quarter, ...
// of the parameters, three state tensors each (Apollo's m, B, d), in that order.
std::vector<std::size_t> halving_sizes() {
  std::vector<std::size_t> sizes;
  std::size_t left = kState / 3;
  for (std::size_t n = left / 2; left > 0 && n >= kTensorAlign; n /= 2) {
    for (int k = 0; k < 3; ++k) sizes.push_back(n);
    left -= n;
  }
  if (left >= kTensorAlign) {
    for (int k = 0; k < 3; ++k) sizes.push_back(left / kTensorAlign * kTensorAlign);
  }
  return sizes;
}

constexpr int kSteadySteps = 8;

struct StepShape {
  std::vector<std::size_t> sizes;
  std::size_t budget = kBudget;
  std::size_t group = 1;  // handles acquired together
};

void bm_step(benchmark::State& state, const StepShape& shape, int steps_per_sync) {
  const std::vector<std::size_t>& sizes = shape.sizes;
  const std::size_t budget = shape.budget;
  auto allocator = std::make_unique<CachingAllocator>(std::make_unique<LinkModelBackend>(
      make_host_backend(0, HostBackendOptions{2 * budget + (std::size_t{64} << 20)}),
      kLinkRate));
  Backend& backend = allocator->backend();
  TieredStoreOptions o;
  o.device_budget_bytes = budget;
  o.host.pinned_budget_bytes = 2 * kState + (std::size_t{64} << 20);
  o.host.respect_memlock_limit = false;
  const Stream stream = backend.create_stream();
  std::size_t total = 0;
  {
    TieredStore store(backend, o, caching_allocator_source(*allocator));
    StoreSteps steps_of = create_handles(store, sizes);
    steps_of.evict_on_release = true;
    steps_of.group = shape.group;
    steps_of.steps_per_sync = steps_per_sync;
    total = steps_of.total_bytes;
    const auto [before, after, seconds, steps] =
        time_store_steps(state, store, stream, steps_of, [&](std::size_t i) {
          backend.launch_host_func(stream, &compute,
                                   reinterpret_cast<void*>(std::uintptr_t{sizes[i]}));
        });
    const double h2d = double(after.copy.h2d.bytes - before.copy.h2d.bytes) / steps;
    const double d2h = double(after.copy.d2h.bytes - before.copy.d2h.bytes) / steps;
    const double step_s = seconds / steps;
    state.counters["floor_ratio"] = step_s / (double(total) / kLinkRate);
    state.counters["link_busy_share"] = (h2d + d2h) / kLinkRate / (2 * step_s);
    state.counters["B_per_state_byte"] = (h2d + d2h) / double(total);
    state.counters["budget_waits"] = double(after.budget_waits - before.budget_waits) / steps;
    state.counters["exposed_ms"] =
        (after.copy.exposed_wait_ms - before.copy.exposed_wait_ms) / steps;
  }
  backend.destroy_stream(stream);
  state.SetLabel(std::to_string(sizes.size()) + " tensors, " + std::to_string(total >> 20) +
                 " MiB, budget " + std::to_string(budget >> 20) + " MiB, link " +
                 std::to_string(int(kLinkRate / 1e9)) + " GB/s each way (modelled)");
}

void register_rows(const char* name, const StepShape& shape) {
  for (const int steps_per_sync : {1, kSteadySteps}) {
    const std::string row =
        std::string("step/") + name + (steps_per_sync == 1 ? "" : "/steady");
    benchmark::RegisterBenchmark(row.c_str(),
                                 [shape, steps_per_sync](benchmark::State& s) {
                                   bm_step(s, shape, steps_per_sync);
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_rows("layers", {layer_sizes()});
  register_rows("mixed", {mixed_sizes()});
  register_rows("halving", {halving_sizes(), kState * 2 / 3});
  register_rows("halving/apollo", {halving_sizes(), kState * 2 / 3, 3});
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
