// TieredPlacement: optimizer state kept in tiering/'s TieredStore — in host memory, on the
// compute device only while acquired (or prefetched), under the store's device budget.
// The third StatePlacement (see state_placement.h for the protocol).
//
// The store's backend must match the compute device of the tensors: the host backend for
// CPU tensors (its "device" memory is host memory that LibTorch reads through from_blob),
// the cuda backend of the same GPU for CUDA tensors. Which stream the state is used on:
//   - CUDA tensors: LibTorch's current CUDA stream at each prefetch/acquire (the stream the
//     optimizer's kernels are about to run on), so kernels are ordered after the store's
//     H2D copies and the write-back after the kernels, by events, without a host wait;
//   - CPU tensors: `host_stream` (default: the backend's default stream); acquire waits for
//     it before handing out the tensor, since LibTorch CPU ops run on the calling thread.
//
// The pipeline an optimizer gets (Apollo brackets its step with begin_step/end_step):
//   - the store records the order of acquires in the first step and, in every later step,
//     each acquire prefetches the handles that come next in that order on the store's H2D
//     stream, as many as the device budget holds (back-pressure, never an OOM);
//   - write-back: with WriteBack::on_release, release(dirty) evicts at once: the copy back
//     is enqueued on the store's D2H stream after an event on the use stream and release
//     returns without waiting, so parameter i−1's write-back runs while i is computed and
//     i+1 is loaded; the buffer is handed to the next load of the same size in stream
//     order. With on_demand the state stays on the device until the store needs the room
//     (furthest next use first). automatic (the default) picks on_release while the bytes
//     this placement holds exceed the store's budget (the state cannot all stay), else
//     on_demand (no traffic at all once everything is resident).
// Creating a buffer (Note [Creating on the device] in tiered_placement.cpp):
//   - create_zeros: the store's new handles are zeros in host memory: nothing is copied;
//   - create(initial) of a CUDA tensor: the handle is made on the device and `initial` is
//     copied into it there, on the current stream, then it is written back (on the
//     store's D2H stream, without a host wait) or kept, as a release would; if the budget
//     has no room for it now, through host memory as below;
//   - create(initial) of a CPU tensor: `initial` is written into the handle's host memory.
//   set_initial_copy(InitialCopy::on_device) takes the device route for CPU tensors too
//   (the host backend's tests run it that way).
// Overwriting a buffer (StateBuffer::overwrite; AADL's history writes each new vector
// over the buffers of one it dropped, Note [Reusing dropped columns] in
// anderson_history.h): the same routes into the handle the buffer has, with no handle
// created or destroyed, so no host block allocated, zeroed and freed:
//   - through host memory: the store's write() of the host bytes (drops any device copy);
//   - on the device: the handle is acquired on the use stream without loading its old
//     contents (TieredStore::acquire_to_overwrite), filled there and released dirty,
//     then written back or kept as for create (Note [Overwriting on the device] in
//     tiered_placement.cpp).
// peak_device_bytes(): the most device memory the store held, sampled after every
// prefetch and acquire made through this placement and every buffer created on the
// device (the only calls that allocate device memory), since construction or the last
// reset_peak_device_bytes(): for a store used by one optimizer, the staging windows of
// the pipeline.
// pageable_bytes(): bytes of this placement's live buffers whose host copy the store had
// to put in pageable memory (its pinned budget spent, or pinning refused): every copy of
// those runs at pageable speed and does not overlap (HostArenaOptions, the store's
// pinned budget and its RLIMIT_MEMLOCK cap). 0 is what a training run wants.
// acquire_wait_seconds(): host time spent inside acquire() of this placement's buffers
// (the store's acquire plus, for CPU tensors, the wait for the stage-in): what loading
// ahead of use saves. On CUDA an acquire only enqueues a wait, so this stays near zero
// unless the budget makes the store wait for room.
//
// Placement does not round or reorder arithmetic: trajectories are bitwise identical to
// ResidentPlacement (tested on the host backend with a budget that forces evictions).
// Several optimizers may share one store, and so one device budget (a GAN's two, Apollo
// inside AADL): each placement brackets its steps with its own schedule key, so each
// records and replays its own acquire order, and the store looks ahead across them in
// the order their steps ran: the end of one optimizer's step prefetches the start of
// the next one's (prefetch_policy.h). Their steps must not run concurrently.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "allocator/backend.h"
#include "allocator/export.h"
#include "optimizers/state_placement.h"
#include "tiering/tiered_store.h"

