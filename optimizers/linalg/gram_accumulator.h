// GramAccumulator: the Gram matrix of a ring buffer of column vectors, kept up to date one
// column at a time, and the small least-squares solve on top of it. Made for AADL.
//
// How AADL uses it. AADL keeps the last `history_depth` flattened iterates X; with
// DX = diff(X) and DR = diff(DX) it solves γ = argmin ‖DX[:,-1] − DR·γ‖²
// (+ reg·‖γ‖²). Give the accumulator capacity = the number of columns you keep (e.g. the DR
// columns plus DX[:,-1]) and treat its slots as your ring buffer: each step, overwrite the oldest
// slot with set_column(slot, new_column) — that one call computes the new column's fp64
// inner products with every live column (reading the new column and each live column
// once; nothing else is recomputed) — then call solve(a_slots, b_slot, options) with the
// slots in the order your γ uses. replace_column semantics fall out: set_column on a live
// slot replaces it (AADL's "keep x and replace the newest history column").
//
// Columns may live on the CPU (e.g. pinned host memory of the tiered store) or on one
// CUDA device; all must share length, dtype (fp32/fp64) and device. The accumulator keeps
// a reference to each column (no copy) so that later inner products can read it:
// do not modify a column in place after set_column — call set_column again instead.
//
// Thread safety: none; one accumulator per optimizer group, used from one thread.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "allocator/export.h"
#include "optimizers/linalg/lstsq.h"

namespace tidepool::linalg {

class TIDEPOOL_API GramAccumulator {
 public:
  // capacity: the number of slots (columns kept at once), ≥ 1.
  explicit GramAccumulator(int64_t capacity);

  int64_t capacity() const { return capacity_; }
  int64_t live_columns() const;
  bool has_column(int64_t slot) const;
  const at::Tensor& column(int64_t slot) const;

  // Puts `column` (1-D) in `slot`, adding or replacing, and computes ⟨column, c⟩ in fp64 for
  // itself and every other live column c. Throws std::invalid_argument for a bad slot, a
  // column that is not 1-D / fp32-fp64 / finite, or one whose length, dtype or device
  // differs from the live columns'. On error the accumulator is unchanged.
  void set_column(int64_t slot, const at::Tensor& column);
  // Empties `slot` (its row and column of the Gram matrix are forgotten).
  void remove_column(int64_t slot);
  void clear();

  // Recomputes every inner product from the stored columns in one Gram pass. set_column
  // is exact (each entry is a fresh fp64 inner product, not an update of an old one), so
  // this is only needed if columns were changed in place against the rule above.
  void recompute();

  // ⟨column(a), column(b)⟩; both slots must be live.
  double inner_product(int64_t a, int64_t b) const;
  // The Gram matrix of the given live slots, in that order, as fp64 CPU.
  at::Tensor gram(const std::vector<int64_t>& slots) const;

  // Solves min ‖Σ_j y_j·column(a_slots[j]) − column(b_slot)‖² + λ‖y‖² (λ from
  // options.tikhonov) and returns y as a 1-D fp64 CPU tensor in a_slots' order.
  // automatic / gram_cholesky / gram_eigh use the Gram matrix only (no pass over the
  // columns): automatic tries the equilibrated Cholesky and, if κ(AᵀA) is above
  // options.gram_condition_limit or AᵀA is singular, returns the minimum-norm solution
  // from its eigendecomposition (method gram_eigh; minimum norm in the equilibrated
  // variables when options.equilibrate, as lstsq.h describes). cholesky_qr and svd read the columns
  // again through lstsq_columns (and return the columns' dtype and device). A column of
  // a_slots whose squares underflow fp64 (not zero, ‖c‖² < N·DBL_MIN: fp64 entries
  // ≲ 1e-154) is not in the Gram matrix to any accuracy: automatic then solves by the SVD
  // from the columns (y still fp64 CPU), the forced gram_cholesky and gram_eigh throw
  // std::invalid_argument naming the slot; a right-hand side that small has its residual
  // measured from the columns (Note [Underflowing squares] in lstsq.cpp), as is any with
  // options.exact_residual. Options are
  // checked as lstsq checks them, and refused with the same std::invalid_argument message.
  LstsqResult solve(const std::vector<int64_t>& a_slots, int64_t b_slot,
                    const LstsqOptions& options = {}) const;

 private:
  void check_slot(int64_t slot, const char* what) const;
  void check_live(int64_t slot, const char* what) const;
  double& entry(int64_t a, int64_t b) { return gram_[static_cast<size_t>(a * capacity_ + b)]; }
  double entry(int64_t a, int64_t b) const { return gram_[static_cast<size_t>(a * capacity_ + b)]; }

  int64_t capacity_;
  std::vector<at::Tensor> columns_;  // undefined tensor = empty slot
  std::vector<double> gram_;            // capacity × capacity, symmetric, row-major
};

}  // namespace tidepool::linalg
