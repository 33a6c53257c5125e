// A tiered store's cost per acquire as its handle count and its resident set grow (host
// backend, host CPU): what finding an eviction victim costs when the budget holds a few,
// or thousands, of many handles (a model with thousands of state tensors).
//
// One iteration is one step: every handle (4 KiB each) acquired in order on a compute
// stream and released clean, the recorded schedule prefetching ahead, under a budget of
// R handles, so each acquire's prefetch evicts a handle used long ago. Rows, over N
// handles: step/handles/N/R, counter ns_per_acquire; the rows after the first also
// ratio_vs_fewest: their time per acquire over the first row's (N = 1000, R = 64), same
// run. A victim search that looked at every handle made that ratio grow with N (Note
// [Resident handles]); one that scored every resident handle, with R (Note [Eviction
// order]); the store's keeps it near 1 in both.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "allocator/tags.h"
#include "tiering/tiered_store.h"

namespace {

using namespace tidepool;

constexpr std::size_t kHandleBytes = 4 << 10;

constexpr std::int64_t kFewest = 1000;
constexpr std::int64_t kFewestResident = 64;

double& fewest_ns_per_acquire() {  // set by the step/handles/1000/64 row
  static double ns = 0;
  return ns;
}

void BM_StoreStep(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto resident = static_cast<std::size_t>(state.range(1));
  std::unique_ptr<Backend> backend = make_host_backend(0, HostBackendOptions{});
  TieredStoreOptions options;
  options.device_budget_bytes = resident * kHandleBytes;
  options.host.respect_memlock_limit = false;
  options.host.pinned_budget_bytes = std::size_t{1} << 30;
  {
    TieredStore store(*backend, options);
    const Stream compute = backend->create_stream();
    std::vector<TieredStore::Handle> handles;
    for (std::size_t i = 0; i < n; ++i)
      handles.push_back(store.create(kHandleBytes, kTagOptimizerState));
    auto step = [&] {
      store.begin_step();
      for (TieredStore::Handle h : handles) {
        store.acquire(h, compute);
        store.release(h, /*dirty=*/false);
      }
      store.end_step();
    };
    step();  // recorded
    step();
    const auto start = std::chrono::steady_clock::now();
    for (auto _ : state) step();
    const double ns = std::chrono::duration<double, std::nano>(
                          std::chrono::steady_clock::now() - start).count();
    const double per_acquire =
        state.iterations() > 0 ? ns / double(state.iterations()) / double(n) : 0.0;
    state.counters["ns_per_acquire"] = per_acquire;
    if (state.range(0) == kFewest && state.range(1) == kFewestResident) {
      fewest_ns_per_acquire() = per_acquire;
    } else if (fewest_ns_per_acquire() > 0) {
      state.counters["ratio_vs_fewest"] = per_acquire / fewest_ns_per_acquire();
    }
    backend->stream_synchronize(compute);
    backend->destroy_stream(compute);
  }
}

}  // namespace

BENCHMARK(BM_StoreStep)
    ->Name("step/handles")
    ->Args({kFewest, kFewestResident})
    ->Args({4000, kFewestResident})
    ->Args({16000, kFewestResident})
    ->Args({16000, 1024})
    ->Args({16000, 4096})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
