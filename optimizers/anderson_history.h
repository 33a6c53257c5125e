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
// m full vectors. Chunk 0 is loaded before the pass (Note [Loading the history ahead of
// use]). The pass that push() and replace_newest() run reads the vector just stored from
// the caller's tensor, still on the compute device, instead of loading it back, and so does
// the extrapolation (combine()) when its caller passes that tensor (AADL does, in a step
// that stored): with the history in host memory an accelerated step brings 8(m − 1) bytes
// per fp32 parameter to the device instead of 8m — only what must cross the link, the
// m − 1 older vectors for each of the two passes. Inside a chunk the arithmetic runs in
// sub-chunks of compute_chunk(device) elements in a fixed order, on the compute device, so
// where the history lives (and how it is chunked for storage, and when it is loaded) does
// not change any bit. The sub-chunk depends on the compute device alone (Note [Sub-chunks
// per device]).
//
// Note [Sub-chunks per device]
// Each sub-chunk costs about twenty LibTorch calls (views, stack, the fp64 conversion, two
// differences, two matrix-vector products, the accumulations). On the CPU they are worth
// their cost: 2^18-element temporaries stay near the cache. On CUDA each call is a few
// microseconds of host time for a few microseconds of device work at 2^18 elements: a
// step over 2^28 parameters made two passes of 1024 sub-chunks, some 40,000 host-bound
// calls, of the order of the 173 ms the resident history took per step on the H200
// (bench/RESULTS.md, 2026-12-04; an estimate from the call count, not a profile). A whole
// stored chunk per sub-chunk makes that a quarter. Changing the sub-chunk changes the
// order of the fp64 sums, so the device's bits differ from those of earlier builds
// (placements still agree bit for bit: they share it).
//
// Note [Loading the history ahead of use]
// A pass needs chunk c of every vector at once (the arithmetic stacks them), so while it
// computes chunk c it can load chunk c+1, but chunk 0 must be loaded before the pass —
// and when each vector is a single chunk (every group under kStoreChunk parameters),
// chunk 0 is everything: prefetching only c+1 loaded nothing ahead (0 prefetch hits, every
// acquire waited for its load). So the first chunk of every vector a pass reads is loaded
// as early as its reader knows the pass will come:
//   - AADL::step, on entry, before the inner optimizer steps (with a closure, that step
//     runs the forward and backward pass): prefetch(the step's first pass), so the loads
//     overlap the whole forward/backward and the inner update;
//   - AADL's safeguard, before its two closure calls (two forward passes):
//     prefetch(Pass::after_replace_newest). If the candidate is rejected, no pass follows
//     in this step: the chunks stay loaded (within the budget) and the next step's first
//     pass, which reads the same vectors, finds them there — all but the oldest when the
//     history is full, which the next push drops (its chunk was loaded for nothing: the
//     price of having the replace pass's first vector ready when the candidate is kept);
//   - every pass, before its first acquire, prefetches chunk 0 of each vector it reads, in
//     the order it reads them: a no-op for chunks already loaded ahead; anything not
//     hinted loads back to back, so each acquire waits for its own chunk only (the vector
//     pushed just now is not loaded at all: the pass reads it from the caller's tensor).
// Not at the end of every step (which would also hide a forward/backward run outside
// step()): the optimizer does not know another step comes (evaluation, a checkpoint, the
// end of training), and the chunks would stay on the device between steps, in the memory
// the activations need, where a placement that writes back on release keeps the history
// in host memory between uses; step entry is the earliest point where a pass is certain.
// Not the store's recorded schedule (StepScope, as Apollo): the history's buffers change
// every step (a vector joins, the oldest goes), so a schedule recorded in one step names
// buffers that are gone a few steps later, while the history knows exactly which buffers
// each pass reads.
// Budget: a prefetch is a hint; the tiered store skips one that does not fit its budget
// (it never waits and never exceeds the budget), so loading ahead holds at most one chunk
// per vector, within the two a pass holds anyway (HostStagedPlacement, which has no
// budget, stages that one chunk per vector during the forward/backward: kStoreChunk
// elements at most). A step that throws leaves the loaded chunks unacquired, nothing
// acquired: the tiered store evicts them when it needs the room, or frees them with their
// vector; HostStagedPlacement, which has no eviction, keeps its staged chunk per vector
// (kStoreChunk elements each) until the next pass over it or until the vector goes.
//
// Note [Reusing dropped columns]
// push drops the oldest vector once the history is full, replace_newest drops the newest,
// and both then store a vector of the same length. In the tiered store a new column was
// a new handle per chunk, each a host block allocated and zeroed, and the dropped column's
// were destroyed: hundreds of blocks per step for a large model (the H200 run). Where the
// placement asks for it (StatePlacement::reuse_dropped_buffers), the dropped column is
// kept as a spare and the next vector stored is written over its buffers
// (StateBuffer::overwrite): once the ring has been full, a step creates and destroys no
// buffer. Not the column the same call drops: Note [A failed push] needs it intact until
// the new vector is in. So the placement holds at most depth + 1 columns, as it did while
// a push or a replacement ran. The spare is never read, prefetched or saved, and its
// contents are nobody's (a failed overwrite leaves it a spare). Bits do not change: every
// byte of the spare is written before any pass reads the column.
//
// Why not linalg::GramAccumulator: it keeps every column as a whole tensor it reads again
// for each new inner product, and its columns would be the k DR differences (a second
// depth × parameters copy). Here only the iterates x are stored, DR is formed in fp64 from
// them chunk by chunk, and each pass needs one chunk per vector on the device at a time.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "allocator/export.h"
#include "optimizers/state_placement.h"

