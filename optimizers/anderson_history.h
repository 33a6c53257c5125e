// AndersonHistory: AADL's ring buffer of flattened parameter vectors x_0 … x_{m−1}, with the
// small matrices Anderson acceleration solves kept up to date incrementally.
//
// With DX_i = x_{i+1} − x_i and DR_j = DX_{j+1} − DX_j (j = 0 … k−1, k = m − 2) and the
// right-hand side b = DX_{m−2} (the newest difference), the least-squares problem
//     γ = argmin ‖b − DR γ‖² + reg‖γ‖²
// needs only G = DRᵀDR (k×k) and c = DRᵀb (k). Both are kept in fp64:
//   push(x)            one streaming pass over the history computes ⟨DR_j, DR_new⟩ for every
//                      j (the one new row/column of G) and ⟨DR_j, b⟩ (b changed); evicting
//                      the oldest vector only drops G's first row/column.
//   replace_newest(x)  drops the newest DR column and pushes x (AADL's safeguard).
// Differences are formed in fp64 from the stored values, chunk by chunk; nothing N×N and
// no N×k matrix is ever built. The extrapolation, written as x_{m−1} + Σ_l u_l DX_l, is one
// more streaming pass (combine()).
//
// Storage and streaming. Each vector is stored as chunks of kStoreChunk elements, one
// StateBuffer each, in a StatePlacement (host memory by default, or the tiered store). A
// pass walks the chunk index: it acquires chunk c of every stored vector, hints the
// placement to prefetch chunk c+1 of every vector, computes, and releases chunk c — so the
// compute device holds about two chunks per vector (m · 2 · kStoreChunk elements), never
// m full vectors. Inside a chunk the arithmetic runs in sub-chunks of kComputeChunk
// elements in a fixed order, on the compute device, so where the history lives (and how
// it is chunked for storage) does not change any bit.
//
// Why not linalg::GramAccumulator: it keeps every column as a whole tensor it reads again
// for each new inner product, and its columns would be the k DR differences (a second
// depth × parameters copy). Here only the iterates x are stored, DR is formed in fp64 from
// them chunk by chunk, and each pass needs one chunk per vector on the device at a time.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "allocator/export.h"
#include "optimizers/state_placement.h"

namespace tidepool::optim {

class TIDEPOOL_API AndersonHistory {
 public:
  // Elements per stored chunk (one StateBuffer), and per step of the arithmetic inside one.
  static constexpr int64_t kStoreChunk = int64_t{1} << 20;
  static constexpr int64_t kComputeChunk = int64_t{1} << 18;
  static_assert(kStoreChunk % kComputeChunk == 0, "sub-chunks must tile a stored chunk");

  AndersonHistory(int64_t depth, std::shared_ptr<StatePlacement> placement);

  // x: a 1-D tensor on the compute device; all pushes must agree in length, dtype, device.
  void push(const torch::Tensor& x);
  void replace_newest(const torch::Tensor& x);

  int64_t size() const noexcept { return static_cast<int64_t>(columns_.size()); }
  int64_t depth() const noexcept { return depth_; }
  // G = DRᵀDR and c = DRᵀb as fp64 CPU tensors (k×k and k; k = size() − 2, empty below 3).
  const torch::Tensor& gram() const noexcept { return gram_; }
  const torch::Tensor& rhs() const noexcept { return rhs_; }

  // x_{m−1} + Σ_l u_l·DX_l for u (fp64 CPU, size() − 1 entries), in the history's dtype on
  // the compute device.
  torch::Tensor combine(const torch::Tensor& u) const;
  // The newest vector (a copy on the compute device).
  torch::Tensor newest() const;

  // Every stored vector (CPU copies, oldest first), for saving; restore() takes them back
  // with the matrices that were saved alongside.
  std::vector<torch::Tensor> read_host() const;
  void restore(const std::vector<torch::Tensor>& vectors, const torch::Tensor& gram,
               const torch::Tensor& rhs, const torch::TensorOptions& compute);

  // The length of the stored vectors (0 while empty and never pushed).
  int64_t length() const noexcept { return length_; }
  const StatePlacement& placement() const noexcept { return *placement_; }

  // One stored vector: its chunks in order.
  using Column = std::vector<std::unique_ptr<StateBuffer>>;

 private:
  void drop_newest_column();
  void append(const torch::Tensor& x);
  void update_matrices();
  Column store(const torch::Tensor& x) const;

  int64_t depth_;
  std::shared_ptr<StatePlacement> placement_;
  std::deque<Column> columns_;
  int64_t length_ = 0;
  torch::Tensor gram_;  // fp64 CPU, k×k
  torch::Tensor rhs_;   // fp64 CPU, k
};

}  // namespace tidepool::optim
