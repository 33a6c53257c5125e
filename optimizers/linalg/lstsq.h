// tidepool::linalg::lstsq — a least-squares dispatcher that gives the same answer on CPU
// and CUDA and is fast on the tall-skinny problems AADL solves (N up to 1e9 rows, k ≤ ~20).
//
// Why not at::linalg_lstsq: its CPU default (gelsy, rcond = eps·max(m,n)) truncates a
// well-conditioned 2e7×5 fp32 problem to rank 1, fp32 LAPACK drivers lose ~3e-2 to fp32
// accumulation over 2e7 rows, and its CUDA path (unpivoted QR) is slow, ignores rank, and
// fails outright at 16,777,216×8.
//
// How a problem is solved (LstsqMethod::automatic):
//   1. wide (N < k) or tiny (N·k ≤ options.svd_below_elements): minimum-norm SVD in fp64.
//   2. otherwise one pass over [A | B] forms its Gram matrix with fp64 accumulation (blocked
//      on the CPU, a CUDA kernel on the GPU); the k×k system is equilibrated and solved by
//      fp64 Cholesky on the host. Its eigenvalues give the condition estimate.
//   3. if κ(AᵀA) exceeds options.gram_condition_limit: shifted CholeskyQR3 on an fp64 copy
//      (accuracy ~κ(A)·eps64 instead of κ(A)²·eps64).
//   4. if R from step 3 says rank < k relative to rcond, or its Cholesky breaks down:
//      minimum-norm SVD: Householder QR of [A·D | B] (LAPACK on the CPU, cuSOLVER's 64-bit
//      Xgeqrf on the GPU, so N·k beyond 2³¹ works), then the SVD of the small R on the host.
// Every small solve runs in fp64 on the host, so CPU and CUDA differ only by the summation
// order of the Gram pass.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "allocator/export.h"

