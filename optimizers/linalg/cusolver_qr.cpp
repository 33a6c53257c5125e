// The R factor of a tall fp64 matrix on the GPU through cuSOLVER's 64-bit Xgeqrf, so that
// N·m beyond 2³¹ elements works (torch's CUDA QR goes through the 32-bit API and fails at
// 16,777,216×8).
//
// Handles are created once per device and kept for the life of the process (cuSOLVER
// handles are expensive to create and not meant to be shared across threads concurrently,
// hence the per-handle mutex); each call binds the handle to the caller's current stream.
// The cuSOLVER workspace comes from tidepool's own device allocator under the "workspace"
// tag, so it shows in tidepool's per-tag statistics (when tidepool runs on the host
// backend, e.g. TIDEPOOL_BACKEND=host on a GPU machine, its memory is not device memory and
// the workspace comes from PyTorch's allocator instead). The fp64 copy and tau are torch
// tensors, allocated wherever the caller's PyTorch allocates.
#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cusolverDn.h>

#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "optimizers/linalg/dense_factor.h"

namespace tidepool::linalg::detail {
namespace {

void check_cusolver(cusolverStatus_t status, const char* what) {
  if (status != CUSOLVER_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("tidepool::linalg: cuSOLVER ") + what + " failed with status " +
                             std::to_string(static_cast<int>(status)));
  }
}

struct DeviceSolver {
  std::mutex mutex;
  cusolverDnHandle_t handle = nullptr;
  cusolverDnParams_t params = nullptr;
};

constexpr int kMaxDevices = 64;

// One lazily created handle per device; never destroyed (process lifetime), because
// destroying CUDA objects from static destructors races with the driver's own teardown.
DeviceSolver& solver_for(int device) {
  static std::array<std::unique_ptr<DeviceSolver>, kMaxDevices> solvers;
  static std::mutex creation;
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("tidepool::linalg: CUDA device index " + std::to_string(device) +
                                " out of range");
  }
  const std::lock_guard<std::mutex> lock(creation);
  auto& slot = solvers[static_cast<size_t>(device)];
  if (!slot) {
    auto created = std::make_unique<DeviceSolver>();
    check_cusolver(cusolverDnCreate(&created->handle), "cusolverDnCreate");
    check_cusolver(cusolverDnCreateParams(&created->params), "cusolverDnCreateParams");
    slot = std::move(created);
  }
  return *slot;
}

// Device workspace of `bytes` on `stream`, returned to its allocator on scope exit (after
// the caller has synchronised, so immediate reuse on the stream is safe).
class Workspace {
 public:
  Workspace(const at::Tensor& like, size_t bytes, cudaStream_t stream)
      : bytes_(bytes), stream_{static_cast<void*>(stream)} {
    if (bytes == 0) return;
    if (tidepool::selected_backend() == tidepool::BackendKind::cuda) {
      const tidepool::TagScope tag("workspace");
      allocator_ = &tidepool::device_allocator(like.device().index());
      ptr_ = allocator_->allocate(bytes, stream_);
    } else {
      fallback_ = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
      ptr_ = fallback_.data_ptr();
    }
  }
  ~Workspace() {
    if (allocator_ != nullptr && ptr_ != nullptr) allocator_->deallocate(ptr_, bytes_, stream_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* get() const { return ptr_; }

 private:
  size_t bytes_;
  tidepool::Stream stream_;
  tidepool::CachingAllocator* allocator_ = nullptr;
  void* ptr_ = nullptr;
  at::Tensor fallback_;
};

}  // namespace

at::Tensor cusolver_r_factor(const at::Tensor& X) {
  const c10::cuda::CUDAGuard guard(X.device());
  const int64_t rows = X.size(0);
  const int64_t cols = X.size(1);
  // cuSOLVER is column-major: X (N×m, column-major, lda = N) is the row-major m×N Xt.
  auto Xt = X.t().contiguous();
  auto tau = at::empty({std::min(rows, cols)}, X.options());
  auto info = at::zeros({1}, X.options().dtype(at::kInt));

  DeviceSolver& solver = solver_for(X.device().index());
  const std::lock_guard<std::mutex> lock(solver.mutex);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_cusolver(cusolverDnSetStream(solver.handle, stream), "SetStream");
  size_t device_bytes = 0;
  size_t host_bytes = 0;
  check_cusolver(cusolverDnXgeqrf_bufferSize(solver.handle, solver.params, rows, cols, CUDA_R_64F,
                                             Xt.data_ptr(), rows, CUDA_R_64F, tau.data_ptr(),
                                             CUDA_R_64F, &device_bytes, &host_bytes),
                 "Xgeqrf_bufferSize");
  const Workspace device_work(X, device_bytes, stream);
  std::vector<unsigned char> host_work(host_bytes + 1);
  check_cusolver(cusolverDnXgeqrf(solver.handle, solver.params, rows, cols, CUDA_R_64F, Xt.data_ptr(),
                                  rows, CUDA_R_64F, tau.data_ptr(), CUDA_R_64F, device_work.get(),
                                  device_bytes, host_work.data(), host_bytes, info.data_ptr<int>()),
                 "Xgeqrf");
  const int status = info.item<int>();  // synchronises with the stream
  if (status != 0) {
    throw std::runtime_error("tidepool::linalg: cuSOLVER Xgeqrf reported info = " + std::to_string(status));
  }
  // R(i, j) = Xt[j][i] for i ≤ j, in the top min(N,m) rows.
  const int64_t p = std::min(rows, cols);
  return Xt.narrow(1, 0, p).t().triu().cpu().contiguous();
}

}  // namespace tidepool::linalg::detail
