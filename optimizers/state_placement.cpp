// The StateBuffer protocol checks and the two placements that need nothing from tiering/:
// state resident on the compute device, and state kept in host memory and staged onto the
// device around each use. See state_placement.h for the protocol.
#include "optimizers/state_placement.h"

#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include <torch/cuda.h>

#if TIDEPOOL_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace tidepool::optim {

namespace {
// A host-staged placement's copy streams on one device (Note [Host-staged copy streams]).
#if TIDEPOOL_HAVE_CUDA
struct StagingStreams {
  c10::cuda::CUDAStream h2d, d2h;
};
#else
struct StagingStreams {};
#endif
}  // namespace

// ---- StateBuffer: the protocol, checked once ---------------------------------------------

StateBuffer::StateBuffer(at::IntArrayRef sizes, torch::TensorOptions options)
    : sizes_(sizes.vec()), options_(std::move(options)) {}

void StateBuffer::prefetch() {
  if (acquired_) return;
  // A hint: one that fails (a host-staged buffer's staging tensors out of device memory
  // while the buffer before it is still staged, a tiered load whose copy failed) leaves
  // the buffer as it was, and the acquire that follows loads it itself, or reports
  // whatever stops it. Thrown on, it would stop an optimizer step between parameters.
  try {
    do_prefetch();
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE("tidepool: a prefetch of optimizer state failed, so the state is loaded "
                    "when used instead (said once): ",
                    e.what());
  }
}

torch::Tensor StateBuffer::acquire() {
  TORCH_CHECK(!acquired_, "tidepool: StateBuffer::acquire called twice without release");
  working_ = do_acquire();
  acquired_ = true;
  return working_;
}

void StateBuffer::release(bool dirty) {
  TORCH_CHECK(acquired_, "tidepool: StateBuffer::release without a matching acquire");
  do_release(working_, dirty);  // throws: still acquired, nothing handed back
  working_ = torch::Tensor();
  acquired_ = false;
  do_after_release();
}

torch::Tensor StateBuffer::read_host() const {
  TORCH_CHECK(!acquired_, "tidepool: StateBuffer::read_host while the buffer is acquired");
  return do_read_host();
}

void StateBuffer::overwrite(const torch::Tensor& contents) {
  TORCH_CHECK(!acquired_, "tidepool: StateBuffer::overwrite while the buffer is acquired");
  TORCH_CHECK(contents.sizes() == at::IntArrayRef(sizes_) &&
                  contents.scalar_type() == options_.dtype() &&
                  contents.device() == options_.device(),
              "tidepool: StateBuffer::overwrite with a tensor of shape ", contents.sizes(), " (",
              contents.scalar_type(), ", ", contents.device(), ") for a buffer of shape ",
              at::IntArrayRef(sizes_), " (", options_.dtype(), ", ", options_.device(), ")");
  do_overwrite(contents);
}

void StateBuffer::do_overwrite(const torch::Tensor& contents) {
  torch::Tensor working = acquire();
  try {
    working.copy_(contents, /*non_blocking=*/true);  // on the current stream (CUDA)
  } catch (...) {
    working = torch::Tensor();
    release(/*dirty=*/false);
    throw;
  }
  working = torch::Tensor();  // drop our view before the placement may move the bytes
  release(/*dirty=*/true);
}

namespace {

// ---- resident: the tensor is the state ----------------------------------------------------

class ResidentBuffer final : public StateBuffer {
 public:
  // `storage` becomes the state (a contiguous tensor of its own).
  explicit ResidentBuffer(torch::Tensor storage)
      : StateBuffer(storage.sizes(), storage.options()), tensor_(std::move(storage)) {}

 private:
  torch::Tensor do_acquire() override { return tensor_; }
  void do_release(torch::Tensor& working, bool /*dirty*/) override {
    // The working tensor is the storage itself: writes already landed.
    (void)working;
  }
  // Into the storage itself, on the current stream (CUDA) like create()'s clone.
  void do_overwrite(const torch::Tensor& contents) override {
    tensor_.copy_(contents, /*non_blocking=*/true);
  }
  // Blocking: a non_blocking copy from the device would hand a checkpoint a pinned host
  // tensor the copy may not have filled yet (nothing else waits for it).
  torch::Tensor do_read_host() const override {
    return tensor_.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
  }

