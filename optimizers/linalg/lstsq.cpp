// tidepool::linalg::lstsq and lstsq_columns: input validation and method selection.
//
// Both entry points reduce the problem to a list of A's columns (strided views of a dense
// A, or the caller's separate vectors) plus B's columns, so the Gram pass, the fallbacks
// and the residuals are one code path. The selection rule is written at the top of
// lstsq.h; the numerics live in gram.cpp (the pass over A), small_solve.cpp (the host fp64
// solves) and dense_factor.cpp (the fallbacks that read A again).
//
// Non-finite input is caught for free on the Gram path: a NaN or Inf anywhere in column j
// makes G_jj non-finite, so checking the small G replaces a separate pass over A.
//
// Note [Underflowing squares]: the mirror image of squares that overflow. A product below
// DBL_MIN (entries ≲ 1.5e-154) is subnormal and carries an absolute error of up to 2⁻¹⁰⁷⁵
// instead of a relative eps64, or is 0. Once ‖a_j‖² < N·DBL_MIN the column's Gram entries
// may have lost all their accuracy, and below ~1e-162 the column vanishes from G: the
// Gram routes, and CholeskyQR3 equilibrated from G's diagonal, then misjudge κ and rank (a
// κ ≈ 1 problem came out with κ ≈ 2e4, or rank k − 1 and that column's coefficient 0).
// automatic takes the SVD, which scales by column_norms() before it squares anything; a
// forced method that needs G refuses, as it does for squares that overflow. A right-hand
// side that small loses bᵀb, and with it the Gram residual: its residual is measured
// directly (direct_residual_norms rescales too). Smaller still beside A
// (‖a_j‖·‖b‖ < N·DBL_MIN), AᵀB's own products underflow: automatic takes the SVD, the
// forced Gram methods refuse (underflowing_cross_products).
#include "optimizers/linalg/lstsq.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "optimizers/linalg/dense_factor.h"
#include "optimizers/linalg/gram.h"
#include "optimizers/linalg/small_solve.h"

namespace tidepool::linalg {
namespace {

using detail::SmallSolution;

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("tidepool::linalg::lstsq: " + message);
}

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << t.scalar_type() << " on " << t.device();
  return out.str();
}

