// install_from_env for LibTorch trainers: the configuration, then (global mode, CUDA
// present) tidepool as LibTorch's CUDA allocator. See torch_install.h.
//
// Note [pluggable allocator in LibTorch]
// torch::cuda::CUDAPluggableAllocator::createCustomAllocator wraps an alloc/free pair
// (std::function<void*(size_t, int, cudaStream_t)> and
// std::function<void(void*, size_t, int, cudaStream_t)> in torch 2.11), and
// changeCurrentAllocator makes it c10's CUDA allocator; LibTorch refuses (c10::Error)
// once its own allocator has been initialised, hence "call it first in main".
#include "optimizers/install/torch_install.h"

#ifdef TIDEPOOL_HAVE_CUDA
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/cuda.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "allocator/c_api.h"
#endif

namespace tidepool::optim {

namespace {

#ifdef TIDEPOOL_HAVE_CUDA
// The PyTorch-facing pair: LibTorch does not check the pointer either, so an OOM must
// arrive as an exception (Note [OOM into PyTorch] in allocator/c_api.h).
void* libtorch_alloc(size_t bytes, int device, cudaStream_t stream) {
  return tidepool_pytorch_malloc(static_cast<ssize_t>(bytes), device, stream);
}
void libtorch_free(void* ptr, size_t bytes, int device, cudaStream_t stream) {
  tidepool_pytorch_free(ptr, bytes, device, stream);
}
// Tensor::record_stream. Memory tidepool did not hand out is ignored, as c10's own
// allocator does; a failure is an exception LibTorch reports (c10::Error upstream).
void libtorch_record_stream(void* ptr, cudaStream_t stream) {
  if (tidepool_pytorch_record_stream(ptr, stream) < 0) {
    throw std::runtime_error(std::string("tidepool: record_stream failed: ") +
                             tidepool_last_error());
  }
}

// emptyCache: every device's cached memory goes back, as c10's own allocator does.
void libtorch_empty_cache() {
  if (tidepool_empty_cache_all() < 0) {
    throw std::runtime_error(std::string("tidepool: empty_cache failed: ") + tidepool_last_error());
  }
}

// Whether this process already swapped LibTorch's allocator (a second swap would fail:
// ours is initialised by then).
bool& installed_flag() {
  static bool installed = false;
  return installed;
}
std::mutex& install_mutex() {
  static std::mutex m;
  return m;
}

// Makes tidepool LibTorch's CUDA allocator. Throws InstallError when LibTorch refuses.
void swap_libtorch_allocator() {
  try {
    auto allocator = torch::cuda::CUDAPluggableAllocator::createCustomAllocator(libtorch_alloc,
                                                                                 libtorch_free);
    // Note [record_stream from PyTorch] (allocator/c_api.h): without this, LibTorch's
    // record_stream is a no-op for a pluggable allocator. (Device statistics cannot be
    // connected: CUDAPluggableAllocator has no hook for them and raises.)
    auto* pluggable =
        dynamic_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator*>(allocator.get());
    if (pluggable == nullptr) {
      throw InstallError("tidepool: LibTorch's createCustomAllocator did not return a "
                         "CUDAPluggableAllocator; record_stream could not be connected");
    }
    pluggable->set_record_stream_fn(libtorch_record_stream);
    // c10::cuda::CUDACachingAllocator::emptyCache() calls the reset function, and does
    // nothing without one.
    pluggable->set_reset_fn(libtorch_empty_cache);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  } catch (const c10::Error& e) {
    throw InstallError(std::string("tidepool: cannot make tidepool LibTorch's CUDA allocator: ") +
                       e.what_without_backtrace() +
                       " (call tidepool::optim::install_from_env() at the start of main, "
                       "before any CUDA tensor exists)");
  }
}
#endif  // TIDEPOOL_HAVE_CUDA

}  // namespace

const char* install_state_name(InstallState state) {
  switch (state) {
    case InstallState::not_configured: return "not_configured";
    case InstallState::pool_mode: return "pool_mode";
    case InstallState::host_backend: return "host_backend";
    case InstallState::inactive_no_cuda: return "inactive_no_cuda";
    case InstallState::installed: return "installed";
  }
  return "unknown";
}

InstallStatus install_from_env() {
  InstallStatus status;
  status.config = tidepool::install_from_env();
  const Config& config = status.config;
  if (!config.enabled) {
    status.state = InstallState::not_configured;
    status.message = "inactive: no tidepool key in PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF "
                     "or TIDEPOOL_ALLOC_CONF";
    return status;
  }
  if (config.mode == Mode::pool) {
    status.state = InstallState::pool_mode;
    status.message = "pool mode: LibTorch's CUDA allocator stays the default; tidepool serves "
                     "tidepool regions only";
    return status;
  }
  if (config.device_backend == DeviceBackendChoice::host) {
    status.state = InstallState::host_backend;
    status.message = "inactive: tidepool.device_backend:host serves host memory, so it is not "
                     "installed as LibTorch's CUDA allocator";
    return status;
  }
#ifndef TIDEPOOL_HAVE_CUDA
  status.state = InstallState::inactive_no_cuda;
  status.message = "inactive: no CUDA (tidepool_optim was built without CUDA)";
  return status;
#else
  if (!torch::cuda::is_available()) {
    status.state = InstallState::inactive_no_cuda;
    status.message = "inactive: no CUDA (torch::cuda::is_available() is false)";
    return status;
  }
  std::lock_guard lock(install_mutex());
  if (!installed_flag()) {
    swap_libtorch_allocator();
    installed_flag() = true;
  }
  status.state = InstallState::installed;
  status.message = "installed: tidepool is LibTorch's CUDA allocator (global mode)";
  return status;
#endif
}

}  // namespace tidepool::optim
