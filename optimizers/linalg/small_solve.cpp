// Host-side fp64 solves for lstsq: the equilibrated Gram system and the R-factor SVD.
//
// Note [Equilibration]: with D = diag(1/‖a_j‖) we solve for y in (DAᵀAD + λD²) y = DAᵀb
// and return x = Dy. Scaling columns to unit norm can only lower κ (van der Sluis: within √k
// of the best diagonal scaling), so the condition estimate and the rank test look at the
// problem's real difficulty, not at its units. Tikhonov stays on x (λ‖x‖² = λ‖Dy‖²).
// A zero column has no norm to scale by; it gets 1/√(trace(AᵀA)/k), the columns' mean
// scale (1 when A is all zero), so that its regularisation entry λ·d_j² is on the same
// footing as the others' λ/‖a_j‖² whatever A's units (review finding: with scale 1, a
// relative λ made the rank, κ and the method chosen follow the units). Without λ its
// scale changes nothing: the column stays zero, and so does its coefficient.
//
// Note [Condition from the Gram matrix]: the eigenvalues of the equilibrated AᵀA are
// σ_i² of AD, computed with absolute error ~k·eps64·λ_max (the Jacobi sweeps, and G's own
// rounding: an exactly singular AD shows 2-8·eps64·λ_max for N ≤ 1e4, growing slowly with
// N, ~20·eps64·λ_max at N = 1e7); so σ_min/σ_max is resolved down to √(10k·eps64) ≈ 1e-7
// from the Gram matrix alone, the floor on rcond of both Gram methods. Beyond that the Gram
// route cannot tell "ill-conditioned" from "rank-deficient", which is why automatic hands
// such problems to a method that reads A again.
//
// Note [Minimum norm with equilibration]: a rank-deficient (or rcond-truncated) problem has
// many solutions, and which one is "minimum norm" depends on the variables. With
// equilibration on, the rank is decided and the truncated solve is done on one and the same
// matrix, the equilibrated AD: y is the minimum-‖y‖ solution of min ‖ADy − b‖ with the
// singular values below rcond·σ_max(AD) dropped, and x = Dy, so ‖D⁻¹x‖ (the norm in
// unit-column variables) is minimal — what LAPACK-style equilibrated solvers return, and
// what AADL does itself. Deciding the rank on AD but truncating the SVD of the unscaled A
// (the earlier code) keeps the top `rank` directions of a different matrix: with column
// norms 1 and 1e-5 it kept a near-collinear pair and dropped the small, independent
// column, and for full rank it threw away the accuracy equilibration buys. With
// equilibration off D = I and this is the true minimum-‖x‖ solution. With full rank and
// no truncation both agree: the solution is unique.
// Not taken (tried 2026-12-07): returning the minimum ‖x‖ among the truncated problem's
// solutions D(y + V⊥z), V⊥ the dropped directions. Where a dropped σ is small but not zero
// (truncated at rcond, not exactly dependent), D stretches V⊥ by the ratio of the column
// norms: with norms 1 and 1e-6 (units_problem in test_lstsq.cpp) the "minimum ‖x‖" moved
// far along the dropped direction, to coefficients of ±1.8e5 for a problem whose
// solution is (0.5, 1e6, 0.5), with a residual worse by σ_dropped·‖z‖. For columns that
// are exactly dependent but differently scaled ([a, 2a]) this means lstsq gives x ∝ (2, 1)
// where gelsd gives (1, 2), both exact solutions; equilibrate = false gives gelsd's.
#include "optimizers/linalg/small_solve.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "optimizers/linalg/small_dense.h"

