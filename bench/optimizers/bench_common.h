// What the optimizer benchmarks share: the problem shape (mixed tensor sizes), device
// synchronisation and the skip without CUDA, the tiered store each builds (on the GPU over
// tidepool's caching allocator, on the CPU over a host backend of its own) with its host
// memory pinned, the counters that say where a tiered step's time went, and pinned copies
// over the link in either or both directions (the comparison their floors use).
//
// Note [Benchmark stores are pinned]
// A store's default pinned budget is capped at RLIMIT_MEMLOCK when that is finite
// (HostArenaOptions::respect_memlock_limit), and containers commonly set 8 MiB (this
// project's CPU machine does): everything past it falls back to pageable host memory,
// whose copies run at pageable speed (8.1 GB/s H2D on the H200, DESIGN.md) and do not
// overlap. cudaHostRegister, which pins the store's memory, is not bound by that limit:
// the tiering benchmarks (bench/tiering) turn the cap off and moved 86 GB/s both ways on
// the H200. The optimizer benchmarks kept the cap before this note, and 2026-12-04's
// tiered figures on the H200 (Apollo 1153 ms for 26.25 B/param: about 6 GB/s) fit a
// pageable store, though that run kept no record of it. So these stores get a pinned
// budget that holds their state, without the cap, and report pageable_MiB (the state that
// is pageable anyway) and memlock_capped.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/CachingHostAllocator.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "allocator/backend.h"
#include "allocator/device_registry.h"
#include "tiering/tiered_store.h"

// A LibTorch built without CUDA has no c10/cuda (the GPU cases skip themselves there).
#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define TIDEPOOL_BENCH_C10_CUDA 1
#endif

namespace tidepool::bench_optim {

// Mixed tensor sizes summing to `total` elements: halves, quarters, … and the remainder.
inline std::vector<int64_t> mixed_sizes(int64_t total) {
  std::vector<int64_t> sizes;
  int64_t left = total;
  for (int64_t chunk = total / 2; left > 0 && chunk >= 1024; chunk /= 2) {
    sizes.push_back(chunk);
    left -= chunk;
  }
  if (left > 0) sizes.push_back(left);
  return sizes;
}

// `total` parameters in `count` tensors of one size (the last takes the remainder), as
// the layers of a transformer are: the shape a pipeline over the tensors works best on,
// against mixed_sizes' halving series, where one tensor holds half of everything.
inline std::vector<int64_t> layer_sizes(int64_t total, int64_t count = 32) {
  std::vector<int64_t> sizes(static_cast<std::size_t>(count), total / count);
  sizes.back() += total % count;
  return sizes;
}

inline void sync(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

inline bool want_cuda(benchmark::State& state) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device");
    return false;
  }
  return true;
}

// A tiered store for state on `device`. Declare it before the optimizer that uses it: the
// optimizer's placement keeps the store alive, and the store needs `backend` (CPU only).
struct BenchStore {
  std::unique_ptr<Backend> backend;
  std::shared_ptr<TieredStore> store;

  BenchStore(const torch::Device& device, const TieredStoreOptions& options) {
    if (device.is_cuda()) {
      // Device buffers from tidepool's caching allocator (cudaMalloc per load otherwise).
      CachingAllocator& allocator = device_allocator(device.index());
      store = std::make_shared<TieredStore>(allocator.backend(), options,
                                            caching_allocator_source(allocator));
    } else {
      // The host backend's "device" memory is host memory LibTorch's CPU ops can use.
      backend = make_host_backend();
      store = std::make_shared<TieredStore>(*backend, options);
    }
  }
};

// A tiered store's options for a benchmark that keeps `state_bytes` in it under a device
// budget of `device_budget` bytes (Note [Benchmark stores are pinned]): host memory for all
// of it pinned, plus room for the arena's rounding.
inline TieredStoreOptions pinned_store_options(std::size_t device_budget,
                                               std::size_t state_bytes) {
  TieredStoreOptions options;
  options.device_budget_bytes = device_budget;
  options.host.respect_memlock_limit = false;
  options.host.pinned_budget_bytes = state_bytes + state_bytes / 8 + (std::size_t{256} << 20);
  return options;
}

