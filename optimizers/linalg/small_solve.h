// The host-side fp64 solves shared by every lstsq method (internal to tidepool_optim): the
// k×k Gram system (Cholesky or eigendecomposition) and the minimum-norm solve from the
// R factor of [A·D | B]. Both CPU and CUDA inputs end here, which is why the two devices
// agree: everything after the one pass over A is the same fp64 code on the same host.
// Also the handling of LstsqOptions (checks, defaults, λ) that lstsq and GramAccumulator
// share, so that both accept and refuse the same options with the same words.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "optimizers/linalg/lstsq.h"

namespace tidepool::linalg::detail {

// A solution in fp64 on the host, before it is moved back to the input's device.
struct SmallSolution {
  // k×r fp64 CPU, in the caller's (unequilibrated) variables, already rounded to the output
  // dtype (see as_returned): casting it to that dtype is exact, and residual_norms are those
  // of the solution the caller receives.
  at::Tensor x;
  LstsqMethod method = LstsqMethod::automatic;
  int64_t rank = 0;
  double rcond = 0.0;  // the threshold on σ/σ_max actually applied (≥ the requested one)
  double condition = 0.0;
  std::vector<double> residual_norms;
};

// The 2-norm of each column of M (any device), computed without overflow or underflow
// for finite M (each column is divided by its largest magnitude before squaring). Inf only
// where the norm itself exceeds the fp64 range.
at::Tensor column_norms(const at::Tensor& M);

// 1/‖a_j‖ from the Gram diagonal (k fp64 CPU); all 1 when equilibration is off. A zero
// column (which stays zero and shows up as rank deficiency) gets the columns' mean scale,
// zero_column_scale (Note [Equilibration] in small_solve.cpp).
at::Tensor column_scales(const at::Tensor& gram_diagonal, bool equilibrate);
// A zero column's scale, from the root mean square of the column norms, √(trace(AᵀA)/k)
// (Note [Equilibration]).
double zero_column_scale(double rms_norm);

// The rcond used when options.rcond < 0: max(√k·eps(dtype)/2, 10·√N·eps64). The first
// term is the precision of the data (fp32 input is exact in fp64, but means no more than
// its rounding, whose 2-norm is at most √k·eps32/2 of σ_max: 2.7e-7 at k = 20, so κ ≤ 1e6
// keeps full rank); the second the rounding of an fp64 factorisation over N rows, below
// which an exactly singular A cannot be told from a merely ill-conditioned one. Never eps·N, which
// is what makes torch's gelsy cut a well-conditioned 2e7×5 fp32 problem to rank 1.
double resolve_rcond(const LstsqOptions& options, at::ScalarType dtype, int64_t rows, int64_t k);

// The name of t's layout ("Sparse", ...), for the refusal of a non-strided tensor, which
// lstsq and GramAccumulator both make: it has no data the Gram pass can read.
std::string layout_name(const at::Tensor& t);

// Throws std::invalid_argument, "<caller>: <what is wrong>", for options no method can
// honour (non-finite rcond, negative or non-finite tikhonov, gram_condition_limit 0 or NaN,
// negative svd_below_elements).
void check_options(const LstsqOptions& options, const char* caller);

// options with rcond and gram_condition_limit resolved for this dtype and size (the
// defaults documented in lstsq.h).
LstsqOptions resolve_defaults(const LstsqOptions& options, at::ScalarType dtype, int64_t rows,
                              int64_t k);

// λ in absolute terms: options.tikhonov, times trace(AᵀA)/k when relative. Every method
// gets its λ here, so all of them refuse alike (std::invalid_argument mentioning the
// overflow) a relative λ beyond the fp64 range: trace(AᵀA) can overflow while every G_jj
// is finite, and a λ of inf made some methods return x = 0 at rank 0.
double tikhonov_lambda(const LstsqOptions& options, double gram_trace, int64_t k);
// Column 2-norms (any dtype and device) as their largest and Σ(norm/largest)², so that
// ‖norms‖² = largest²·spread is had without squaring a norm: squares overflow above
// ~1.3e154 and underflow to 0 below ~1e-162. spread is 0 when largest is not positive.
struct NormSpread {
  double largest = 0.0;
  double spread = 0.0;
};
NormSpread norm_spread(const at::Tensor& column_norms);
// √λ from A's column norms (norm_spread): what the R-factor paths stack under R, so that
// a relative λ does not underflow to 0 for tiny columns. Refuses an overflow as
// tikhonov_lambda does.
double tikhonov_root(const LstsqOptions& options, const NormSpread& norms, int64_t k);

// Rounds x (a fresh, contiguous fp64 CPU tensor, modified in place and returned) to the
// dtype the caller will receive (fp32 or fp64; fp64 leaves it alone): LstsqResult's
// residual_norms are ‖b − Ax‖ of the solution returned, and for fp32 output that differs from
// the fp64 solution's by ~eps32·‖A‖‖x‖, far more than exact_residual's fp64 rounding.
at::Tensor as_returned(at::Tensor x, at::ScalarType output_dtype);

// Solves from G = [A|B]ᵀ[A|B] ((k+r)×(k+r) fp64 CPU). `method` is gram_cholesky or
// gram_eigh. Returns nullopt, when `may_decline`, if the equilibrated AᵀA is more
// ill-conditioned than options.gram_condition_limit, not positive definite, or of rank < k
// at max(rcond, √(10k·eps64)) (the caller then falls back to a method that reads A again).
// Without `may_decline`, gram_cholesky that breaks down, or finds that rank < k (it cannot
// truncate), throws std::runtime_error. gram_eigh truncates at max(rcond, √(10k·eps64))
// and returns the minimum-norm solution in the equilibrated variables (small_solve.cpp,
// Note [Minimum norm with equilibration]). x is rounded to output_dtype (as_returned) and
// the residuals are the Gram formula's for that x.
std::optional<SmallSolution> solve_from_gram(const at::Tensor& G, int64_t k,
                                             const LstsqOptions& options, double rcond,
                                             LstsqMethod method, bool may_decline,
                                             at::ScalarType output_dtype);

// ‖b_j − A x_j‖ from the Gram matrix: √(bᵀb − 2xᵀAᵀb + xᵀAᵀAx), clamped at 0, for any x.
// The square has absolute error ~√N·eps64·(‖b‖ + ‖A‖_F‖x‖)², so the norm is only
// good to the square root of that (see LstsqOptions::exact_residual). A column whose
// terms overflow fp64 (bᵀb near DBL_MAX) gets NaN: gram_residual_lost says so, and the
// caller measures that residual directly (direct_residual_norms).
std::vector<double> gram_residual_norms(const at::Tensor& G, int64_t k, const at::Tensor& x);
bool gram_residual_lost(const std::vector<double>& norms);

// Minimum-norm solution from R (p×(k+r) fp64 CPU, upper trapezoidal), the R factor of
// [A·diag(scale) | B]: the minimum-‖y‖ solution of min ‖R_A y − R_B‖ via the SVD of R_A
// (with lambda_root·diag(scale) stacked under it when λ > 0; lambda_root = √λ), singular
// values below rcond·σ_max
// dropped, x = scale ⊙ y, rounded to output_dtype (as_returned).
// Residual norms are exact, for the x returned: B − AX = Q(R_B − R_A·D⁻¹X) holds for any X.
SmallSolution solve_from_r_factor(const at::Tensor& R, int64_t k, const at::Tensor& scale,
                                  double rcond, double lambda_root, at::ScalarType output_dtype);

}  // namespace tidepool::linalg::detail