namespace tidepool::linalg::detail {
namespace {

constexpr double kEps64 = std::numeric_limits<double>::epsilon();
constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t count_above(const at::Tensor& values, double threshold) {
  return (values > threshold).sum().item<int64_t>();
}

// Note [Condition from the Gram matrix]: the smallest eigenvalue of the equilibrated AᵀA
// (λ_max ≤ k) that is not rounding, relative to λ_max. Both Gram methods count only
// eigenvalues above it, so the smallest rcond on σ they apply is its square root.
double gram_resolution(int64_t k) { return 10.0 * static_cast<double>(k) * kEps64; }

}  // namespace

at::Tensor column_norms(const at::Tensor& M) {
  // Divide each column by its largest magnitude first: squaring |m| > ~1.3e154 overflows
  // and |m| < ~1.5e-154 underflows (torch's vector_norm does not rescale), and either would
  // make the column scale 0 or 1 and the equilibrated matrix NaN or unscaled.
  // One column at a time, and |m|'s peak as max(max m, -min m): the temporaries are one
  // column's, not M's (on the SVD path M is [A | B] in fp64 of a problem that may fill
  // most of the device: whole-M temporaries doubled and tripled its footprint).
  if (M.size(1) == 0) return at::zeros({0}, M.options());
  std::vector<at::Tensor> norms;
  norms.reserve(static_cast<size_t>(M.size(1)));
  for (int64_t j = 0; j < M.size(1); ++j) {
    const auto column = M.select(1, j);
    const auto peak = at::maximum(column.max(), column.min().neg());
    const auto safe_peak = at::where(peak > 0, peak, at::ones_like(peak));
    norms.push_back(peak * (column / safe_peak).square_().sum().sqrt());
  }
  return at::stack(norms);
}

double zero_column_scale(double rms_norm) {
  // A mean beyond fp64 (only without a relative λ, which refuses it) or 0: scale 1. The
  // floor is column_scales' (a squared norm of at least DBL_MIN).
  if (!(rms_norm > 0.0) || !std::isfinite(rms_norm)) return 1.0;
  return 1.0 / std::max(rms_norm, std::sqrt(std::numeric_limits<double>::min()));
}

at::Tensor column_scales(const at::Tensor& gram_diagonal, bool equilibrate) {
  auto scale = at::ones_like(gram_diagonal);
  if (!equilibrate) return scale;
  const auto positive = gram_diagonal > 0;
  const double mean = gram_diagonal.numel() == 0 ? 0.0 : gram_diagonal.mean().item<double>();
  return at::where(positive, gram_diagonal.clamp_min(std::numeric_limits<double>::min()).rsqrt(),
                   scale * zero_column_scale(std::sqrt(mean)));
}

std::string layout_name(const at::Tensor& t) {
  std::ostringstream name;
  name << t.layout();
  return name.str();
}

double resolve_rcond(const LstsqOptions& options, at::ScalarType dtype, int64_t rows, int64_t k) {
  if (options.rcond >= 0.0) return options.rcond;
  // Rounding each entry to the input dtype is a perturbation E with |E_ij| ≤ u·|A_ij|, so
  // ‖E‖₂ ≤ u·‖A‖_F ≤ u·√k·σ_max (u = eps/2): by Weyl, σ below that cannot be told from the
  // rounding. Not k·eps: at k = 20 in fp32 that is 2.4e-6 and cut a well-posed κ = 1e6
  // problem to rank 18, where CPU and CUDA are promised to agree.
  const double unit_roundoff =
      (dtype == at::kFloat ? std::numeric_limits<float>::epsilon() : kEps64) / 2.0;
  return std::max(unit_roundoff * std::sqrt(static_cast<double>(k)),
                  10.0 * std::sqrt(static_cast<double>(rows)) * kEps64);
}

void check_options(const LstsqOptions& options, const char* caller) {
  const auto fail = [caller](const std::string& message) {
    throw std::invalid_argument(std::string(caller) + ": " + message);
  };
  // A value cast from an unchecked integer would otherwise run as automatic.
  const auto method = static_cast<int>(options.method);
  if (method < static_cast<int>(LstsqMethod::automatic) ||
      method > static_cast<int>(LstsqMethod::gram_eigh)) {
    fail("options.method " + std::to_string(method) + " is no LstsqMethod");
  }
  if (!std::isfinite(options.rcond)) fail("options.rcond must be finite");
  // rcond·σ_max at or above σ_max drops every direction: x = 0 at rank 0 for any A.
  if (options.rcond >= 1.0) {
    fail("options.rcond must be below 1 (a negative value picks the default), got " +
         std::to_string(options.rcond));
  }
  if (!(options.tikhonov >= 0.0) || !std::isfinite(options.tikhonov)) {
    fail("options.tikhonov must be finite and >= 0, got " + std::to_string(options.tikhonov));
  }
  if (std::isnan(options.gram_condition_limit) || options.gram_condition_limit == 0.0) {
    fail("options.gram_condition_limit must be > 0 (or negative for the default)");
  }
  if (options.svd_below_elements < 0) fail("options.svd_below_elements must be >= 0");
}

LstsqOptions resolve_defaults(const LstsqOptions& options, at::ScalarType dtype, int64_t rows,
                              int64_t k) {
  LstsqOptions resolved = options;
  resolved.rcond = resolve_rcond(options, dtype, rows, k);
  if (resolved.gram_condition_limit < 0.0)
    resolved.gram_condition_limit = dtype == at::kFloat ? 1e7 : 1e4;
  return resolved;
}

namespace {
// What tikhonov_lambda and tikhonov_root both throw for a relative λ beyond fp64.
[[noreturn]] void refuse_overflowing_relative_tikhonov() {
  throw std::invalid_argument(
      "tidepool::linalg::lstsq: tikhonov_relative: λ = tikhonov·trace(AᵀA)/k overflows "
      "float64; rescale A or give an absolute tikhonov");
}
}  // namespace

double tikhonov_lambda(const LstsqOptions& options, double gram_trace, int64_t k) {
  if (options.tikhonov == 0.0) return 0.0;
  if (!options.tikhonov_relative) return options.tikhonov;  // finite: check_options
  const double lambda = options.tikhonov * gram_trace / static_cast<double>(k);
  if (!std::isfinite(lambda)) refuse_overflowing_relative_tikhonov();
  return lambda;
}

NormSpread norm_spread(const at::Tensor& column_norms) {
  const auto norms = column_norms.to(at::kDouble).cpu();
  NormSpread out;
  out.largest = norms.numel() == 0 ? 0.0 : norms.max().item<double>();
  if (out.largest > 0.0) out.spread = (norms / out.largest).square().sum().item<double>();
  return out;
}

double tikhonov_root(const LstsqOptions& options, const NormSpread& norms, int64_t k) {
  if (options.tikhonov == 0.0) return 0.0;
  if (!options.tikhonov_relative) return std::sqrt(options.tikhonov);
  // √(trace/k) = ‖norms‖₂/√k, with the norms scaled by the largest first: their squares
  // underflow to 0 for columns below ~1e-162, and λ with them, which dropped the
  // regularisation of exactly the tiny problems the SVD path is taken for.
  const double peak = norms.largest;
  if (!(peak > 0.0)) return 0.0;
  const double spread = norms.spread;
  // A trace beyond fp64 is refused as tikhonov_lambda refuses it, so that every method
  // takes or refuses the same problems (only its underflow is no reason to differ). A
  // finite trace keeps the root finite too (tikhonov is finite: check_options).
  if (!std::isfinite(peak * peak * spread)) refuse_overflowing_relative_tikhonov();
  return std::sqrt(options.tikhonov / static_cast<double>(k)) * peak * std::sqrt(spread);
}

at::Tensor as_returned(at::Tensor x, at::ScalarType output_dtype) {
  if (output_dtype == at::kDouble) return x;
  if (output_dtype != at::kFloat) {
    throw std::logic_error("tidepool::linalg: as_returned: output dtype must be fp32 or fp64");
  }
  if (x.scalar_type() != at::kDouble || !x.is_cpu() || !x.is_contiguous()) {
    throw std::logic_error("tidepool::linalg: as_returned needs a contiguous fp64 CPU tensor");
  }
  // A plain loop on k·r doubles (two ATen casts would cost more than the Cholesky solve).
  // Round to nearest, as the cast to the output dtype will; beyond fp32's range that is ±inf.
  double* values = x.data_ptr<double>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    values[i] = static_cast<double>(static_cast<float>(values[i]));
  }
  return x;
}