  torch::Tensor tensor_;
};

// ---- host staged: host copy + per-use staging tensor on the device ------------------------

// Note [Host-staged copy streams]
// On CUDA, a buffer's copies do not run on the compute stream, where they would queue
// behind the kernels and each other (the step then costs every copy plus every kernel:
// 142 ms for Apollo at 2^28 parameters on the H200 where the pinned link both ways would
// take 65 ms, bench/RESULTS.md 2026-12-04). The placement draws two streams per device
// from LibTorch's pool, one for loads (h2d) and one for write-backs (d2h):
//   - stage-in: on h2d, after the last write of the host copy (host_ready_), into a
//     staging tensor allocated with h2d current, so the caching allocator files it under
//     h2d; staged_ready_ is recorded after the copy;
//   - acquire: the compute stream waits for staged_ready_;
//   - release: an event on the compute stream marks the end of the use; a dirty buffer is
//     copied back on d2h after it (host_ready_ recorded after the copy). Then h2d waits
//     for the end of the use (clean) or for the write-back (dirty), before the staging
//     tensor is freed: the allocator hands its block out again only to work on h2d, which
//     now comes after every use of it, without record_stream.
// So a load waits for nothing of the compute stream but the uses of the memory it reuses,
// a buffer released before the current one (the prefetch of the next buffer is issued
// before the current one is released): loads, kernels and write-backs overlap. The
// initial copy into host memory stays on the compute stream (create() promises it is
// ordered there before the caller may overwrite `initial`). Every copy still comes after
// what it reads and before what reads it, by stream order or an event, so no result
// changes; and no caller needs to know about the copy streams.
class HostStagedBuffer final : public StateBuffer {
 public:
  // The contents of `initial`, copied on the compute device's current stream.
  HostStagedBuffer(const torch::Tensor& initial,
                   std::shared_ptr<HostStagedPlacement::Traffic> traffic,
                   std::optional<StagingStreams> streams)
      : StateBuffer(initial.sizes(), initial.options()),
        traffic_(std::move(traffic)),
        streams_(streams) {
    host_ = torch::empty(initial.sizes(), host_options(initial.options()));
    // Stream-ordered like every other copy here, so the host does not wait: the caller's
    // later work on the stream (overwriting or freeing `initial`), a stage_in of this
    // buffer and do_read_host's synchronize all come after it; PyTorch's pinned-memory
    // allocator keeps host_ until the copy is done even if this buffer goes first.
    host_.copy_(initial, /*non_blocking=*/initial.is_cuda());
#if TIDEPOOL_HAVE_CUDA
    if (streams_) host_ready_.record(compute_stream());
#endif
  }
  // Zeros, made in host memory.
  HostStagedBuffer(at::IntArrayRef sizes, const torch::TensorOptions& options,
                   std::shared_ptr<HostStagedPlacement::Traffic> traffic,
                   std::optional<StagingStreams> streams)
      : StateBuffer(sizes, options), traffic_(std::move(traffic)), streams_(streams) {
    host_ = torch::zeros(sizes, host_options(options));
  }
  ~HostStagedBuffer() override {
#if TIDEPOOL_HAVE_CUDA
    // Dropped while acquired (a caller bug): the staging tensor may still be in use on the
    // compute stream; its memory goes back to h2d only after that use.
    if (streams_ && acquired()) {
      try {
        released_.record(compute_stream());
        released_.block(streams_->h2d);
      } catch (...) {
        // A destructor does not throw.
      }
    }
#endif
  }

 private:
  static torch::TensorOptions host_options(const torch::TensorOptions& options) {
    auto host = options.device(torch::kCPU);
    // Pinned memory lets the device copies run asynchronously.
    if (options.device().is_cuda()) host = host.pinned_memory(true);
    return host;
  }

  void do_prefetch() override {
    if (!staged_.defined()) staged_ = stage_in();
  }
  torch::Tensor do_acquire() override {
    torch::Tensor staged = staged_.defined() ? staged_ : stage_in();
    staged_ = torch::Tensor();
#if TIDEPOOL_HAVE_CUDA
    if (streams_) staged_ready_.block(compute_stream());
#endif
    return staged;
  }
  void do_release(torch::Tensor& working, bool dirty) override {
#if TIDEPOOL_HAVE_CUDA
    if (streams_) {
      released_.record(compute_stream());
      if (dirty) {
        const c10::cuda::CUDAStreamGuard on_d2h(streams_->d2h);
        released_.block(streams_->d2h);
        host_.copy_(working, /*non_blocking=*/true);
        host_ready_.record(streams_->d2h);
        traffic_->to_host += static_cast<int64_t>(host_.nbytes());
        host_ready_.block(streams_->h2d);
      } else {
        released_.block(streams_->h2d);
      }
      return;
    }
#endif
    // Stream-ordered: a later stage_in of this buffer is queued after this copy.
    if (dirty) {
      host_.copy_(working, /*non_blocking=*/working.is_cuda());
      traffic_->to_host += static_cast<int64_t>(host_.nbytes());
    }
  }
  torch::Tensor do_read_host() const override {
    if (options().device().is_cuda()) {
      // Wait for write-backs still queued on the device's streams.
      torch::cuda::synchronize(options().device().index());
    }
    return host_.clone();
  }

