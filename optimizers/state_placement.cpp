// The StateBuffer protocol checks and the two placements that need nothing from tiering/:
// state resident on the compute device, and state kept in host memory and staged onto the
// device around each use. See state_placement.h for the protocol.
#include "optimizers/state_placement.h"

#include <utility>

#include <torch/cuda.h>

namespace tidepool::optim {

// ---- StateBuffer: the protocol, checked once ---------------------------------------------

StateBuffer::StateBuffer(at::IntArrayRef sizes, torch::TensorOptions options)
    : sizes_(sizes.vec()), options_(std::move(options)) {}

void StateBuffer::prefetch() {
  if (!acquired_) do_prefetch();
}

torch::Tensor StateBuffer::acquire() {
  TORCH_CHECK(!acquired_, "tidepool: StateBuffer::acquire called twice without release");
  working_ = do_acquire();
  acquired_ = true;
  return working_;
}

void StateBuffer::release(bool dirty) {
  TORCH_CHECK(acquired_, "tidepool: StateBuffer::release without a matching acquire");
  do_release(working_, dirty);
  working_ = torch::Tensor();
  acquired_ = false;
}

torch::Tensor StateBuffer::read_host() const {
  TORCH_CHECK(!acquired_, "tidepool: StateBuffer::read_host while the buffer is acquired");
  return do_read_host();
}

namespace {

// ---- resident: the tensor is the state ----------------------------------------------------

class ResidentBuffer final : public StateBuffer {
 public:
  explicit ResidentBuffer(const torch::Tensor& initial)
      : StateBuffer(initial.sizes(), initial.options()),
        tensor_(initial.clone(at::MemoryFormat::Contiguous)) {}

 private:
  torch::Tensor do_acquire() override { return tensor_; }
  void do_release(torch::Tensor& working, bool /*dirty*/) override {
    // The working tensor is the storage itself: writes already landed.
    (void)working;
  }
  // Blocking: a non_blocking copy from the device would hand a checkpoint a pinned host
  // tensor the copy may not have filled yet (nothing else waits for it).
  torch::Tensor do_read_host() const override {
    return tensor_.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
  }

  torch::Tensor tensor_;
};

// ---- host staged: host copy + per-use staging tensor on the device ------------------------

class HostStagedBuffer final : public StateBuffer {
 public:
  HostStagedBuffer(const torch::Tensor& initial,
                   std::shared_ptr<HostStagedPlacement::Traffic> traffic)
      : StateBuffer(initial.sizes(), initial.options()), traffic_(std::move(traffic)) {
    auto host_options = initial.options().device(torch::kCPU);
    // Pinned memory lets the device copies run asynchronously on the current stream.
    if (initial.is_cuda()) host_options = host_options.pinned_memory(true);
    host_ = torch::empty(initial.sizes(), host_options);
    // Stream-ordered like every other copy here, so the host does not wait: the caller's
    // later work on the stream (overwriting or freeing `initial`), a stage_in of this
    // buffer and do_read_host's synchronize all come after it; PyTorch's pinned-memory
    // allocator keeps host_ until the copy is done even if this buffer goes first.
    host_.copy_(initial, /*non_blocking=*/initial.is_cuda());
  }

 private:
  void do_prefetch() override {
    if (!staged_.defined()) staged_ = stage_in();
  }
  torch::Tensor do_acquire() override {
    torch::Tensor staged = staged_.defined() ? staged_ : stage_in();
    staged_ = torch::Tensor();
    return staged;
  }
  void do_release(torch::Tensor& working, bool dirty) override {
    // Stream-ordered: a later stage_in of this buffer is queued after this copy.
    if (dirty) {
      host_.copy_(working, /*non_blocking=*/working.is_cuda());
      traffic_->to_host += static_cast<int64_t>(host_.nbytes());
    }
  }
  torch::Tensor do_read_host() const override {
    if (options().device().is_cuda()) {
      // Wait for write-backs still queued on the device stream.
      torch::cuda::synchronize(options().device().index());
    }
    return host_.clone();
  }

  torch::Tensor stage_in() const {
    torch::Tensor staged = torch::empty(sizes(), options());
    staged.copy_(host_, /*non_blocking=*/staged.is_cuda());
    traffic_->to_device += static_cast<int64_t>(host_.nbytes());
    return staged;
  }

  std::shared_ptr<HostStagedPlacement::Traffic> traffic_;
  torch::Tensor host_;
  torch::Tensor staged_;  // filled by prefetch, handed out by the next acquire
};

}  // namespace

std::unique_ptr<StateBuffer> ResidentPlacement::create(const torch::Tensor& initial) {
  return std::make_unique<ResidentBuffer>(initial);
}

std::unique_ptr<StateBuffer> HostStagedPlacement::create(const torch::Tensor& initial) {
  return std::make_unique<HostStagedBuffer>(initial, traffic_);
}

std::shared_ptr<StatePlacement> default_placement() {
  return std::make_shared<ResidentPlacement>();
}

}  // namespace tidepool::optim
