// What the optimizer benchmarks share: the problem shape (mixed tensor sizes), device
// synchronisation and the skip without CUDA, the tiered store each builds (on the GPU over
// tidepool's caching allocator, on the CPU over a host backend of its own), and pinned
// copies over the link in either or both directions (the comparison their floors use).
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "allocator/backend.h"
#include "allocator/device_registry.h"
#include "tiering/tiered_store.h"

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

}  // namespace tidepool::bench_optim
