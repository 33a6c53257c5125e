// The Gram pass of lstsq: inner products of a set of column vectors with fp64 accumulation,
// read chunk by chunk (internal to tidepool_optim).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace tidepool::linalg::detail {

// G[a][b] = ⟨columns[a], columns[b]⟩ as an m×m fp64 CPU tensor. The columns are 1-D tensors
// of one length, dtype and device (strided views are fine: a column of a row-major matrix
// is one). CPU: one threaded loop over the raw columns (gram_cpu.cpp). CUDA: one kernel
// pass (m ≤ 16) or chunked fp64 cuBLAS. Never materialises more than one block of rows.
at::Tensor gram_of_columns(const std::vector<at::Tensor>& columns);

// ⟨v, columns[j]⟩ for every j as an fp64 CPU tensor, read in blocks of rows, fp64
// accumulation. Same requirements as gram_of_columns.
at::Tensor dots_with(const at::Tensor& v, const std::vector<at::Tensor>& columns);

// ‖b_j − Σ_i x_ij a_i‖₂ for every column b_j of `b_columns`, computed directly in fp64
// blocks of rows (one more read of the columns), without underflow or overflow for finite
// values (each block is rescaled before squaring). x is k×r fp64 (any device).
std::vector<double> direct_residual_norms(const std::vector<at::Tensor>& a_columns,
                                          const std::vector<at::Tensor>& b_columns,
                                          const at::Tensor& x);

// The first of `columns` that is not zero but whose squares underflowed fp64
// (‖c_j‖² < N·DBL_MIN, entries ≲ 1.5e-154; Note [Underflowing squares] in lstsq.cpp), or
// -1. `G` is the Gram matrix the columns' diagonal entries are in, from entry `first` on.
// Only a column that small is read again, to tell a zero column (which G represents
// exactly) from a tiny one.
int64_t underflowing_column(const std::vector<at::Tensor>& columns, const at::Tensor& G,
                            int64_t first);

// The first column of `b_columns` whose products with a nonzero column of `a_columns`
// underflow fp64 (‖a_j‖·‖b_c‖ < N·DBL_MIN: the entries of AᵀB are then subnormal, wrong by
// percents, or 0; Note [Underflowing squares] in lstsq.cpp), or -1. Possible only for a
// right-hand side whose own squares underflowed (underflowing_column), the only case that
// reads the columns again. `G` is the Gram matrix of [A | B].
int64_t underflowing_cross_products(const std::vector<at::Tensor>& a_columns,
                                    const std::vector<at::Tensor>& b_columns,
                                    const at::Tensor& G);

// Columns of a 2-D matrix as strided 1-D views (no copy).
std::vector<at::Tensor> columns_of(const at::Tensor& matrix);

}  // namespace tidepool::linalg::detail
