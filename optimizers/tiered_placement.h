// TieredPlacement: optimizer state kept in tiering/'s TieredStore — in host memory, on the
// compute device only while acquired (or prefetched), under the store's device budget.
// The third StatePlacement (see state_placement.h for the protocol).
//
// The store's backend must match the compute device of the tensors: the host backend for
// CPU tensors (its "device" memory is host memory that LibTorch reads through from_blob),
// the cuda backend of the same GPU for CUDA tensors. The copies run on `stream`:
//   - CPU tensors: acquire waits for the stream before handing out the tensor (LibTorch CPU
//     ops run on the calling thread), so results cannot depend on the copies' timing;
//   - CUDA tensors: pass LibTorch's current stream (its cudaStream_t as Stream::handle) so
//     the kernels are ordered after the store's copies.
// Placement does not round or reorder arithmetic: trajectories are bitwise identical to
// ResidentPlacement (tested on the host backend with a budget that forces evictions).
#pragma once

#include <memory>
#include <string>

#include <torch/torch.h>

#include "allocator/backend.h"
#include "allocator/export.h"
#include "optimizers/state_placement.h"
#include "tiering/tiered_store.h"

namespace tidepool::optim {

class TIDEPOOL_API TieredPlacement final : public StatePlacement {
 public:
  // `store` must outlive every buffer created here (the shared_ptr keeps it alive).
  TieredPlacement(std::shared_ptr<TieredStore> store, Stream stream = {},
                  int tag = TIDEPOOL_TAG_OPTIMIZER_STATE);

  std::unique_ptr<StateBuffer> create(const torch::Tensor& initial) override;
  std::string name() const override { return "tiered"; }
  TieredStore& store() const noexcept { return *store_; }

 private:
  std::shared_ptr<TieredStore> store_;
  Stream stream_;
  int tag_;
};

}  // namespace tidepool::optim
