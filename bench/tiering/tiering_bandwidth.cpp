// Tiering throughput against the link's ceiling, measured in one run:
//   BM_PlainCopy       copy_async of pinned buffers, N tensors of one size, per direction
//                      and both directions at once: the baseline (what the link gives).
//   BM_StoreTransfer   the same bytes moved by the tiered store: prefetch (H2D), evict of
//                      dirty handles (D2H), and both at once (evict half, prefetch half).
//                      Counter vs_plain = store GB/s / plain GB/s for the same direction
//                      and tensor size, the baseline measured in the same process.
//   BM_VmmMigrate      pointer-stable migration of one range device -> host -> device.
// The store's device buffers come from a CachingAllocator over the same backend.
// Total bytes: 1 GiB on the cuda backend, 256 MiB on the host backend (CPU-only machines);
// TIDEPOOL_BENCH_MIB overrides. Tensor sizes 64 KiB .. 64 MiB.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "tiering/host_arena.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace {

using namespace tidepool;

enum Mode : int { kH2D = 0, kD2H = 1, kBoth = 2 };
const char* mode_name(int m) { return m == kH2D ? "h2d" : m == kD2H ? "d2h" : "both"; }

// The store takes device buffers from a caching allocator, as in production: buffers
// freed by evictions are reused by the next prefetch instead of going back to the device
// (cudaMalloc/cudaFree would dominate, and fresh pages on the host backend too).
CachingAllocator& device_allocator_for_bench() {
  static auto* a = new CachingAllocator(
      cuda_device_count() > 0 ? make_cuda_backend(0)
                              : make_host_backend(0, HostBackendOptions{std::size_t{4} << 30}));
  return *a;
}
Backend& backend() { return device_allocator_for_bench().backend(); }

std::size_t total_bytes() {
  if (const char* env = std::getenv("TIDEPOOL_BENCH_MIB")) return std::size_t(std::atol(env)) << 20;
  return backend().kind() == BackendKind::cuda ? std::size_t{1} << 30 : std::size_t{256} << 20;
}

HostArenaOptions pinned_options() {
  HostArenaOptions o;
  o.pinned_budget_bytes = 3 * total_bytes();
  o.respect_memlock_limit = false;  // cudaHostRegister is not bound by RLIMIT_MEMLOCK
  return o;
}

// Plain copies: one pinned host buffer and one device buffer of total_bytes, sliced into
// tensors. Returns seconds for one pass in `mode`.
struct PlainBuffers {
  HostArena arena{backend(), pinned_options()};
  HostBlock host;
  void* dev = nullptr;
  Stream h2d, d2h;
  PlainBuffers() {
    host = arena.allocate(total_bytes());
    dev = backend().device_alloc(total_bytes());
    h2d = backend().create_stream();
    d2h = backend().create_stream();
  }
  ~PlainBuffers() {
    backend().device_synchronize();
    backend().destroy_stream(h2d);
    backend().destroy_stream(d2h);
    backend().device_free(dev, total_bytes());
    arena.deallocate(host);
  }
  double pass(int mode, std::size_t tensor) {
    const std::size_t n = total_bytes();
    auto* h = static_cast<char*>(host.ptr);
    auto* d = static_cast<char*>(dev);
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t off = 0; off < n; off += tensor) {
      const std::size_t len = std::min(tensor, n - off);
      const bool up = mode == kH2D || (mode == kBoth && off < n / 2);
      if (up) {
        backend().copy_async(d + off, h + off, len, CopyKind::host_to_device, h2d);
      } else {
        backend().copy_async(h + off, d + off, len, CopyKind::device_to_host, d2h);
      }
    }
    backend().stream_synchronize(h2d);
    backend().stream_synchronize(d2h);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

PlainBuffers& plain() {
  static auto* p = [] {
    auto* buffers = new PlainBuffers();
    buffers->pass(kBoth, std::size_t{64} << 20);  // warm-up: first touch of both buffers
    return buffers;
  }();
  return *p;
}

// Best of three passes: the baseline the store is compared with.
double plain_gbps(int mode, std::size_t tensor) {
  static std::map<std::pair<int, std::size_t>, double> cache;
  auto key = std::make_pair(mode, tensor);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  double best = 1e30;
  for (int i = 0; i < 3; ++i) best = std::min(best, plain().pass(mode, tensor));
  return cache[key] = double(total_bytes()) / best / 1e9;
}

void BM_PlainCopy(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const auto tensor = static_cast<std::size_t>(state.range(1));
  for (auto _ : state) {
    state.SetIterationTime(plain().pass(mode, tensor));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * total_bytes()));
  state.SetLabel(mode_name(mode));
}

