// Where optimizer state lives: the small interface Apollo's per-parameter state and AADL's
// history go through, so the same optimizer code runs with its state resident on the
// compute device or kept elsewhere and brought in around each use.
//
// Protocol for one StateBuffer (written once, here):
//   prefetch()        a hint: start making the contents available on the compute device.
//                     It does not throw: a prefetch that fails is said once (a warning)
//                     and leaves the buffer as it was, for acquire() to load.
//   acquire()         returns a tensor on the compute device holding the contents; it stays
//                     valid until release(). At most one acquire is outstanding per buffer.
//   release(dirty)    ends the use; with dirty = true the tensor's contents are the new
//                     contents of the buffer (written back where the placement keeps them).
//   read_host()       a CPU copy of the contents (for saving), allowed when not acquired.
//   overwrite(t)      makes `t` (same shape, dtype and compute device) the contents,
//                     whatever they were, when not acquired: a buffer kept for reuse is
//                     written over where a new one would be created (AADL's history,
//                     Note [Reusing dropped columns] in anderson_history.h).
// Copies are ordered with the compute device's current stream (enqueued on it, or on copy
// streams that events tie to it), so a result never depends on where the state lives:
// placements move bytes, they do not round or reorder arithmetic.
//
// Step boundaries (StatePlacement::begin_step / end_step, or the StepScope guard): an
// optimizer brackets each step's acquires with them, in the same order every step, so a
// placement that learns the access order can replay it (TieredPlacement: the store records
// the first step's order and later prefetches ahead along it as far as its budget allows).
//
// Placements provided here:
//   ResidentPlacement    the state is a tensor on the compute device (acquire is free).
//   HostStagedPlacement  the state lives in host memory (pinned when the compute device is
//                        CUDA); acquire copies it into a staging tensor on the device, and
//                        release(dirty) copies it back and frees the staging tensor, so the
//                        device holds only the buffers currently acquired (and prefetched).
//                        On CUDA the copies run on two copy streams of the placement, one
//                        per direction (Note [Host-staged copy streams] in
//                        state_placement.cpp), so that a prefetch loads while the compute
//                        stream works and a write-back runs while the next buffer loads.
// And in tiered_placement.h:
//   TieredPlacement      the state lives in tiering/'s TieredStore: host memory, brought
//                        onto the device ahead of use and written back after it, under a
//                        device budget (kept there between steps when it all fits).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "allocator/export.h"

namespace tidepool::optim {

// One state tensor whose storage a placement owns. Non-virtual public interface (checks the
// acquire/release pairing once, here) over private hooks each placement implements.
class TIDEPOOL_API StateBuffer {
 public:
  StateBuffer(const StateBuffer&) = delete;
  StateBuffer& operator=(const StateBuffer&) = delete;
  virtual ~StateBuffer() = default;

  void prefetch();
  torch::Tensor acquire();
  void release(bool dirty);
  torch::Tensor read_host() const;
  // Replaces the contents with `contents`, ordered as StatePlacement::create orders its
  // copy (complete, or on the compute device's current stream, when it returns). If it
  // throws, the contents are unspecified: the buffer is still usable, to be written again.
  void overwrite(const torch::Tensor& contents);

  bool acquired() const noexcept { return acquired_; }
  const torch::TensorOptions& options() const noexcept { return options_; }
  at::IntArrayRef sizes() const noexcept { return sizes_; }

 protected:
  StateBuffer(at::IntArrayRef sizes, torch::TensorOptions options);

 private:
  virtual void do_prefetch() {}
  virtual torch::Tensor do_acquire() = 0;
  virtual void do_release(torch::Tensor& working, bool dirty) = 0;
  // Work that follows a release once the buffer is no longer acquired (a tiered buffer's
  // write-back on release). If it throws, the release stands: the contents are where
  // do_release left them, and the next acquire or read_host finds them there.
  virtual void do_after_release() {}
  virtual torch::Tensor do_read_host() const = 0;
  // Default: acquire, copy on the compute device, release dirty (what a placement without
  // a cheaper route does: a host-staged buffer loads its old contents first).
  virtual void do_overwrite(const torch::Tensor& contents);

  std::vector<int64_t> sizes_;
  torch::TensorOptions options_;  // dtype and compute device of the acquired tensor
  torch::Tensor working_;         // the tensor handed out by the outstanding acquire
  bool acquired_ = false;
};

// One acquire of a StateBuffer as a scope: release(dirty) ends it; if the scope is left
// first (an exception), the buffer is released unmodified, so a failed step leaves no
// buffer acquired.
class StateLease {
 public:
  explicit StateLease(StateBuffer& buffer) : buffer_(&buffer), tensor_(buffer.acquire()) {}
  // Not released (a scope left by an exception): released unmodified. After a release
  // that threw: that release once more (a dirty one keeps the update when the copy goes
  // through now), and if it fails again, a clean one, so that the buffer does not stay
  // acquired for good (its contents may then be a step behind; the error was thrown).
  ~StateLease() {
    if (buffer_ == nullptr) return;
    tensor_ = torch::Tensor();
    for (const bool dirty : {retry_dirty_, false}) {
      try {
        buffer_->release(dirty);
        return;
      } catch (...) {
        // A destructor does not throw; the buffer's owner reports the failure on next use.
      }
      if (!buffer_->acquired() || !dirty) return;
    }
  }
  StateLease(StateLease&& other) noexcept
      : buffer_(std::exchange(other.buffer_, nullptr)),
        tensor_(std::move(other.tensor_)),
        retry_dirty_(other.retry_dirty_) {}
  StateLease(const StateLease&) = delete;
  StateLease& operator=(const StateLease&) = delete;
  StateLease& operator=(StateLease&&) = delete;

