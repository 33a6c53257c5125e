// Optimizer steps under a tight device budget: mixed tensor sizes against same-size
// tensors of the same count and total, in one run (Note [Loads over write-backs] in
// tiering/tiered_store.h).
//
// One iteration is one step over the state: every handle acquired in order on a compute
// stream and released dirty (its device copy changed), the recorded schedule prefetching
// ahead. The budget (a quarter of the state, at least 1.25x the largest tensor) is far
// below the state, so each step loads every handle and writes every one back. Rows:
//   step/same_size   N tensors of total/N bytes: a load can always take over an evicted
//                    buffer of its own size. The baseline.
//   step/mixed       the shared benchmark state (bench_state.h, 64 KiB-64 MiB), same N
//                    and total: a load must get its room from write-backs of other sizes.
// Counters: GBps (bytes loaded + written back per second of step), per step: budget_waits
// (the host waited for a write-back to finish), exposed_ms (time the host was blocked on
// copies), prefetch_skipped, frees_stream_ordered and buffers_reused (how loads got room
// from buffers on their way out); step/mixed also ratio_vs_same_size.
// The store takes device buffers from a caching allocator, as in production.
//
// Backend and state size: TIDEPOOL_BENCH_BACKEND, TIDEPOOL_BENCH_BYTES (bench_state.h).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "bench/tiering/bench_state.h"
#include "bench/tiering/store_steps.h"
#include "tiering/tiered_store.h"

namespace {

using namespace tidepool;
using namespace tidepool::bench_state;

// What both rows share; destroyed before main returns (a CUDA context is gone by the time
// static destructors run).
struct Shared {
  BackendKind kind = choose_backend();
  std::size_t total = choose_total_bytes(kind);
  std::vector<std::size_t> mixed = mixed_tensor_sizes(total);
  std::size_t budget = std::max(total / 4, kMaxTensor + kMaxTensor / 4);
  std::unique_ptr<CachingAllocator> allocator;
  double same_size_gbps = 0;  // set by step/same_size, read by step/mixed

  Shared() {
    std::unique_ptr<Backend> backend =
        kind == BackendKind::cuda
            ? make_cuda_backend(0)
            : make_host_backend(0, HostBackendOptions{2 * budget + (std::size_t{256} << 20)});
    allocator = std::make_unique<CachingAllocator>(std::move(backend));
  }
  std::vector<std::size_t> same_sizes() const {
    const std::size_t each =
        std::max(kMinTensor, total / mixed.size() / kTensorAlign * kTensorAlign);
    return std::vector<std::size_t>(mixed.size(), each);
  }
};

void bm_step(benchmark::State& state, Shared& shared, bool mixed) {
  const std::vector<std::size_t> sizes = mixed ? shared.mixed : shared.same_sizes();
  Backend& backend = shared.allocator->backend();
  TieredStoreOptions o;
  o.device_budget_bytes = shared.budget;
  o.host.pinned_budget_bytes = 2 * shared.total + (std::size_t{256} << 20);
  o.host.respect_memlock_limit = false;  // cudaHostRegister is not bound by it
  std::size_t total = 0;
  const Stream compute = backend.create_stream();
  {
    TieredStore store(backend, o, caching_allocator_source(*shared.allocator));
    const StoreSteps steps_of = create_handles(store, sizes);
    total = steps_of.total_bytes;
    const auto [before, after, seconds, steps] =
        time_store_steps(state, store, compute, steps_of, [](std::size_t) {});
    const double moved = double(after.copy.h2d.bytes - before.copy.h2d.bytes) +
                         double(after.copy.d2h.bytes - before.copy.d2h.bytes);
    const double gbps = moved / seconds / 1e9;
    state.counters["GBps"] = gbps;
    state.counters["budget_waits"] = double(after.budget_waits - before.budget_waits) / steps;
    state.counters["exposed_ms"] =
        (after.copy.exposed_wait_ms - before.copy.exposed_wait_ms) / steps;
    state.counters["prefetch_skipped"] =
        double(after.prefetch_skipped - before.prefetch_skipped) / steps;
    state.counters["frees_stream_ordered"] =
        double(after.frees_stream_ordered - before.frees_stream_ordered) / steps;
    state.counters["buffers_reused"] = double(after.buffers_reused - before.buffers_reused) / steps;
    state.counters["peak_over_budget"] = double(after.device_peak_bytes) / double(shared.budget);
    if (mixed) {
      state.counters["ratio_vs_same_size"] =
          shared.same_size_gbps > 0 ? gbps / shared.same_size_gbps : 0;
    } else {
      shared.same_size_gbps = gbps;
    }
  }
  backend.destroy_stream(compute);
  state.SetLabel(std::to_string(sizes.size()) + " tensors, " + std::to_string(total >> 20) +
                 " MiB, budget " + std::to_string(shared.budget >> 20) + " MiB, " +
                 (shared.kind == BackendKind::cuda ? "cuda" : "host"));
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    Shared shared;
    // Registration order is run order: the baseline first, so step/mixed can divide by it.
    for (const bool mixed : {false, true}) {
      benchmark::RegisterBenchmark(
          mixed ? "step/mixed" : "step/same_size",
          [&shared, mixed](benchmark::State& s) { bm_step(s, shared, mixed); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
    benchmark::RunSpecifiedBenchmarks();
    benchmark::ClearRegisteredBenchmarks();  // they hold references to `shared`
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tidepool_bench_tiering_tight: %s\n", e.what());
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}
