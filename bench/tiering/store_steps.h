// A tiered store's optimizer steps in a manual-time benchmark, shared by the step
// benchmarks (tight_budget_step.cpp, modeled_link_step.cpp). A step is what an optimizer
// makes of the store: begin_step, the handles acquired in order on the compute stream,
// `group` at a time (Apollo takes a parameter's m, B and d together), used there (the
// caller's `use`, e.g. a stand-in kernel, once per handle), released dirty (their device
// copies changed) and, with evict_on_release, evicted at once (TieredPlacement's
// WriteBack::on_release), end_step. Two untimed steps come first (the first records the
// prefetch schedule, the second meets the buffers the replay allocates), then
// `steps_per_sync` steps per iteration, after which the stream and the store are waited
// for.
//
// Note [Isolated and steady steps]
// With one step per wait (steps_per_sync 1), each step starts with nothing in flight and
// ends when its last write-back is done: its first load and its last write-back overlap
// nothing, so a step whose first handles are a large share of the state cannot come
// near the link's floor (max of the directions' bytes at the link's rate) however well
// the rest is pipelined. A training loop does not wait like that: step() returns with its
// write-backs in flight, and the next step's first loads, which the last acquires
// prefetch, run beside them. Several steps per wait measure that steady state: the
// iteration's time divided by its steps, the one wait amortised over them.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
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
  std::size_t group = 1;       // handles acquired together; handles.size() is a multiple
  int steps_per_sync = 1;      // Note [Isolated and steady steps]
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

// `use(i)` runs between the acquire and the release of handle i (of its group).
template <typename Use>
TimedSteps time_store_steps(benchmark::State& state, TieredStore& store, Stream stream,
                            const StoreSteps& steps, Use&& use) {
  const std::size_t n = steps.handles.size();
  const std::size_t group = steps.group;
  auto step = [&] {
    store.begin_step();
    for (std::size_t first = 0; first < n; first += group) {
      const std::size_t end = std::min(first + group, n);
      for (std::size_t i = first; i < end; ++i) store.acquire(steps.handles[i], stream);
      for (std::size_t i = first; i < end; ++i) use(i);
      for (std::size_t i = first; i < end; ++i) store.release(steps.handles[i], /*dirty=*/true);
      if (steps.evict_on_release) {
        for (std::size_t i = first; i < end; ++i) store.evict(steps.handles[i]);
      }
    }
    store.end_step();
  };
  auto wait = [&] {
    store.backend().stream_synchronize(stream);
    store.synchronize();
  };
  step();
  wait();
  step();
  wait();
  TimedSteps t;
  t.before = store.stats();
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < steps.steps_per_sync; ++k) step();
    wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s / steps.steps_per_sync);  // per step
    t.seconds += s;
  }
  t.after = store.stats();
  t.steps = static_cast<double>(state.iterations()) * steps.steps_per_sync;
  return t;
}

}  // namespace tidepool::bench_state