  // The acquired contents on the compute device (undefined after release).
  const torch::Tensor& tensor() const noexcept { return tensor_; }
  // A release that throws leaves the buffer acquired (StateBuffer::release), so the lease
  // keeps it, and its destructor tries again (see there): let go of first, it would stay
  // acquired for good, and every later acquire would fail (review finding).
  void release(bool dirty) {
    TORCH_CHECK(buffer_ != nullptr, "tidepool: StateLease released twice");
    tensor_ = torch::Tensor();  // drop our view before the placement may move the bytes
    try {
      buffer_->release(dirty);
    } catch (...) {
      // Released all the same (a failed do_after_release): nothing left to end.
      if (!buffer_->acquired()) buffer_ = nullptr;
      retry_dirty_ = dirty;
      throw;
    }
    buffer_ = nullptr;
  }

 private:
  StateBuffer* buffer_;
  torch::Tensor tensor_;
  bool retry_dirty_ = false;  // the dirty flag of a release that threw, retried at the end
};

// Makes StateBuffers. create() returns a buffer holding `initial` (copied; shape, dtype and
// compute device taken from it). The copy is complete, or ordered on the compute device's
// current stream, when create() returns: the caller may then overwrite or free `initial`
// with work on that stream (AADL writes its extrapolation over the vector it just stored).
class TIDEPOOL_API StatePlacement {
 public:
  virtual ~StatePlacement() = default;
  virtual std::unique_ptr<StateBuffer> create(const torch::Tensor& initial) = 0;
  // What create(torch::zeros(sizes, options)) returns (options: dtype and compute device),
  // without that tensor: the placements here make the zeros where they keep the state
  // (a tiered store's buffers start as zeros in host memory), so a new optimizer's state
  // costs no device memory and no copy. Default: create() of the zeros.
  virtual std::unique_ptr<StateBuffer> create_zeros(at::IntArrayRef sizes,
                                                    const torch::TensorOptions& options);
  virtual std::string name() const = 0;
  // Whether an owner that drops buffers and soon needs like ones (AADL's history drops a
  // vector and stores one every step) should keep a dropped buffer and overwrite() it
  // instead of creating a new one: true where creating costs more than the memory kept
  // (TieredPlacement: a host block allocated and zeroed by the store, freed on destroy).
  // Default false: a kept buffer holds its memory between uses, and the placements here
  // get new buffers from caches (LibTorch's device and pinned-host allocators) that hand
  // the block just freed back for the next one anyway.
  virtual bool reuse_dropped_buffers() const { return false; }
  // Note [State held at once]: an optimizer that acquires several buffers together (Apollo:
  // a parameter's m, B and d) checks, before its step changes anything, that they fit in
  // what this returns: the most bytes of state that can be held at once (a tiered store's
  // device budget), or nullopt for no limit (the default). A step over it would refuse
  // its last acquire with the parameters before it already stepped, at every step.
  virtual std::optional<std::size_t> held_at_once_limit() const { return std::nullopt; }
  // Step boundaries (see the top of this file). Default: nothing to learn.
  virtual void begin_step() {}
  virtual void end_step() {}
};

// begin_step() now, end_step() when the scope ends, also when the step throws.
class StepScope {
 public:
  explicit StepScope(StatePlacement& placement) : placement_(placement) {
    placement_.begin_step();
  }
  ~StepScope() { placement_.end_step(); }
  StepScope(const StepScope&) = delete;
  StepScope& operator=(const StepScope&) = delete;

 private:
  StatePlacement& placement_;
};

class TIDEPOOL_API ResidentPlacement final : public StatePlacement {
 public:
  std::unique_ptr<StateBuffer> create(const torch::Tensor& initial) override;
  std::unique_ptr<StateBuffer> create_zeros(at::IntArrayRef sizes,
                                            const torch::TensorOptions& options) override;
  std::string name() const override { return "resident"; }
};

class TIDEPOOL_API HostStagedPlacement final : public StatePlacement {
 public:
  // Bytes copied host → compute device (stage-in) and back (write-back), over all buffers
  // this placement created; counted when the copy is issued.
  struct Traffic {
    std::atomic<int64_t> to_device{0};
    std::atomic<int64_t> to_host{0};
  };

  HostStagedPlacement();
  ~HostStagedPlacement() override;
  HostStagedPlacement(const HostStagedPlacement&) = delete;
  HostStagedPlacement& operator=(const HostStagedPlacement&) = delete;

  std::unique_ptr<StateBuffer> create(const torch::Tensor& initial) override;
  std::unique_ptr<StateBuffer> create_zeros(at::IntArrayRef sizes,
                                            const torch::TensorOptions& options) override;
  std::string name() const override { return "host_staged"; }
  const Traffic& traffic() const noexcept { return *traffic_; }

  // The copy streams of each CUDA device this placement staged state for (state_placement.cpp).
  struct CopyStreams;

 private:
  std::shared_ptr<Traffic> traffic_ = std::make_shared<Traffic>();
  std::unique_ptr<CopyStreams> streams_;
};

// The placement used when an optimizer is given none.
TIDEPOOL_API std::shared_ptr<StatePlacement> default_placement();

}  // namespace tidepool::optim