namespace tidepool::optim {

class TIDEPOOL_API AndersonHistory {
 public:
  // Elements per stored chunk (one StateBuffer), and per step of the arithmetic inside one
  // on the CPU and on CUDA (Note [Sub-chunks per device]).
  static constexpr int64_t kStoreChunk = int64_t{1} << 20;
  static constexpr int64_t kComputeChunk = int64_t{1} << 18;
  static constexpr int64_t kComputeChunkCuda = kStoreChunk;
  static_assert(kStoreChunk % kComputeChunk == 0, "sub-chunks must tile a stored chunk");
  static_assert(kStoreChunk % kComputeChunkCuda == 0, "sub-chunks must tile a stored chunk");
  static int64_t compute_chunk(const torch::Device& device) {
    return device.is_cuda() ? kComputeChunkCuda : kComputeChunk;
  }

  AndersonHistory(int64_t depth, std::shared_ptr<StatePlacement> placement);

  // x: a 1-D tensor on the compute device; all pushes must agree in length, dtype, device.
  void push(const torch::Tensor& x);
  void replace_newest(const torch::Tensor& x);

  // The passes over the history, for prefetch(): the one push(x) and replace_newest(x)
  // run after storing x (when the history then holds ≥ 3 vectors), and combine().
  enum class Pass { after_push, after_replace_newest, combine };
  // A hint: starts loading the first stored chunk of every vector already stored that
  // `pass`, run next, will read, in the order it reads them (Note [Loading the history
  // ahead of use]); nothing when that pass would not run. Never changes a result.
  void prefetch(Pass pass) const;

  int64_t size() const noexcept { return static_cast<int64_t>(columns_.size()); }
  int64_t depth() const noexcept { return depth_; }
  // G = DRᵀDR and c = DRᵀb as fp64 CPU tensors (k×k and k; k = matrix_order(size())).
  const torch::Tensor& gram() const noexcept { return gram_; }
  // k for a history of `vectors` stored vectors: vectors − 2, 0 below 3.
  static int64_t matrix_order(int64_t vectors) noexcept {
    return vectors > 2 ? vectors - 2 : 0;
  }
  const torch::Tensor& rhs() const noexcept { return rhs_; }

  // x_{m−1} + Σ_l u_l·DX_l for u (fp64 CPU, size() − 1 entries), in the history's dtype on
  // the compute device.
  //   newest  when defined, the newest stored vector's contents on the compute device (the
  //           tensor just given to push() or replace_newest()): read from there instead of
  //           loaded back from the placement. It must hold the same bytes; only its shape,
  //           dtype and device are checked.
  //   out     when defined (same shape, dtype, device), the result is written there and out
  //           is returned; it may be `newest` itself (each part of it is read before that
  //           part is written), so a caller that no longer needs the plain iterate spends
  //           no second vector on the device.
  torch::Tensor combine(const torch::Tensor& u, const torch::Tensor& newest = {},
                        const torch::Tensor& out = {}) const;
  // The newest vector (a copy on the compute device).
  torch::Tensor newest() const;

  // Every stored vector (CPU copies, oldest first), for saving; restore() takes them back
  // with the matrices that were saved alongside.
  std::vector<torch::Tensor> read_host() const;
  void restore(const std::vector<torch::Tensor>& vectors, const torch::Tensor& gram,
               const torch::Tensor& rhs, const torch::TensorOptions& compute);
  // A new history of this one's depth and placement, restored from what was saved; this
  // one is left as it is. AADL::load builds every group's before it replaces any, so a
  // load that fails halfway (a bad group, a store out of room) changes no history.
  std::unique_ptr<AndersonHistory> restored(const std::vector<torch::Tensor>& vectors,
                                            const torch::Tensor& gram, const torch::Tensor& rhs,
                                            const torch::TensorOptions& compute) const;

  // The length of the stored vectors (0 while empty and never pushed).
  int64_t length() const noexcept { return length_; }
  // Whether a vector of `length` elements of `dtype` on `device` can be pushed: true while
  // the history is empty, else when it matches the stored vectors.
  bool accepts(int64_t length, c10::ScalarType dtype, const c10::Device& device) const;
  // "N elements of DTYPE on DEVICE" of the stored vectors; "nothing" while empty.
  std::string describe_vectors() const;
  const StatePlacement& placement() const noexcept { return *placement_; }

  // One stored vector: its chunks in order.
  using Column = std::vector<std::unique_ptr<StateBuffer>>;

 private:
  // What push and replace_newest put back when storing fails (Note [A failed push]).
  struct Rollback {
    torch::Tensor gram, rhs;
    int64_t length;
  };
  void drop_newest_column();
  void append(const torch::Tensor& x);
  // append(x); when it throws, removes what it added, calls put_back_dropped() and
  // restores `rollback`, then rethrows.
  template <class PutBackDropped>
  void append_or_roll_back(const torch::Tensor& x, const Rollback& rollback,
                           PutBackDropped put_back_dropped);
  void update_matrices(const torch::Tensor& newest);
  // x in chunks: written over the spare when it fits x, else in new buffers.
  Column store(const torch::Tensor& x);
  // A column no longer in the history becomes the spare (or goes, when the placement
  // does not reuse buffers): Note [Reusing dropped columns].
  void keep_spare(Column column) noexcept;

  int64_t depth_;
  std::shared_ptr<StatePlacement> placement_;
  std::deque<Column> columns_;
  Column spare_;  // empty when there is none
  int64_t length_ = 0;
  torch::Tensor gram_;  // fp64 CPU, k×k
  torch::Tensor rhs_;   // fp64 CPU, k
};

}  // namespace tidepool::optim