// The validated problem: A's and B's columns, all 1-D, same length, dtype and device.
struct Problem {
  std::vector<at::Tensor> a_columns;
  std::vector<at::Tensor> b_columns;
  bool vector_rhs = false;
  int64_t rows = 0;
  int64_t k = 0;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

// Sparse and other non-strided tensors have no data_ptr the Gram pass can read.
void check_layout(const at::Tensor& t, const std::string& name) {
  if (t.layout() != at::kStrided) {
    fail(name + " is a " + detail::layout_name(t) +
         " tensor; lstsq takes dense (strided) tensors: convert it with to_dense()");
  }
}

void check_dtype_and_device(const at::Tensor& t, const char* name, const Problem& problem) {
  check_layout(t, name);
  if (t.scalar_type() != problem.dtype) {
    fail(std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
         " but A has " + std::string(c10::toString(problem.dtype)) +
         "; convert both to float32 or float64");
  }
  if (t.device() != problem.device) {
    fail(std::string(name) + " is on " + t.device().str() + " but A is on " + problem.device.str() +
         "; move both to one device");
  }
}

void set_dtype_and_device(const at::Tensor& first, const char* name, Problem& problem) {
  check_layout(first, name);
  if (first.scalar_type() != at::kFloat && first.scalar_type() != at::kDouble) {
    fail(std::string("unsupported dtype ") + std::string(c10::toString(first.scalar_type())) +
         " for " + name + "; lstsq takes float32 or float64");
  }
  if (!first.is_cpu() && !first.is_cuda())
    fail(std::string(name) + " must be on the CPU or a CUDA device");
#if !TIDEPOOL_HAVE_CUDA
  if (first.is_cuda())
    fail("this libtidepool_optim was built without CUDA; " + std::string(name) + " is on " +
         first.device().str());
#endif
  problem.dtype = first.scalar_type();
  problem.device = first.device();
}

// Note [Negative views]: a tensor with its negative bit set (x.conj().imag() of a complex
// x, torch._neg_view) holds -x in memory read as x. The Gram pass and the CUDA kernels read
// raw memory, so such an A or B came out with the sign of Aᵀb flipped, x = -x_true, while
// the SVD route (ATen copies) got it right (review finding). Resolved where tensors enter:
// a copy for such a tensor, nothing for any other.
at::Tensor without_negative_bit(const at::Tensor& t) {
  return t.defined() ? t.resolve_neg() : t;
}

void add_rhs(const at::Tensor& rhs, Problem& problem) {
  const at::Tensor B = without_negative_bit(rhs);
  if (!B.defined()) fail("B is undefined");
  if (B.dim() != 1 && B.dim() != 2) fail("B must be 1-D (N) or 2-D (N×r), got " + describe(B));
  check_dtype_and_device(B, "B", problem);
  if (B.size(0) != problem.rows) {
    fail("A has " + std::to_string(problem.rows) + " rows but B has " + std::to_string(B.size(0)));
  }
  problem.vector_rhs = B.dim() == 1;
  if (problem.vector_rhs) {
    problem.b_columns = {B};
  } else {
    if (B.size(1) == 0) fail("B has no columns: " + describe(B));
    problem.b_columns = detail::columns_of(B);
  }
}

Problem dense_problem(const at::Tensor& matrix, const at::Tensor& B) {
  const at::Tensor A = without_negative_bit(matrix);
  if (!A.defined()) fail("A is undefined");
  if (A.dim() != 2) fail("A must be 2-D (N×k), got " + describe(A));
  if (A.size(0) == 0 || A.size(1) == 0) fail("A is empty: " + describe(A));
  Problem problem;
  set_dtype_and_device(A, "A", problem);
  problem.rows = A.size(0);
  problem.k = A.size(1);
  problem.a_columns = detail::columns_of(A);
  add_rhs(B, problem);
  return problem;
}

Problem column_problem(const std::vector<at::Tensor>& given, const at::Tensor& B) {
  if (given.empty()) fail("no columns given (A would be empty)");
  Problem problem;
  std::vector<at::Tensor> columns;
  columns.reserve(given.size());
  for (const auto& column : given) columns.push_back(without_negative_bit(column));
  for (size_t j = 0; j < columns.size(); ++j) {
    const auto& column = columns[j];
    const std::string name = "column " + std::to_string(j);
    if (!column.defined()) fail(name + " is undefined");
    if (column.dim() != 1) fail(name + " must be 1-D, got " + describe(column));
    if (j == 0) {
      set_dtype_and_device(column, "column 0", problem);
      problem.rows = column.size(0);
      if (problem.rows == 0) fail("column 0 is empty");
    }
    check_dtype_and_device(column, name.c_str(), problem);
    if (column.size(0) != problem.rows) {
      fail(name + " has " + std::to_string(column.size(0)) + " rows but column 0 has " +
           std::to_string(problem.rows));
    }
  }
  problem.k = static_cast<int64_t>(columns.size());
  problem.a_columns = columns;
  add_rhs(B, problem);
  return problem;
}

void check_finite_gram(const at::Tensor& G) {
  // A plain loop: G is a small fp64 CPU tensor, and three ATen ops here cost more than it.
  const auto values = G.contiguous();
  const double* g = values.data_ptr<double>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    if (!std::isfinite(g[i])) {
      fail("A or B contains NaN or Inf (or values so large that their squares overflow float64)");
    }
  }
}

// A and B as fp64 tensors on their device: what the fallbacks that read A again work on.
at::Tensor fp64_matrix(const std::vector<at::Tensor>& columns) {
  return at::stack(columns, 1).to(at::kDouble);
}