  torch::Tensor stage_in() {
#if TIDEPOOL_HAVE_CUDA
    if (streams_) {
      const c10::cuda::CUDAStreamGuard on_h2d(streams_->h2d);
      host_ready_.block(streams_->h2d);  // no-op before the first record
      torch::Tensor staged = torch::empty(sizes(), options());  // filed under h2d
      staged.copy_(host_, /*non_blocking=*/true);
      staged_ready_.record(streams_->h2d);
      traffic_->to_device += static_cast<int64_t>(host_.nbytes());
      return staged;
    }
#endif
    torch::Tensor staged = torch::empty(sizes(), options());
    staged.copy_(host_, /*non_blocking=*/staged.is_cuda());
    traffic_->to_device += static_cast<int64_t>(host_.nbytes());
    return staged;
  }

#if TIDEPOOL_HAVE_CUDA
  c10::cuda::CUDAStream compute_stream() const {
    return c10::cuda::getCurrentCUDAStream(options().device().index());
  }
  at::cuda::CUDAEvent host_ready_;    // after the last write of host_
  at::cuda::CUDAEvent staged_ready_;  // after the stage-in of staged_ (or of the acquired one)
  at::cuda::CUDAEvent released_;      // the end of the last use on the compute stream
#endif
  std::shared_ptr<HostStagedPlacement::Traffic> traffic_;
  std::optional<StagingStreams> streams_;  // CUDA state only
  torch::Tensor host_;
  torch::Tensor staged_;  // filled by prefetch, handed out by the next acquire
};

}  // namespace

std::unique_ptr<StateBuffer> StatePlacement::create_zeros(at::IntArrayRef sizes,
                                                          const torch::TensorOptions& options) {
  return create(torch::zeros(sizes, options));
}

std::unique_ptr<StateBuffer> ResidentPlacement::create(const torch::Tensor& initial) {
  return std::make_unique<ResidentBuffer>(initial.clone(at::MemoryFormat::Contiguous));
}

std::unique_ptr<StateBuffer> ResidentPlacement::create_zeros(at::IntArrayRef sizes,
                                                             const torch::TensorOptions& options) {
  return std::make_unique<ResidentBuffer>(torch::zeros(sizes, options));
}

struct HostStagedPlacement::CopyStreams {
#if TIDEPOOL_HAVE_CUDA
  std::mutex mutex;
  std::unordered_map<c10::DeviceIndex, StagingStreams> by_device;
#endif
};

HostStagedPlacement::HostStagedPlacement() : streams_(std::make_unique<CopyStreams>()) {}
HostStagedPlacement::~HostStagedPlacement() = default;

namespace {

// The placement's copy streams for state on `device` (none for CPU state).
std::optional<StagingStreams> staging_streams(HostStagedPlacement::CopyStreams& streams,
                                              const torch::Device& device) {
#if TIDEPOOL_HAVE_CUDA
  if (!device.is_cuda()) return std::nullopt;
  const c10::DeviceIndex index =
      device.has_index() ? device.index() : c10::cuda::current_device();
  std::lock_guard lock(streams.mutex);
  auto it = streams.by_device.find(index);
  if (it == streams.by_device.end()) {
    // High priority: a copy feeds the compute stream's next kernel. From the pool, which
    // lives as long as the process (so do any events recorded on these streams).
    it = streams.by_device
             .emplace(index, StagingStreams{c10::cuda::getStreamFromPool(true, index),
                                            c10::cuda::getStreamFromPool(true, index)})
             .first;
  }
  return it->second;
#else
  (void)streams;
  (void)device;
  return std::nullopt;
#endif
}

}  // namespace

std::unique_ptr<StateBuffer> HostStagedPlacement::create(const torch::Tensor& initial) {
  return std::make_unique<HostStagedBuffer>(initial, traffic_,
                                            staging_streams(*streams_, initial.device()));
}

std::unique_ptr<StateBuffer> HostStagedPlacement::create_zeros(
    at::IntArrayRef sizes, const torch::TensorOptions& options) {
  return std::make_unique<HostStagedBuffer>(sizes, options, traffic_,
                                            staging_streams(*streams_, options.device()));
}

std::shared_ptr<StatePlacement> default_placement() {
  return std::make_shared<ResidentPlacement>();
}

}  // namespace tidepool::optim
