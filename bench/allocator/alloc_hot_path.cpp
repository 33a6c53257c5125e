// tidepool_bench_alloc: the caching allocator's hot path against baselines in the same run.
//
//   CachedPair    alloc+free of one cached size, on 1, 2 and 8 threads
//   Mixed64Live   a ring of 64 live blocks of mixed sizes: free the oldest, allocate anew
//
// Each shape runs on tidepool (host backend, and the cuda backend when a GPU is present)
// and on glibc malloc+free; on GPU builds also on cudaMallocAsync/cudaFreeAsync. The
// HostShared rows run the host backend with the per-thread caches off
// (thread_cache_bytes = 0: every call takes the allocator's mutex), the baseline that
// Note [Thread caches] is measured against. The
// targets (issue 2): on the host backend a cached pair <= 5x glibc's; on the GPU machine
// <= 100 ns and faster than cudaMallocAsync. PyTorch's native allocator
// (c10 raw_alloc/raw_delete) is compared in tidepool_bench_alloc_c10 (CUDA + LibTorch builds).
#include <benchmark/benchmark.h>

#include <array>
#include <cstdlib>
#include <random>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "pair_loop.h"

#ifdef TIDEPOOL_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using tidepool::CachingAllocator;

// One allocator per backend kind for the whole run, so every benchmark measures the warm,
// cached state (the first iterations fill the cache).
CachingAllocator* allocator_for(const std::string& kind) {
  // Function-local statics: initialised once even when 8 benchmark threads arrive at once.
  static CachingAllocator* host = new CachingAllocator(tidepool::make_host_backend(0));
  static CachingAllocator* host_shared = [] {
    tidepool::AllocatorOptions o;
    o.thread_cache_bytes = 0;
    return new CachingAllocator(tidepool::make_host_backend(0), o);
  }();
  static CachingAllocator* cuda = tidepool::cuda_device_count() > 0
                                      ? new CachingAllocator(tidepool::make_cuda_backend(0))
                                      : nullptr;
  if (kind == "host_shared") return host_shared;
  return kind == "cuda" ? cuda : host;
}

// Sizes for the mixed benchmark: 512 B .. 1 MiB, log-uniform, fixed seed.
const std::vector<std::size_t>& mixed_sizes() {
  static const std::vector<std::size_t> sizes = [] {
    std::mt19937 rng(42);
    std::vector<std::size_t> v(4096);
    for (auto& s : v) s = std::size_t{512} << (rng() % 12) | (rng() % 512);
    return v;
  }();
  return sizes;
}

// ---- glibc ----------------------------------------------------------------------------

void BM_Glibc_CachedPair(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(n);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}

void BM_Glibc_Mixed64Live(benchmark::State& state) {
  const auto& sizes = mixed_sizes();
  std::array<void*, 64> ring{};
  std::size_t i = 0;
  for (auto _ : state) {
    void*& slot = ring[i % 64];
    std::free(slot);
    slot = std::malloc(sizes[i % sizes.size()]);
    benchmark::DoNotOptimize(slot);
    ++i;
  }
  for (void* p : ring) std::free(p);
}

// ---- tidepool -------------------------------------------------------------------------

void tidepool_cached_pair(benchmark::State& state, const std::string& kind) {
  tidepool::bench::cached_pair(state, allocator_for(kind));
}

void tidepool_mixed(benchmark::State& state, const std::string& kind) {
  CachingAllocator* a = allocator_for(kind);
  if (a == nullptr) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto& sizes = mixed_sizes();
  std::array<std::pair<void*, std::size_t>, 64> ring{};
  std::size_t i = 0;
  for (auto _ : state) {
    auto& slot = ring[i % 64];
    a->deallocate(slot.first, slot.second);
    slot.second = sizes[i % sizes.size()];
    slot.first = a->allocate(slot.second);
    benchmark::DoNotOptimize(slot.first);
    ++i;
  }
  for (auto& [p, n] : ring) a->deallocate(p, n);
}

void BM_Tidepool_Host_CachedPair(benchmark::State& s) { tidepool_cached_pair(s, "host"); }
void BM_Tidepool_Host_Mixed64Live(benchmark::State& s) { tidepool_mixed(s, "host"); }
void BM_Tidepool_HostShared_CachedPair(benchmark::State& s) {
  tidepool_cached_pair(s, "host_shared");
}
void BM_Tidepool_HostShared_Mixed64Live(benchmark::State& s) { tidepool_mixed(s, "host_shared"); }
void BM_Tidepool_Cuda_CachedPair(benchmark::State& s) { tidepool_cached_pair(s, "cuda"); }
void BM_Tidepool_Cuda_Mixed64Live(benchmark::State& s) { tidepool_mixed(s, "cuda"); }

#ifdef TIDEPOOL_BENCH_CUDA
void BM_CudaMallocAsync_CachedPair(benchmark::State& state) {
  if (tidepool::cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto n = static_cast<std::size_t>(state.range(0));
  // Several threads: each its own per-thread default stream, cudaMallocAsync's best case
  // (on the one legacy stream they would all serialise on it).
  cudaStream_t stream = state.threads() > 1 ? cudaStreamPerThread : nullptr;
  // Warm, as tidepool's pair is (pair_loop.h): the pool's first request maps memory.
  void* warm = nullptr;
  if (cudaMallocAsync(&warm, n, stream) == cudaSuccess) cudaFreeAsync(warm, stream);
  cudaStreamSynchronize(stream);
  for (auto _ : state) {
    void* p = nullptr;
    cudaMallocAsync(&p, n, stream);
    benchmark::DoNotOptimize(p);
    cudaFreeAsync(p, stream);
  }
  cudaStreamSynchronize(stream);
}
BENCHMARK(BM_CudaMallocAsync_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_CudaMallocAsync_CachedPair)->Arg(4096)->Threads(8)->UseRealTime();
#endif

}  // namespace

// Issue 2's targets are on the median pair: five repetitions, the median among them.
BENCHMARK(BM_Glibc_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_Tidepool_Host_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_Tidepool_HostShared_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_Tidepool_Cuda_CachedPair)->Arg(4096)->Arg(1 << 20)->Repetitions(5);
BENCHMARK(BM_Glibc_Mixed64Live);
BENCHMARK(BM_Tidepool_Host_Mixed64Live);
BENCHMARK(BM_Tidepool_HostShared_Mixed64Live);
BENCHMARK(BM_Tidepool_Cuda_Mixed64Live);
// Several threads, each its own pairs: real time per pair across all threads.
BENCHMARK(BM_Glibc_CachedPair)->Arg(4096)->ThreadRange(2, 8)->UseRealTime();
BENCHMARK(BM_Tidepool_Host_CachedPair)->Arg(4096)->ThreadRange(2, 8)->UseRealTime();
BENCHMARK(BM_Tidepool_HostShared_CachedPair)->Arg(4096)->ThreadRange(2, 8)->UseRealTime();
BENCHMARK(BM_Tidepool_Cuda_CachedPair)->Arg(4096)->ThreadRange(2, 8)->UseRealTime();

BENCHMARK_MAIN();