// [A | B] as one fp64 matrix on their device, each column converted straight into place:
// the SVD path's one full-size copy (stacking A and B, converting, scaling and joining
// them held up to four, 62 GiB for a 2²⁸×8 fp32 problem).
at::Tensor fp64_augmented(const Problem& problem) {
  const auto b_count = static_cast<int64_t>(problem.b_columns.size());
  auto X = at::empty({problem.rows, problem.k + b_count},
                     at::TensorOptions().dtype(at::kDouble).device(problem.device));
  for (int64_t j = 0; j < problem.k; ++j) X.select(1, j).copy_(problem.a_columns[j]);
  for (int64_t j = 0; j < b_count; ++j) X.select(1, problem.k + j).copy_(problem.b_columns[j]);
  return X;
}

SmallSolution run_svd(const Problem& problem, const LstsqOptions& options, double rcond) {
  auto X = fp64_augmented(problem);
  // Column by column (a whole-X isfinite would be one more temporary of N·(k+r) bytes),
  // with one wait for all of them.
  std::vector<at::Tensor> finite;
  finite.reserve(static_cast<size_t>(X.size(1)));
  for (int64_t j = 0; j < X.size(1); ++j) finite.push_back(at::isfinite(X.select(1, j)).all());
  if (!at::stack(finite).all().item<bool>()) fail("A or B contains NaN or Inf");
  auto A = X.narrow(1, 0, problem.k);
  // Not A.square().sum(0): for finite |a| > ~1.3e154 that overflows to inf, the scale
  // becomes 0 and the SVD sees NaN (column_norms rescales; so does LAPACK's QR).
  const auto norms = detail::column_norms(A).cpu();
  if (!at::isfinite(norms).all().item<bool>()) {
    fail("a column of A has a 2-norm beyond the float64 range; rescale A");
  }
  const detail::NormSpread spread = detail::norm_spread(norms);
  auto scale = at::ones_like(norms);
  if (options.equilibrate) {
    // 1/‖a_j‖, kept finite for a column of subnormals; for a zero column (which stays zero
    // and shows up as rank deficiency) the columns' mean scale, as column_scales gives it:
    // 1 over the root mean square ‖norms‖/√k.
    const double rms =
        spread.largest > 0.0
            ? spread.largest * std::sqrt(spread.spread / static_cast<double>(problem.k))
            : 0.0;
    scale = at::where(norms > 0, 1.0 / norms.clamp_min(std::numeric_limits<double>::min()),
                      scale * detail::zero_column_scale(rms));
  }
  const double lambda_root = detail::tikhonov_root(options, spread, problem.k);
  A.mul_(scale.to(A.device()));  // in X: the equilibrated A beside B
  const auto R = detail::householder_r_factor(X);
  return detail::solve_from_r_factor(R, problem.k, scale, rcond, lambda_root, problem.dtype);
}

// `r_trusted`, when given, says whether R alone (before any Tikhonov rows are stacked under
// it) is well inside CholeskyQR3's proven range: full rank at rcond and κ(R) ≤ 1e11.
std::optional<SmallSolution> run_cholesky_qr(const Problem& problem, const LstsqOptions& options,
                                             const at::Tensor& G, double rcond,
                                             bool* r_trusted = nullptr) {
  const auto diagonal = G.diagonal().narrow(0, 0, problem.k).clone();
  const auto scale = detail::column_scales(diagonal, options.equilibrate);
  // The Gram diagonal is finite and did not underflow (select_and_solve checked): its
  // trace gives λ as the Gram path's.
  const double lambda_root =
      std::sqrt(detail::tikhonov_lambda(options, diagonal.sum().item<double>(), problem.k));
  const auto A = fp64_matrix(problem.a_columns) * scale.to(problem.device);
  const auto factors = detail::shifted_cholesky_qr3(A, fp64_matrix(problem.b_columns));
  if (!factors) return std::nullopt;
  if (r_trusted != nullptr) {
    // Not the rank and κ of the solve below: with λ > 0 they are those of [R; √λ·D],
    // full rank and bounded whatever R is (review finding).
    constexpr double kCholeskyQrTrustedCondition = 1e11;
    const auto sv = at::linalg_svdvals(factors->R.narrow(1, 0, problem.k));
    const double largest = sv.numel() > 0 ? sv[0].item<double>() : 0.0;
    const double smallest = sv.numel() > 0 ? sv[-1].item<double>() : 0.0;
    *r_trusted = smallest > 0.0 && largest <= kCholeskyQrTrustedCondition * smallest &&
                 smallest > rcond * largest;
  }
  auto solution =
      detail::solve_from_r_factor(at::cat({factors->R, factors->QtB}, 1), problem.k, scale,
                                  rcond, lambda_root, problem.dtype);
  solution.method = LstsqMethod::cholesky_qr;
  // R and QᵀB describe only B's part in range(A); the residual needs one more pass (of the
  // x returned: solution.x is already rounded to the output dtype).
  solution.residual_norms =
      detail::direct_residual_norms(problem.a_columns, problem.b_columns, solution.x);
  return solution;
}

