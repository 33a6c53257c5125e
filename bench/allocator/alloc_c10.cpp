// tidepool_bench_alloc_c10: tidepool's cached alloc+free pair on the cuda backend against
// PyTorch's native caching allocator (c10::cuda::CUDACachingAllocator::raw_alloc /
// raw_delete) in the same run, single thread and 8 threads: issue 2's target is a
// tidepool pair >= 6x faster than c10's. A separate executable so that the main hot-path
// benchmark builds without LibTorch; it is built only on CUDA + LibTorch builds, and
// every case skips (SkipWithError) on a machine without a GPU.
//
// Only c10 headers are included (no ATen): c10's allocator is initialised here the way
// PyTorch's lazy CUDA init does it (CUDACachingAllocator::init with the device count).
#include <benchmark/benchmark.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <string>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "pair_loop.h"

namespace {

// c10's allocator, initialised once (8 benchmark threads may arrive at once); false
// without a GPU.
bool c10_ready() {
  static const bool ready = [] {
    if (tidepool::cuda_device_count() == 0) return false;
    c10::cuda::CUDACachingAllocator::init(static_cast<int>(c10::cuda::device_count()));
    return true;
  }();
  return ready;
}

tidepool::CachingAllocator* tidepool_cuda() {
  static tidepool::CachingAllocator* a =
      tidepool::cuda_device_count() > 0
          ? new tidepool::CachingAllocator(tidepool::make_cuda_backend(0))
          : nullptr;
  return a;
}

void BM_C10_CachedPair(benchmark::State& state) {
  if (!c10_ready()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto n = static_cast<std::size_t>(state.range(0));
  // Warm, as tidepool's pair is (pair_loop.h): the first request of a size cudaMallocs.
  c10::cuda::CUDACachingAllocator::raw_delete(c10::cuda::CUDACachingAllocator::raw_alloc(n));
  for (auto _ : state) {
    void* p = c10::cuda::CUDACachingAllocator::raw_alloc(n);
    benchmark::DoNotOptimize(p);
    c10::cuda::CUDACachingAllocator::raw_delete(p);
  }
}

void BM_Tidepool_Cuda_CachedPair(benchmark::State& state) {
  tidepool::bench::cached_pair(state, tidepool_cuda());
}

}  // namespace

// Issue 2's target is on the median pair: five repetitions, the median reported with them.
BENCHMARK(BM_C10_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_Tidepool_Cuda_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_C10_CachedPair)->Arg(4096)->Threads(8)->UseRealTime();
BENCHMARK(BM_Tidepool_Cuda_CachedPair)->Arg(4096)->Threads(8)->UseRealTime();

BENCHMARK_MAIN();