void BM_StoreTransfer(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const auto tensor = static_cast<std::size_t>(state.range(1));
  const std::size_t n = total_bytes();
  const double baseline = plain_gbps(mode, tensor);
  TieredStoreOptions o;
  o.device_budget_bytes = n;
  o.host = pinned_options();
  TieredStore store(backend(), o, caching_allocator_source(device_allocator_for_bench()));
  const Stream compute = backend().create_stream();
  std::vector<TieredStore::Handle> hs;
  for (std::size_t off = 0; off < n; off += tensor) hs.push_back(store.create(tensor, TIDEPOOL_TAG_OPTIMIZER_STATE));
  const std::size_t half = hs.size() / 2;
  // Makes handle i resident and dirty (its eviction must copy back).
  auto make_dirty = [&](std::size_t i) {
    store.acquire(hs[i], compute);
    store.release(hs[i], true);
  };
  // One pass: set-up (the handles to evict resident and dirty, the rest on the host),
  // then the timed moves. Returns the seconds of the moves.
  auto one_pass = [&] {
    for (std::size_t i = 0; i < hs.size(); ++i) {
      const bool evict_me = mode == kD2H || (mode == kBoth && i < half);
      if (evict_me) make_dirty(i); else store.evict(hs[i]);
    }
    store.synchronize();
    backend().stream_synchronize(compute);
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < hs.size(); ++i) {
      const bool evict_me = mode == kD2H || (mode == kBoth && i < half);
      if (evict_me) store.evict(hs[i]); else store.prefetch(hs[i], compute);
    }
    store.synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  one_pass();  // warm-up: first touch of the allocator's memory is not the link's speed
  double seconds = 0;
  for (auto _ : state) {
    const double s = one_pass();
    state.SetIterationTime(s);
    seconds += s;
  }
  const double gbps = double(n) * double(state.iterations()) / seconds / 1e9;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
  state.counters["store_GBps"] = gbps;
  state.counters["plain_GBps"] = baseline;
  state.counters["vs_plain"] = gbps / baseline;
  state.counters["prefetch_skipped"] = static_cast<double>(store.stats().prefetch_skipped);
  state.counters["pageable_fallbacks"] = static_cast<double>(store.stats().host.pageable_allocs);
  state.SetLabel(mode_name(mode));
  for (auto h : hs) store.destroy(h);
  backend().destroy_stream(compute);
}

void BM_VmmMigrate(benchmark::State& state) {
  const std::size_t n = total_bytes();
  VmmPool pool(backend());
  void* p = pool.allocate(n, TIDEPOOL_TAG_OPTIMIZER_STATE);
  if (p == nullptr) {
    state.SkipWithError("no device memory for the range");
    return;
  }
  backend().memset_async(p, 1, n, Stream{});
  backend().stream_synchronize(Stream{});
  double to_host = 0, to_device = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    pool.migrate(p, MemoryLocation::host);
    auto t1 = std::chrono::steady_clock::now();
    pool.migrate(p, MemoryLocation::device);
    auto t2 = std::chrono::steady_clock::now();
    to_host += std::chrono::duration<double>(t1 - t0).count();
    to_device += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(std::chrono::duration<double>(t2 - t0).count());
  }
  const double iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * n));
  state.counters["to_host_GBps"] = double(n) * iters / to_host / 1e9;
  state.counters["to_device_GBps"] = double(n) * iters / to_device / 1e9;
  state.counters["plain_d2h_GBps"] = plain_gbps(kD2H, std::size_t{64} << 20);
  pool.deallocate(p);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int mode : {kH2D, kD2H, kBoth}) {
    for (long tensor : {64L << 10, 1L << 20, 16L << 20, 64L << 20}) b->Args({mode, tensor});
  }
}

BENCHMARK(BM_PlainCopy)->Apply(sizes)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StoreTransfer)->Apply(sizes)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_VmmMigrate)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