SmallSolution select_and_solve(const Problem& problem, const LstsqOptions& options, double rcond) {
  const LstsqMethod method = options.method;
  const bool tiny =
      problem.rows < problem.k ||
      problem.rows <= options.svd_below_elements / problem.k;  // N·k may overflow int64
  if (method == LstsqMethod::svd || (method == LstsqMethod::automatic && tiny)) {
    return run_svd(problem, options, rcond);
  }

  std::vector<at::Tensor> all_columns = problem.a_columns;
  all_columns.insert(all_columns.end(), problem.b_columns.begin(), problem.b_columns.end());
  const auto G = detail::gram_of_columns(all_columns);
  check_finite_gram(G);
  if (const int64_t tiny_column = detail::underflowing_column(problem.a_columns, G, 0);
      tiny_column >= 0) {
    if (method == LstsqMethod::automatic) return run_svd(problem, options, rcond);
    fail("column " + std::to_string(tiny_column) + " of A is so small that its squares " +
         "underflow float64 (entries below ~1e-154), which method " + method_name(method) +
         " cannot resolve; rescale A, or use method automatic or svd");
  }
  // A right-hand side so small beside A that AᵀB's products underflow: the Gram routes
  // would solve from an AᵀB wrong by percents, or 0 (review finding); CholeskyQR3 and the
  // SVD factor [A | B] without forming it.
  if (method != LstsqMethod::cholesky_qr) {
    if (const int64_t c = detail::underflowing_cross_products(problem.a_columns,
                                                              problem.b_columns, G);
        c >= 0) {
      if (method == LstsqMethod::automatic) return run_svd(problem, options, rcond);
      fail("column " + std::to_string(c) + " of B is so small beside A that the products " +
           "AᵀB underflow float64, which method " + method_name(method) + " cannot " +
           "resolve; rescale B, or use method automatic or svd");
    }
  }
  // AᵀA of a wide A is singular: CholeskyQR has nothing to factor (after the input
  // checks, so that bad input is named as such whatever the method).
  if (method == LstsqMethod::cholesky_qr && problem.rows < problem.k) {
    throw std::runtime_error("tidepool::linalg::lstsq: cholesky_qr needs at least as many rows "
                             "as columns; A is " + std::to_string(problem.rows) + "x" +
                             std::to_string(problem.k) + ", more columns than rows: use method "
                             "automatic or svd");
  }

  // The Gram residual is a cancellation (LstsqOptions::exact_residual), and it needs bᵀb,
  // which a right-hand side whose squares underflow has lost (Note [Underflowing squares]):
  // either way one more pass measures the residuals directly, of the x returned (rounded).
  auto with_residuals = [&](SmallSolution solution) {
    if (options.exact_residual || detail::gram_residual_lost(solution.residual_norms) ||
        detail::underflowing_column(problem.b_columns, G, problem.k) >= 0) {
      solution.residual_norms =
          detail::direct_residual_norms(problem.a_columns, problem.b_columns, solution.x);
    }
    return solution;
  };
  if (method == LstsqMethod::gram_cholesky || method == LstsqMethod::gram_eigh) {
    return with_residuals(*detail::solve_from_gram(G, problem.k, options, rcond, method,
                                                   /*may_decline=*/false, problem.dtype));
  }
  if (method == LstsqMethod::cholesky_qr) {
    if (auto solution = run_cholesky_qr(problem, options, G, rcond)) return *solution;
    throw std::runtime_error(
        "tidepool::linalg::lstsq: cholesky_qr broke down (A is numerically rank-deficient); "
        "use method automatic or svd");
  }
  if (auto solution = detail::solve_from_gram(G, problem.k, options, rcond,
                                              LstsqMethod::gram_cholesky,
                                              /*may_decline=*/true, problem.dtype)) {
    return with_residuals(*solution);
  }
  // CholeskyQR3's R is trusted only well inside its proven range (κ ≲ u⁻¹): an exactly
  // singular A can come out of it with a tiny but non-zero σ_min, so anything near the
  // limit of fp64 goes to the Householder QR + SVD, which decides the rank reliably.
  bool r_trusted = false;
  if (auto solution = run_cholesky_qr(problem, options, G, rcond, &r_trusted);
      solution && r_trusted) {
    return *solution;
  }
  return run_svd(problem, options, rcond);
}