bool gram_residual_lost(const std::vector<double>& norms) {
  return std::any_of(norms.begin(), norms.end(), [](double n) { return std::isnan(n); });
}

std::vector<double> gram_residual_norms(const at::Tensor& G, int64_t k, const at::Tensor& x) {
  const auto Gc = G.to(at::kCPU, at::kDouble).contiguous();
  const auto xc = x.to(at::kCPU, at::kDouble).contiguous();
  const int64_t m = Gc.size(0);
  const int64_t r = m - k;
  const double* g = Gc.data_ptr<double>();
  const double* xs = xc.data_ptr<double>();  // k×r
  std::vector<double> norms(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) {
    const double bb = g[(k + j) * m + k + j];
    double cross = 0.0;      // xᵀAᵀb
    double quadratic = 0.0;  // xᵀAᵀAx
    for (int64_t i = 0; i < k; ++i) {
      cross += xs[i * r + j] * g[i * m + k + j];
      double row = 0.0;
      for (int64_t l = 0; l < k; ++l) row += g[i * m + l] * xs[l * r + j];
      quadratic += xs[i * r + j] * row;
    }
    // Not bb − 2·cross + quadratic: 2·cross overflows for cross > DBL_MAX/2 although
    // the residual is finite. A square that still overflows is NaN: measured directly.
    const double square = (bb - cross) + (quadratic - cross);
    norms[static_cast<size_t>(j)] = std::isfinite(square)
                                        ? std::sqrt(std::max(square, 0.0))
                                        : std::numeric_limits<double>::quiet_NaN();
  }
  return norms;
}

