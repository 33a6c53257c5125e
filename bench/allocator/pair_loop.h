// The tidepool side of the cached alloc+free pair benchmark, shared by
// tidepool_bench_alloc and tidepool_bench_alloc_c10 so both time the same loop.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>

#include "allocator/caching_allocator.h"

namespace tidepool::bench {

// Allocates and frees state.range(0) bytes per iteration; skips when `a` is null (no GPU).
inline void cached_pair(benchmark::State& state, CachingAllocator* a) {
  if (a == nullptr) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto n = static_cast<std::size_t>(state.range(0));
  // A cached pair: the first request of a size goes to the backend (cudaMalloc, ~0.1 s
  // with context set-up on the H200) and would be the only iteration a short run times.
  a->deallocate(a->allocate(n), n);
  for (auto _ : state) {
    void* p = a->allocate(n);
    benchmark::DoNotOptimize(p);
    a->deallocate(p, n);
  }
}

}  // namespace tidepool::bench
