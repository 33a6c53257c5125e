// The backend a test runs on: the host backend (always available; its emulated device
// capacity is a parameter, so tests can hit out-of-memory on purpose) or the cuda backend
// of device 0, which is null on a machine without a GPU so the caller can skip.
#pragma once

#include <cstddef>
#include <memory>

#include "allocator/backend.h"

namespace tidepool::test_support {

inline std::unique_ptr<Backend> make_test_backend(
    BackendKind kind, std::size_t host_capacity = std::size_t{1} << 30) {
  if (kind == BackendKind::cuda) {
    if (cuda_device_count() == 0) return nullptr;
    return make_cuda_backend(0);
  }
  HostBackendOptions o;
  o.capacity_bytes = host_capacity;
  return make_host_backend(0, o);
}

}  // namespace tidepool::test_support
