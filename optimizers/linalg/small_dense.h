// Plain fp64 dense kernels for the k×k matrices (k ≤ ~32) that every lstsq solve ends in
// (internal to tidepool_optim). They exist because the fast path is latency-bound: one
// ATen op on a tiny CPU tensor costs microseconds of dispatch, and the Gram route's host
// solve took ~30 of them, more than the GPU pass over a 4,194,304×8 A (58 µs on the H200).
// Matrices are row-major std::vector<double>.
#pragma once

#include <vector>

namespace tidepool::linalg::detail::dense {

// Eigenvalues of the symmetric n×n matrix `a`, ascending. Cyclic Jacobi: absolute error
// ~eps64·‖a‖_F (the accuracy LAPACK's syevd gives), a few sweeps for n ≤ 32, for any
// finite `a` (scaled internally, so ‖a‖²_F may lie outside the fp64 range).
std::vector<double> symmetric_eigenvalues(std::vector<double> a, int n);

// Overwrites the lower triangle of the symmetric n×n `a` with L, a = L·Lᵀ (the strict upper
// triangle is left as it was). Returns false, like LAPACK potrf's info > 0, when a pivot is
// not positive (or not finite): a is not numerically positive definite.
bool cholesky_lower(std::vector<double>& a, int n);

// Solves L·Lᵀ·X = B in place for B n×r (row-major), L from cholesky_lower.
void cholesky_solve(const std::vector<double>& l, int n, std::vector<double>& b, int r);

}  // namespace tidepool::linalg::detail::dense
