// Host arena alloc+free against malloc and mi_malloc, in one run, per size.
//
// HostArena::allocate/deallocate is what the tiered store pays per tensor it creates; the
// baselines are the process allocator (glibc malloc) and mimalloc's own default heap.
// mi_malloc / mi_free are resolved at run time from the libmimalloc that libtidepool.so
// loads, so this executable does not link mimalloc (which would replace its malloc).
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <cstdlib>
#include <memory>

#include "allocator/backend.h"
#include "tiering/host_arena.h"

namespace {

using MiMalloc = void* (*)(std::size_t);
using MiFree = void (*)(void*);

tidepool::HostArena& arena() {
  static std::unique_ptr<tidepool::Backend> backend = tidepool::make_host_backend(0);
  static tidepool::HostArena* a = [] {
    tidepool::HostArenaOptions o;
    o.pinned_budget_bytes = std::size_t{1} << 30;
    o.respect_memlock_limit = false;  // the host backend does not lock pages
    return new tidepool::HostArena(*backend, o);
  }();
  return *a;
}

void BM_HostArenaAllocFree(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  tidepool::HostArena& a = arena();
  for (auto _ : state) {
    tidepool::HostBlock b = a.allocate(bytes);
    benchmark::DoNotOptimize(b.ptr);
    a.deallocate(b);
  }
  state.counters["pageable_fallbacks"] = static_cast<double>(a.stats().pageable_allocs);
}

void BM_MallocFree(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}

void BM_MiMallocFree(benchmark::State& state) {
  // Loaded RTLD_LOCAL, as the host arena does, so mimalloc does not become the
  // process's malloc (which would skew the malloc baseline).
  static void* const library = dlopen("libmimalloc.so.2", RTLD_LOCAL | RTLD_NOW);
  static const auto mi_malloc =
      reinterpret_cast<MiMalloc>(library != nullptr ? dlsym(library, "mi_malloc") : nullptr);
  static const auto mi_free =
      reinterpret_cast<MiFree>(library != nullptr ? dlsym(library, "mi_free") : nullptr);
  if (mi_malloc == nullptr || mi_free == nullptr) {
    state.SkipWithError("libmimalloc.so.2 could not be loaded (install libmimalloc2.0)");
    return;
  }
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = mi_malloc(bytes);
    benchmark::DoNotOptimize(p);
    mi_free(p);
  }
}

#define TIDEPOOL_SIZES ->Arg(64)->Arg(4 << 10)->Arg(64 << 10)->Arg(1 << 20)
BENCHMARK(BM_HostArenaAllocFree) TIDEPOOL_SIZES;
BENCHMARK(BM_MallocFree) TIDEPOOL_SIZES;
BENCHMARK(BM_MiMallocFree) TIDEPOOL_SIZES;

}  // namespace

BENCHMARK_MAIN();