std::optional<SmallSolution> solve_from_gram(const at::Tensor& G, int64_t k,
                                             const LstsqOptions& options, double rcond,
                                             LstsqMethod method, bool may_decline,
                                             at::ScalarType output_dtype) {
  // Plain loops on the (k+r)² doubles (small_dense.h says why), so this fast path costs
  // microseconds, not tens of ATen dispatches.
  const auto Gc = G.to(at::kCPU, at::kDouble).contiguous();
  const int64_t m = Gc.size(0);
  const int64_t r = m - k;
  const double* g = Gc.data_ptr<double>();
  const int n = static_cast<int>(k);

  // Note [Equilibration]: scale as column_scales() does (1 when off).
  std::vector<double> scale(static_cast<size_t>(k), 1.0);
  double trace = 0.0;
  for (int64_t j = 0; j < k; ++j) trace += g[j * m + j];
  for (int64_t j = 0; j < k && options.equilibrate; ++j) {
    const double d = g[j * m + j];
    scale[static_cast<size_t>(j)] =
        d > 0.0 ? 1.0 / std::sqrt(std::max(d, std::numeric_limits<double>::min()))
                : zero_column_scale(std::sqrt(trace / static_cast<double>(k)));
  }
  const double lambda = tikhonov_lambda(options, trace, k);
  std::vector<double> ghat(static_cast<size_t>(k * k));
  std::vector<double> chat(static_cast<size_t>(k * r));
  for (int64_t i = 0; i < k; ++i) {
    const double si = scale[static_cast<size_t>(i)];
    for (int64_t j = 0; j < k; ++j)
      ghat[static_cast<size_t>(i * k + j)] = g[i * m + j] * si * scale[static_cast<size_t>(j)];
    ghat[static_cast<size_t>(i * k + i)] += lambda * si * si;
    for (int64_t j = 0; j < r; ++j) chat[static_cast<size_t>(i * r + j)] = g[i * m + k + j] * si;
  }

  const auto eigenvalues = dense::symmetric_eigenvalues(ghat, n);  // ascending
  const double smallest = eigenvalues.front();
  const double largest = eigenvalues.back();
  const double condition =
      (largest <= 0.0 || smallest <= 0.0) ? kInf : std::sqrt(largest / smallest);
  const double gram_condition = condition * condition;

  SmallSolution out;
  out.condition = condition;
  if (method == LstsqMethod::gram_cholesky) {
    if (may_decline && !(gram_condition <= options.gram_condition_limit)) return std::nullopt;
    auto factor = ghat;
    if (!dense::cholesky_lower(factor, n)) {
      if (may_decline) return std::nullopt;
      throw std::runtime_error(
          "tidepool::linalg::lstsq: gram_cholesky: the equilibrated AᵀA is not positive "
          "definite (A is rank-deficient or κ(A) ≳ 1e8); use method automatic, svd or "
          "gram_eigh, or set tikhonov");
    }
    auto y = chat;
    dense::cholesky_solve(factor, n, y, static_cast<int>(r));
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < r; ++j)
        y[static_cast<size_t>(i * r + j)] *= scale[static_cast<size_t>(i)];
    }
    out.x = at::from_blob(y.data(), {k, r}, at::TensorOptions().dtype(at::kDouble)).clone();
    // Note [Condition from the Gram matrix]: the rank is resolved to √(10k·eps64) only, so
    // that is the smallest rcond this method can apply (and the one it reports). It was
    // √eps64, below the rounding of G itself: an intercept and a rescaled copy of it (exactly
    // dependent) kept an eigenvalue of 2-8·eps64·λ_max and came out as "rank k".
    out.rcond = std::max(rcond, std::sqrt(gram_resolution(k)));
    const double threshold = out.rcond * std::sqrt(std::max(largest, 0.0));
    out.rank = std::count_if(
        eigenvalues.begin(), eigenvalues.end(),
        [threshold](double e) { return std::sqrt(std::max(e, 0.0)) > threshold; });
    // An rcond above 1/κ asks for truncation, which Cholesky cannot do: automatic moves on
    // to a method that truncates; a forced gram_cholesky refuses rather than return the
    // untruncated solution under a rank that says otherwise.
    if (out.rank < k) {
      if (may_decline) return std::nullopt;
      std::ostringstream message;
      message << "tidepool::linalg::lstsq: gram_cholesky: the equilibrated A has numerical rank "
              << out.rank << " < " << k << " at rcond " << out.rcond
              << ", and Cholesky cannot truncate; use method automatic, svd or gram_eigh, a "
                 "smaller rcond, or tikhonov";
      throw std::runtime_error(message.str());
    }
  } else {
    // Note [Minimum norm with equilibration]: rank and solution both from the equilibrated
    // DAᵀAD + λD². The rank counts eigenvalues (σ²) above rcond², but never below the Gram
    // matrix's own rounding 10k·eps64·λ_max; reported as the rcond on σ that this is.
    const auto ghat_tensor =
        at::from_blob(ghat.data(), {k, k}, at::TensorOptions().dtype(at::kDouble)).clone();
    auto [w, V] = at::linalg_eigh(ghat_tensor);  // ascending: keep the last `rank`
    const double top = std::max(w[-1].item<double>(), 0.0);
    const double resolution = gram_resolution(k);
    out.rcond = std::max(rcond, std::sqrt(resolution));
    out.rank = count_above(w, std::max(rcond * rcond, resolution) * top);
    const auto C = at::from_blob(chat.data(), {k, r}, at::TensorOptions().dtype(at::kDouble));
    const auto Vr = V.narrow(1, k - out.rank, out.rank);
    const auto wr = w.narrow(0, k - out.rank, out.rank);
    auto y = Vr.mm((1.0 / wr).unsqueeze(1) * Vr.t().mm(C));
    // A zero column's coefficient is exactly 0 in the minimum-norm solution, but eigh's
    // eigenvectors carry it only to rounding (~1e-17); make it exact.
    for (int64_t j = 0; j < k; ++j) {
      if (g[j * m + j] == 0.0) y.select(0, j).zero_();
    }
    const auto D = at::from_blob(scale.data(), {k}, at::TensorOptions().dtype(at::kDouble));
    out.x = y * D.unsqueeze(1);
  }
  out.method = method;
  // The formula holds for any x: evaluate it for the x the caller receives.
  out.x = as_returned(out.x, output_dtype);
  out.residual_norms = gram_residual_norms(Gc, k, out.x);
  return out;
}