LstsqResult solve(const Problem& problem, const LstsqOptions& requested) {
  // No autograd: the Gram route reads raw memory, and the others' graphs were wrong where
  // cuSOLVER wrote through data_ptr, and held several N×k fp64 copies for backward.
  // Every route returns a solution that requires no grad, whatever A and B do.
  const at::AutoGradMode no_grad(false);
  detail::check_options(requested, "tidepool::linalg::lstsq");
  const auto options = detail::resolve_defaults(requested, problem.dtype, problem.rows, problem.k);
  const double rcond = options.rcond;
  const SmallSolution small = select_and_solve(problem, options, rcond);

  LstsqResult result;
  // Exact: small.x is already rounded to problem.dtype (detail::as_returned).
  auto solution = small.x.to(problem.device, problem.dtype);
  result.solution = problem.vector_rhs ? solution.squeeze(1) : solution;
  result.method = small.method;
  result.method_name = method_name(small.method);
  result.rank = small.rank;
  result.condition = small.condition;
  result.rcond = small.rcond;
  result.residual_norms = small.residual_norms;
  // A solution that overflowed the output dtype came back as ±inf: its residual is +inf
  // (the formulas would give inf or NaN, 0·inf, depending on the route).
  const auto x = small.x.contiguous();
  const double* xs = x.data_ptr<double>();
  const int64_t r = x.size(1);
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (!std::isfinite(xs[i])) {
      result.residual_norms[static_cast<size_t>(i % r)] = std::numeric_limits<double>::infinity();
    }
  }
  // Frobenius norm, scaled by the largest term so that huge residuals do not overflow.
  // A NaN stays NaN (std::max would drop it, and report a lost residual as 0).
  double peak = 0.0;
  for (const double norm : result.residual_norms) {
    if (!(norm <= peak)) peak = norm;
    if (std::isnan(peak)) break;
  }
  double squares = 0.0;
  if (peak > 0.0 && std::isfinite(peak)) {
    for (const double norm : result.residual_norms) squares += (norm / peak) * (norm / peak);
  }
  result.residual_norm = peak > 0.0 && std::isfinite(peak) ? peak * std::sqrt(squares) : peak;
  return result;
}

}  // namespace

const char* method_name(LstsqMethod method) {
  switch (method) {
    case LstsqMethod::automatic: return "automatic";
    case LstsqMethod::gram_cholesky: return "gram_cholesky";
    case LstsqMethod::cholesky_qr: return "cholesky_qr";
    case LstsqMethod::svd: return "svd";
    case LstsqMethod::gram_eigh: return "gram_eigh";
  }
  return "unknown";
}

LstsqResult lstsq(const at::Tensor& A, const at::Tensor& B, const LstsqOptions& options) {
  return solve(dense_problem(A, B), options);
}

LstsqResult lstsq_columns(const std::vector<at::Tensor>& columns, const at::Tensor& B,
                          const LstsqOptions& options) {
  return solve(column_problem(columns, B), options);
}

}  // namespace tidepool::linalg