namespace tidepool::optim {

enum class WriteBack { automatic, on_release, on_demand };
// How create(initial) brings `initial` into the store (see above): automatic is on the
// device for CUDA tensors and through host memory for CPU tensors.
enum class InitialCopy { automatic, through_host, on_device };

TIDEPOOL_API const char* to_string(WriteBack mode);

class TIDEPOOL_API TieredPlacement final : public StatePlacement {
 public:
  // What the buffers of one placement share with it.
  struct Shared {
    std::atomic<std::size_t> live_bytes{0};       // bytes of all live buffers
    std::atomic<std::size_t> pageable_bytes{0};   // ... whose host copy is pageable
    std::atomic<std::size_t> peak_device_bytes{0};
    std::atomic<std::int64_t> acquire_wait_ns{0};
    // Buffers created from a tensor on the device / through host memory (see above).
    std::atomic<std::uint64_t> created_on_device{0};
    std::atomic<std::uint64_t> created_through_host{0};
    // Buffers overwritten (StateBuffer::overwrite) on the device / through host memory.
    std::atomic<std::uint64_t> overwritten_on_device{0};
    std::atomic<std::uint64_t> overwritten_through_host{0};
    // The placement's set_initial_copy, which its buffers' overwrite() follows too.
    std::atomic<InitialCopy> initial_copy{InitialCopy::automatic};
  };

  // `store` must outlive every buffer created here (the shared_ptr keeps it alive).
  TieredPlacement(std::shared_ptr<TieredStore> store, Stream host_stream = {},
                  int tag = TIDEPOOL_TAG_OPTIMIZER_STATE,
                  WriteBack write_back = WriteBack::automatic);
  // Retires this placement's schedule in the store (TieredStore::retire_schedule). Not
  // copyable: a copy would share the schedule key, and the first to go would retire it.
  ~TieredPlacement() override;
  TieredPlacement(const TieredPlacement&) = delete;
  TieredPlacement& operator=(const TieredPlacement&) = delete;

  std::unique_ptr<StateBuffer> create(const torch::Tensor& initial) override;
  std::unique_ptr<StateBuffer> create_zeros(at::IntArrayRef sizes,
                                            const torch::TensorOptions& options) override;
  std::string name() const override { return "tiered"; }
  // Creating a handle allocates and zeroes a host block, destroying it frees the block.
  bool reuse_dropped_buffers() const override { return true; }
  // More than the store's device budget cannot be acquired at once.
  std::optional<std::size_t> held_at_once_limit() const override {
    return store_->device_budget_bytes();
  }
  void set_initial_copy(InitialCopy mode) noexcept { shared_->initial_copy = mode; }
  InitialCopy initial_copy() const noexcept { return shared_->initial_copy.load(); }
  // The store's recorded schedule (see the top of this file).
  void begin_step() override { store_->begin_step(schedule_key_); }
  void end_step() override { store_->end_step(); }

  TieredStore& store() const noexcept { return *store_; }
  WriteBack write_back() const noexcept { return write_back_; }
  std::size_t live_bytes() const noexcept { return shared_->live_bytes.load(); }
  std::size_t pageable_bytes() const noexcept { return shared_->pageable_bytes.load(); }
  const Shared& counters() const noexcept { return *shared_; }
  std::size_t peak_device_bytes() const noexcept { return shared_->peak_device_bytes.load(); }
  void reset_peak_device_bytes() { shared_->peak_device_bytes = store_->device_bytes(); }
  double acquire_wait_seconds() const noexcept {
    return static_cast<double>(shared_->acquire_wait_ns.load()) * 1e-9;
  }

 private:
  std::shared_ptr<TieredStore> store_;
  Stream host_stream_;
  int tag_;
  WriteBack write_back_;
  std::uint64_t schedule_key_;  // this placement's schedule in the store, unique in the process
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
};

}  // namespace tidepool::optim
