// install_from_env for LibTorch trainers: the configuration, then (global mode, CUDA
// present) tidepool as LibTorch's CUDA allocator (torch_cuda_allocator.h). See
// torch_install.h.
#include "optimizers/install/torch_install.h"

#ifdef TIDEPOOL_HAVE_CUDA
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <string>

#include "optimizers/install/torch_cuda_allocator.h"
#endif

namespace tidepool::optim {

namespace {

#ifdef TIDEPOOL_HAVE_CUDA
// Makes tidepool LibTorch's CUDA allocator. Throws InstallError when LibTorch refuses.
void swap_libtorch_allocator() {
  try {
    install_torch_cuda_allocator();
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
  swap_libtorch_allocator();  // once per process; later calls change nothing
  status.state = InstallState::installed;
  status.message = "installed: tidepool is LibTorch's CUDA allocator (global mode)";
  return status;
#endif
}

}  // namespace tidepool::optim