namespace tidepool::linalg {

enum class LstsqMethod {
  automatic,      // choose per problem, as described at the top of this file
  gram_cholesky,  // one Gram pass + fp64 Cholesky (fast; accuracy ~κ(A)²·eps64). Cannot
                  // truncate: forced, it throws std::runtime_error if AᵀA breaks down or
                  // the rank at max(rcond, √(10k·eps64)) is below k
  cholesky_qr,    // shifted CholeskyQR3 on an fp64 copy of A (accuracy ~κ(A)·eps64)
  svd,            // Householder QR of [A·D | B] (LAPACK geqrf / cuSOLVER 64-bit Xgeqrf),
                  // then the minimum-norm solution from the SVD of R, truncated at rcond
  gram_eigh,      // Gram pass + eigendecomposition: minimum-norm from AᵀA alone (what
                  // GramAccumulator falls back to; accuracy ~κ(A)²·eps64)
};

// "automatic", "gram_cholesky", "cholesky_qr", "svd" or "gram_eigh".
TIDEPOOL_API const char* method_name(LstsqMethod method);

struct LstsqOptions {
  LstsqMethod method = LstsqMethod::automatic;
  // Singular values below rcond·σ_max of the equilibrated A (with tikhonov, of the
  // regularised [A·D; √λ·D], see `tikhonov`) count as zero. Negative means the default
  // max(√k·eps(input dtype)/2, 10·√N·eps64): the data's precision (the 2-norm bound of
  // its rounding; fp32 κ ≤ 1e6 keeps full rank for k ≤ 20) or fp64's rounding over N
  // rows — deliberately not eps·N, which is what ruins gelsy. The Gram methods
  // (gram_cholesky, gram_eigh) cannot resolve σ/σ_max that small and apply
  // max(rcond, √(10k·eps64)) (≈ 1e-7); LstsqResult::rcond says what was applied.
  double rcond = -1.0;
  // Tikhonov λ: minimise ‖Ax − b‖² + λ‖x‖². With tikhonov_relative, λ is multiplied
  // by trace(AᵀA)/k, so λ = 1e-8 means "1e-8 of the average squared column norm". Every
  // method solves the regularised least-squares problem [A·D; √λ·D]·y ≈ [b; 0] (x = Dy), so
  // with λ > 0 the rank, the truncation at rcond and the condition estimate are its own.
  double tikhonov = 0.0;
  bool tikhonov_relative = true;
  // Scale columns of A to unit norm before factorising: with D = diag(1/‖a_j‖) the problem
  // solved is min ‖(AD)y − b‖ and x = Dy. The rank, the truncation at rcond and the
  // condition estimate are all those of AD, so for a rank-deficient or truncated problem
  // the solution returned is the one with minimum ‖y‖ = ‖D⁻¹x‖ (minimum norm in
  // unit-column variables, as LAPACK-style equilibrated solvers do), not minimum ‖x‖.
  // false: D = I, and the solution is the true minimum-‖x‖ one (for exactly dependent
  // columns of different norms, [a, 2a], the two differ: x ∝ (2, 1) with, (1, 2) without;
  // Note [Minimum norm with equilibration] in small_solve.cpp says why). With full rank and
  // nothing truncated the solution is unique and the two agree (up to rounding).
  bool equilibrate = true;
  // automatic leaves gram_cholesky when κ((AD)ᵀAD) exceeds this, D the equilibration (I
  // when equilibrate is off). The Gram route's error is ~κ(AᵀA)·eps64, so negative means
  // the default 1e7 for fp32 input (error far below the data's eps32) and 1e4 for fp64
  // input (error ≲ 1e-11, and CPU and CUDA, which sum the Gram matrix in different
  // orders, agree to ~1e-12).
  double gram_condition_limit = -1.0;
  // automatic uses SVD directly when N·k is at most this.
  int64_t svd_below_elements = 4096;
  // The Gram method gets the residual from the Gram matrix for free, r² = bᵀb − 2xᵀAᵀb +
  // xᵀAᵀAx, but that is a cancellation: r² carries an absolute error of
  // ~√N·eps64·(‖b‖ + ‖A‖_F‖x‖)², so r is reliable only well above
  // √(√N·eps64)·(‖b‖ + ‖A‖_F‖x‖) (~3e-7 of that scale at N = 2e5); a nearly
  // consistent system reports noise of that size. true spends one more pass over A for
  // b − Ax computed directly in fp64. (That pass is also taken, whatever this says, for a
  // right-hand side whose squares underflow fp64, ‖b‖² < N·DBL_MIN: bᵀb is lost then.)
  bool exact_residual = false;
};

struct LstsqResult {
  at::Tensor solution;        // k (B was 1-D) or k×r; dtype and device of the input
  LstsqMethod method = LstsqMethod::automatic;  // the method that produced the solution
  const char* method_name = "";  // method_name(method)
  // Numerical rank of A (equilibrated, if on; with tikhonov, of [A·D; √λ·D]) at `rcond`: the
  // number of singular directions the solution keeps. gram_cholesky always solves with all
  // k, so it returns only rank k.
  int64_t rank = 0;
  // Estimate of κ₂(A) after equilibration (with tikhonov, of [A·D; √λ·D]); inf if singular.
  double condition = 0.0;
  double rcond = 0.0;            // the threshold on σ/σ_max actually applied (see options)
  // ‖b_j − A x_j‖₂ per right-hand side, for x_j as returned (for fp32 input: the solution
  // rounded to fp32, not the fp64 one it came from); +inf where x_j overflowed the dtype.
  std::vector<double> residual_norms;
  double residual_norm = 0.0;  // Frobenius norm of B − AX
};

// Solves min ‖A X − B‖ for A (N×k) and B (N or N×r): fp32 or fp64 (both the same), both on
// the same device (CPU or CUDA), dense (strided; any strides). Throws
// std::invalid_argument for empty, mismatched, non-finite, unsupported-dtype, sparse or
// mixed-device input, for options.rcond >= 1 (and for finite input whose squares
// overflow fp64 where a method needs them: the Gram pass, a relative tikhonov). Squares
// that underflow cannot be resolved by the Gram pass either: when a column of A is not zero
// but ‖a_j‖² < N·DBL_MIN (fp64 entries ≲ 1e-154), automatic solves by the SVD and the
// forced gram_cholesky, cholesky_qr and gram_eigh throw std::invalid_argument; so do
// automatic and the forced gram_cholesky and gram_eigh when a column of B is that small
// beside A, ‖a_j‖·‖b‖ < N·DBL_MIN (AᵀB's products underflow; cholesky_qr does not form
// them).
// No autograd: the solution never requires grad, whatever A and B do, on every route.
TIDEPOOL_API LstsqResult lstsq(const at::Tensor& A, const at::Tensor& B,
                               const LstsqOptions& options = {});

// The same problem with A given as k column vectors of length N (each may live anywhere on
// one device, e.g. pinned host memory, and need not be adjacent). The Gram pass reads the
// columns chunk by chunk and never stacks them; only the ill-conditioned fallbacks
// (cholesky_qr, svd) build an fp64 N×k copy.
TIDEPOOL_API LstsqResult lstsq_columns(const std::vector<at::Tensor>& columns,
                                       const at::Tensor& B,
                                       const LstsqOptions& options = {});

}  // namespace tidepool::linalg