SmallSolution solve_from_r_factor(const at::Tensor& R, int64_t k, const at::Tensor& scale,
                                  double rcond, double lambda_root,
                                  at::ScalarType output_dtype) {
  const int64_t r = R.size(1) - k;
  const auto RA = R.narrow(1, 0, k);
  const auto RB = R.narrow(1, k, r);
  // Note [Minimum norm with equilibration]: one SVD of the equilibrated R_A (with √λ·D
  // stacked under it for Tikhonov: λ‖x‖² = λ‖Dy‖²) gives the condition estimate, the
  // rank and y; x = D·y.
  auto matrix = RA;
  auto rhs = RB;
  if (lambda_root > 0.0) {
    matrix = at::cat({RA, at::diag(lambda_root * scale)}, 0);
    rhs = at::cat({RB, at::zeros({k, r}, R.options())}, 0);
  }
  auto [U, S, Vh] = at::linalg_svd(matrix, /*full_matrices=*/false);
  const double largest = S.numel() > 0 ? S[0].item<double>() : 0.0;
  const double smallest = S.numel() > 0 ? S[-1].item<double>() : 0.0;

  SmallSolution out;
  out.method = LstsqMethod::svd;
  out.rcond = rcond;
  out.rank = count_above(S, rcond * largest);
  out.condition = (S.numel() < k || smallest <= 0.0) ? kInf : largest / smallest;
  const auto Ur = U.narrow(1, 0, out.rank);
  const auto Vr = Vh.narrow(0, 0, out.rank).t();
  const auto y = Vr.mm((1.0 / S.narrow(0, 0, out.rank)).unsqueeze(1) * Ur.t().mm(rhs));
  out.x = as_returned(y * scale.unsqueeze(1), output_dtype);
  // ‖R_B − R_A·D⁻¹x‖ = ‖B − AX‖ for any x, so it is evaluated for the x returned. With fp64
  // output y itself is used: x = D·y rounded is within b − Ax's own fp64 rounding of it,
  // and the fp64 results stay what they were.
  const auto y_returned = output_dtype == at::kDouble ? y : out.x / scale.unsqueeze(1);
  const auto residual = RB - RA.mm(y_returned);
  const auto norms = column_norms(residual);  // B may be huge (column_norms says why)
  out.residual_norms.resize(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) {
    out.residual_norms[static_cast<size_t>(j)] = norms[j].item<double>();
  }
  return out;
}

}  // namespace tidepool::linalg::detail