// Per-step counters of a tiered store between two snapshots taken `steps` steps apart
// (after the first step, which creates the state and records the prefetch schedule):
//   B/param            bytes copied both ways per parameter;
//   h2d_GB/s, d2h_GB/s the copy engine's rate while busy (busy time errs high: a batch's
//                      time includes idle gaps, copy_engine.h);
//   exposed_ms         host time per step blocked on copies (acquire waiting for room);
//   budget_waits, misses, late, skipped, loads_skipped   per step: acquires that waited
//                      for a write-back to free room, acquires that found nothing loading,
//                      prefetched loads not finished at their acquire, prefetches refused
//                      by the budget, acquires to overwrite that needed no load;
//   host_allocs        host blocks allocated per step (each of 4 MiB or more a fresh
//                      mapping registered with the driver, host_arena.h);
//   pageable_MiB, memlock_capped   the store's host memory that is pageable now, and
//                      whether its pinned budget was capped at RLIMIT_MEMLOCK.
inline void tiered_step_counters(benchmark::State& state, const TieredStoreStats& before,
                                 const TieredStoreStats& after, double steps, double params) {
  const auto per_step = [&](double delta) { return delta / steps; };
  const double moved = static_cast<double>(after.copy.h2d.bytes - before.copy.h2d.bytes +
                                           after.copy.d2h.bytes - before.copy.d2h.bytes);
  state.counters["B/param"] = moved / steps / params;
  const auto rate = [](const DirectionStats& a, const DirectionStats& b) {
    const double ms = a.busy_ms - b.busy_ms;
    // timed_bytes: the bytes whose time busy_ms holds (Note [Rates from timed bytes]).
    return ms > 0 ? static_cast<double>(a.timed_bytes - b.timed_bytes) / (ms * 1e6) : 0.0;
  };
  state.counters["h2d_GB/s"] = rate(after.copy.h2d, before.copy.h2d);
  state.counters["d2h_GB/s"] = rate(after.copy.d2h, before.copy.d2h);
  state.counters["exposed_ms"] = per_step(after.copy.exposed_wait_ms - before.copy.exposed_wait_ms);
  state.counters["budget_waits"] = per_step(static_cast<double>(after.budget_waits -
                                                                before.budget_waits));
  state.counters["misses"] = per_step(static_cast<double>(after.misses - before.misses));
  state.counters["late"] = per_step(static_cast<double>(after.prefetch_late -
                                                        before.prefetch_late));
  state.counters["skipped"] = per_step(static_cast<double>(after.prefetch_skipped -
                                                           before.prefetch_skipped));
  state.counters["loads_skipped"] =
      per_step(static_cast<double>(after.loads_skipped - before.loads_skipped));
  state.counters["host_allocs"] = per_step(static_cast<double>(
      after.host.pinned_allocs + after.host.pageable_allocs - before.host.pinned_allocs -
      before.host.pageable_allocs));
  state.counters["pageable_MiB"] =
      static_cast<double>(after.host.pageable_in_use_bytes) / (1024.0 * 1024.0);
  state.counters["memlock_capped"] = after.host.budget_capped_by_memlock ? 1 : 0;
}

// `bytes` of pinned host memory and device memory, and a stream per direction, to time
// the link with: copy(up, down) moves the buffer host→device, device→host or both at once
// and waits; it returns the seconds it took.
class LinkCopies {
 public:
  LinkCopies(int device, int64_t bytes)
      : backend_(device_allocator(device).backend()), bytes_(static_cast<std::size_t>(bytes)) {
    const auto pinned = torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true);
    const auto on_device = torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, device);
    host_in_ = torch::ones({bytes}, pinned);
    host_out_ = torch::empty({bytes}, pinned);
    dev_in_ = torch::empty({bytes}, on_device);
    dev_out_ = torch::ones({bytes}, on_device);
    sync(torch::Device(torch::kCUDA, device));
    h2d_ = backend_.create_stream();
    d2h_ = backend_.create_stream();
  }
  ~LinkCopies() {
    backend_.destroy_stream(h2d_);
    backend_.destroy_stream(d2h_);
  }
  LinkCopies(const LinkCopies&) = delete;
  LinkCopies& operator=(const LinkCopies&) = delete;

  double copy(bool up, bool down) {
    const auto start = std::chrono::steady_clock::now();
    if (up) {
      backend_.copy_async(dev_in_.data_ptr(), host_in_.data_ptr(), bytes_,
                          CopyKind::host_to_device, h2d_);
    }
    if (down) {
      backend_.copy_async(host_out_.data_ptr(), dev_out_.data_ptr(), bytes_,
                          CopyKind::device_to_host, d2h_);
    }
    backend_.stream_synchronize(h2d_);
    backend_.stream_synchronize(d2h_);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::size_t bytes() const { return bytes_; }

 private:
  Backend& backend_;
  std::size_t bytes_;
  torch::Tensor host_in_, host_out_, dev_in_, dev_out_;
  Stream h2d_, d2h_;
};

// Pinned-memory rates of the link in bytes/s: H2D, D2H, and both at once on two streams
// (the best of three 1 GiB copies each).
struct LinkRates {
  double h2d = 0, d2h = 0, both = 0;
};

inline LinkRates measure_link(int device) {
  LinkRates rates;
  {
    LinkCopies link(device, int64_t{1} << 30);
    const auto best_rate = [&](bool up, bool down) {
      double best = 0;
      for (int rep = 0; rep < 3; ++rep) {
        const double bytes =
            static_cast<double>(link.bytes()) * ((up ? 1 : 0) + (down ? 1 : 0));
        best = std::max(best, bytes / link.copy(up, down));
      }
      return best;
    };
    rates = LinkRates{best_rate(true, false), best_rate(false, true), best_rate(true, true)};
  }
  // The buffers' 2 GiB of device and 2 GiB of pinned memory would stay in PyTorch's caches
  // through the timed steps that follow (on an 80 GB GPU, room the state's pipeline lacks).
#ifdef TIDEPOOL_BENCH_C10_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  at::getHostAllocator(at::kCUDA)->empty_cache();
  return rates;
}

}  // namespace tidepool::bench_optim
