// The R factor of a tall fp64 matrix on the GPU: a blocked TSQR whose leaves are cuSOLVER's
// 64-bit Xgeqrf on row chunks of at most 2²⁷ elements, so that N·m beyond 2³¹ elements
// works (torch's CUDA QR goes through the 32-bit API and fails at 16,777,216×8).
//
// Note [Why chunks]: one Xgeqrf over the whole N×m matrix takes int64 sizes in its
// signature, but on the H200 it hit an illegal memory access at (2²⁸ + 4096)×9 fp64
// (2.4e9 elements, 19 GB). Every size we pass is int64, lda = N, and both workspaces are
// sized by Xgeqrf_bufferSize, so the overflow is most likely inside cuSOLVER (torch and
// CUDA.jl report the same family of faults: geqrf/ormqr buffer sizes overflowing for
// large thin matrices). So no cuSOLVER call here ever sees more than 2²⁷ elements (2³⁰
// bytes, below 2³¹ even as a byte offset): R of [X₁; X₂; …] is R of [R₁; R₂; …]
// (TSQR, Demmel, Grigori, Hoemmen, Langou 2012: as backward stable as one Householder QR, and
// the row signs of R do not matter to solve_from_r_factor, which only uses R's SVD and
// the R_A/R_B rows together). The stacked R_c (chunks·m rows × m) are tiny and are
// factored on the host in fp64 by LAPACK. No Q is formed and no ormqr is needed: lstsq
// factors [A·D | B], so QᵀB is the R_B block of R.
//
// Handles are created once per device and kept for the life of the process (cuSOLVER
// handles are expensive to create and not meant to be shared across threads concurrently,
// hence the per-handle mutex); each call binds the handle to the caller's current stream.
// The cuSOLVER workspace comes from tidepool's own device allocator under the "workspace"
// tag, so it shows in tidepool's per-tag statistics (when tidepool runs on the host
// backend, e.g. TIDEPOOL_BACKEND=host on a GPU machine, its memory is not device memory and
// the workspace comes from PyTorch's allocator instead). The transposed fp64 chunk, tau
// and info are torch tensors, allocated wherever the caller's PyTorch allocates.
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
#include "optimizers/linalg/tsqr_plan.h"

namespace tidepool::linalg::detail {
namespace {

void check_cusolver(cusolverStatus_t status, const char* what) {
  if (status != CUSOLVER_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("tidepool::linalg: cuSOLVER ") + what +
                             " failed with status " + std::to_string(static_cast<int>(status)));
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
    if (const cusolverStatus_t status = cusolverDnCreateParams(&created->params);
        status != CUSOLVER_STATUS_SUCCESS) {
      (void)cusolverDnDestroy(created->handle);  // or each retry would leak one
      check_cusolver(status, "cusolverDnCreateParams");
    }
    slot = std::move(created);
  }
  return *slot;
}

// Device workspace of `bytes` on `stream`, returned to its allocator on scope exit. The free
// is stream-ordered (the allocator hands the block out again only to work queued after the
// cuSOLVER call on the same stream, or after an event on another), so no synchronisation
// is needed before it.
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
    if (allocator_ == nullptr || ptr_ == nullptr) return;
    try {
      allocator_->deallocate(ptr_, bytes_, stream_);
    } catch (const std::exception&) {
      // A destructor does not throw (implicitly noexcept: it would be std::terminate).
      // deallocate throws BackendError after a sticky CUDA fault, leaving the block
      // allocated; the fault reaches the caller anyway, from cuSOLVER or the next
      // synchronisation, and that is the error worth reporting, not this lost block.
    }
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

// R factor of one chunk (rows×cols fp64 on the device, rows·cols ≤ 2²⁷):
// min(rows,cols)×cols, upper trapezoidal, on the device. Xgeqrf's status lands in info[0] (device
// int32) and is checked by the caller after all chunks, with one synchronisation; `host_work` is
// the host workspace, which the caller keeps alive until then.
at::Tensor chunk_r_factor(DeviceSolver& solver, const at::Tensor& chunk, at::Tensor info,
                          std::vector<unsigned char>& host_work, cudaStream_t stream) {
  const int64_t rows = chunk.size(0);
  const int64_t cols = chunk.size(1);
  // cuSOLVER is column-major: chunk (rows×cols, column-major, lda = rows) is the row-major
  // cols×rows chunkᵀ.
  auto Xt = chunk.t().contiguous();
  auto tau = at::empty({std::min(rows, cols)}, chunk.options());
  size_t device_bytes = 0;
  size_t host_bytes = 0;
  check_cusolver(cusolverDnXgeqrf_bufferSize(solver.handle, solver.params, rows, cols, CUDA_R_64F,
                                             Xt.data_ptr(), rows, CUDA_R_64F, tau.data_ptr(),
                                             CUDA_R_64F, &device_bytes, &host_bytes),
                 "Xgeqrf_bufferSize");
  const Workspace device_work(chunk, device_bytes, stream);
  host_work.resize(host_bytes + 1);
  check_cusolver(cusolverDnXgeqrf(solver.handle, solver.params, rows, cols, CUDA_R_64F,
                                  Xt.data_ptr(), rows, CUDA_R_64F, tau.data_ptr(), CUDA_R_64F,
                                  device_work.get(), device_bytes, host_work.data(), host_bytes,
                                  info.data_ptr<int>()),
                 "Xgeqrf");
  // R(i, j) = Xt[j][i] for i ≤ j, in the top min(rows, cols) rows. triu() copies, so Xt and
  // the workspace may be released (stream-ordered) when this returns.
  const int64_t p = std::min(rows, cols);
  return Xt.narrow(1, 0, p).t().triu();
}

}  // namespace

at::Tensor cusolver_r_factor(const at::Tensor& X) {
  const c10::cuda::CUDAGuard guard(X.device());
  const int64_t rows = X.size(0);
  const int64_t cols = X.size(1);
  const TsqrPlan plan = tsqr_plan(rows, cols);  // throws for an empty X
  auto infos = at::zeros({plan.chunks}, X.options().dtype(at::kInt));

  DeviceSolver& solver = solver_for(X.device().index());
  const std::lock_guard<std::mutex> lock(solver.mutex);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_cusolver(cusolverDnSetStream(solver.handle, stream), "SetStream");
  std::vector<at::Tensor> triangles;
  std::vector<std::vector<unsigned char>> host_works(static_cast<size_t>(plan.chunks));
  triangles.reserve(static_cast<size_t>(plan.chunks));
  for (int64_t c = 0; c < plan.chunks; ++c) {
    triangles.push_back(chunk_r_factor(solver, X.narrow(0, plan.begin(c), plan.count(c)),
                                       infos.narrow(0, c, 1),
                                       host_works[static_cast<size_t>(c)], stream));
  }
  const auto host_infos = infos.cpu();  // synchronises with the stream
  for (int64_t c = 0; c < plan.chunks; ++c) {
    if (const int status = host_infos[c].item<int>(); status != 0) {
      throw std::runtime_error("tidepool::linalg: cuSOLVER Xgeqrf reported info = " +
                               std::to_string(status) + " on row chunk " + std::to_string(c));
    }
  }
  if (plan.chunks == 1) return triangles.front().cpu().contiguous();
  // The tree's root: R of the stacked chunk triangles, fp64 LAPACK on the host.
  const auto stacked = at::cat(triangles, 0).cpu();
  return std::get<1>(at::linalg_qr(stacked, "r")).contiguous();
}

}  // namespace tidepool::linalg::detail
