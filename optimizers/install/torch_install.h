// tidepool::optim::install_from_env — the one call a C++ trainer on LibTorch makes at the
// start of main to get what the Python start-up hook gives Python users:
//
//   int main() {
//     auto status = tidepool::optim::install_from_env();
//     std::cerr << status.message << "\n";   // e.g. "installed: LibTorch's CUDA allocator"
//     ...
//   }
//
// It runs tidepool::install_from_env() (allocator/config.h: claims the tidepool keys of
// PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, rewrites them for LibTorch, applies the
// configuration) and then, when the configuration asks for global mode and CUDA is
// available, makes tidepool LibTorch's CUDA allocator (torch_cuda_allocator.h: a
// torch::cuda::CUDAPluggableAllocator over tidepool_pytorch_malloc / tidepool_pytorch_free,
// with cacheInfo for cuDNN's autotuner, Tensor::record_stream, c10's emptyCache,
// getDeviceStats, resetPeakStats, memory history and memory fraction connected to
// tidepool: see torch_cuda_allocator.h). In pool mode nothing is swapped: only tidepool
// regions use tidepool.
//
// Not being able to install is a status, not an exception: a machine without CUDA (or a
// build without it) reports `inactive_no_cuda` and the trainer runs on LibTorch's own
// allocator. Exceptions are for mistakes: a bad configuration (tidepool::ConfigError),
// or calling it after LibTorch's CUDA allocator was already used (InstallError).
//
// Thread-safety: call it once, at the start of main, before other threads use CUDA.
// Calling it again after a successful install returns `installed` and changes nothing.
#pragma once

#include <stdexcept>
#include <string>

#include "allocator/config.h"
#include "allocator/export.h"

namespace tidepool::optim {

enum class InstallState {
  not_configured,    // nothing names tidepool: LibTorch's allocator, nothing changed
  pool_mode,         // tidepool.mode:pool: LibTorch's allocator stays the default
  host_backend,      // tidepool.device_backend:host: not a CUDA allocator, not installed
  inactive_no_cuda,  // global mode asked for, but no CUDA (device or build)
  installed,         // tidepool is LibTorch's CUDA allocator
};

TIDEPOOL_API const char* install_state_name(InstallState state);

struct InstallStatus {
  InstallState state = InstallState::not_configured;
  Config config;        // what tidepool::install_from_env() applied
  std::string message;  // one line for the log, starting with the state's meaning
};

// LibTorch refused the allocator swap (its CUDA allocator was already initialised).
class TIDEPOOL_API InstallError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

TIDEPOOL_API InstallStatus install_from_env();

}  // namespace tidepool::optim
