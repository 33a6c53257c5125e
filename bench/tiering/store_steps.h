// A tiered store's optimizer steps in a manual-time benchmark, shared by the step
// benchmarks (tight_budget_step.cpp, modeled_link_step.cpp). A step is what an optimizer
// makes of the store: begin_step, every handle acquired in order on the compute stream,
// used there (the caller's `use`, e.g. a stand-in kernel), released dirty (its device copy
// changed) and, with evict_on_release, evicted at once (TieredPlacement's
// WriteBack::on_release), end_step, then a wait for the stream and the store. Two untimed
// steps come first (the first records the prefetch schedule, the second meets the
// buffers the replay allocates), then one step per iteration.
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstddef>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "tiering/tiered_store.h"

namespace tidepool::bench_state {

struct StoreSteps {
  std::vector<TieredStore::Handle> handles;  // one optimizer_state handle per size
  std::size_t total_bytes = 0;
  bool evict_on_release = false;
};

inline StoreSteps create_handles(TieredStore& store, const std::vector<std::size_t>& sizes) {
  StoreSteps s;
  for (std::size_t bytes : sizes) {
    s.handles.push_back(store.create(bytes, TIDEPOOL_TAG_OPTIMIZER_STATE));
    s.total_bytes += bytes;
  }
  return s;
}

struct TimedSteps {
  TieredStoreStats before;  // after the untimed steps
  TieredStoreStats after;   // after the timed ones
  double seconds = 0;       // of the timed steps
  double steps = 0;
};

// `use(i)` runs between the acquire and the release of handle i.
template <typename Use>
TimedSteps time_store_steps(benchmark::State& state, TieredStore& store, Stream stream,
                            const StoreSteps& steps, Use&& use) {
  auto step = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    store.begin_step();
    for (std::size_t i = 0; i < steps.handles.size(); ++i) {
      store.acquire(steps.handles[i], stream);
      use(i);
      store.release(steps.handles[i], /*dirty=*/true);
      if (steps.evict_on_release) store.evict(steps.handles[i]);
    }
    store.end_step();
    store.backend().stream_synchronize(stream);
    store.synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  step();
  step();
  TimedSteps t;
  t.before = store.stats();
  for (auto _ : state) {
    const double s = step();
    state.SetIterationTime(s);
    t.seconds += s;
  }
  t.after = store.stats();
  t.steps = static_cast<double>(state.iterations());
  return t;
}

}  // namespace tidepool::bench_state
