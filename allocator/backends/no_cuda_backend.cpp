// Stand-ins used when tidepool is built without CUDA: the cuda backend is absent and
// asking for it is a clear error, never a silent fallback.
#include "allocator/backend.h"

namespace tidepool {

std::unique_ptr<Backend> make_cuda_backend(int device) {
  throw BackendError("tidepool: built without CUDA; cannot create a cuda backend for device " +
                     std::to_string(device) + " (rebuild with nvcc on PATH)");
}
int cuda_device_count() { return 0; }
bool built_with_cuda() { return false; }
bool cuda_can_access_peer(int, int) { return false; }

}  // namespace tidepool
