// Host-side fp64 solves for lstsq: the equilibrated Gram system and the R-factor SVD.
//
// Note [Equilibration]: with D = diag(1/‖a_j‖) we solve for y in (DAᵀAD + λD²) y = DAᵀb and
// return x = Dy. Scaling columns to unit norm can only lower κ (van der Sluis: within √k
// of the best diagonal scaling), so the condition estimate and the rank test look at the
// problem's real difficulty, not at its units. Tikhonov stays on x (λ‖x‖² = λ‖Dy‖²).
//
// Note [Condition from the Gram matrix]: the eigenvalues of the equilibrated AᵀA are
// σ_i² of AD, computed with absolute error ~k·eps64·λ_max; so σ_min/σ_max is resolved down
// to ~1e-8 from the Gram matrix alone. Beyond that the Gram route cannot tell
// "ill-conditioned" from "rank-deficient", which is why automatic hands such problems to a
// method that reads A again.
//
// Note [Minimum norm in the caller's variables]: equilibration changes which solution of a
// rank-deficient problem has minimum norm (‖y‖ = ‖D⁻¹x‖ is not ‖x‖). So the equilibrated
// matrix decides the rank and the condition estimate (units do not matter), and the
// solution comes from the unequilibrated matrix truncated to that rank: the minimum-‖x‖
// solution the caller expects, equal to the plain solution when A has full rank.
#include "optimizers/linalg/small_solve.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "optimizers/linalg/small_dense.h"

namespace tidepool::linalg::detail {
namespace {

constexpr double kEps64 = std::numeric_limits<double>::epsilon();
constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t count_above(const at::Tensor& values, double threshold) {
  return (values > threshold).sum().item<int64_t>();
}

}  // namespace

at::Tensor column_scales(const at::Tensor& gram_diagonal, bool equilibrate) {
  auto scale = at::ones_like(gram_diagonal);
  if (!equilibrate) return scale;
  const auto positive = gram_diagonal > 0;
  return at::where(positive, gram_diagonal.clamp_min(std::numeric_limits<double>::min()).rsqrt(),
                      scale);
}

double resolve_rcond(const LstsqOptions& options, at::ScalarType dtype, int64_t rows, int64_t k) {
  if (options.rcond >= 0.0) return options.rcond;
  const double data_eps = dtype == at::kFloat ? std::numeric_limits<float>::epsilon() : kEps64;
  return std::max(data_eps * static_cast<double>(k), 10.0 * std::sqrt(static_cast<double>(rows)) * kEps64);
}

LstsqOptions resolve_defaults(const LstsqOptions& options, at::ScalarType dtype, int64_t rows, int64_t k) {
  LstsqOptions resolved = options;
  resolved.rcond = resolve_rcond(options, dtype, rows, k);
  if (resolved.gram_condition_limit < 0.0) resolved.gram_condition_limit = dtype == at::kFloat ? 1e7 : 1e4;
  return resolved;
}

double tikhonov_lambda(const LstsqOptions& options, double gram_trace, int64_t k) {
  if (options.tikhonov == 0.0) return 0.0;
  return options.tikhonov_relative ? options.tikhonov * gram_trace / static_cast<double>(k)
                                   : options.tikhonov;
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
    norms[static_cast<size_t>(j)] = std::sqrt(std::max(bb - 2.0 * cross + quadratic, 0.0));
  }
  return norms;
}

std::optional<SmallSolution> solve_from_gram(const at::Tensor& G, int64_t k,
                                             const LstsqOptions& options, double rcond,
                                             LstsqMethod method, bool may_decline) {
  // Plain loops on the (k+r)² doubles (small_dense.h says why), so this fast path costs
  // microseconds, not tens of ATen dispatches.
  const auto Gc = G.to(at::kCPU, at::kDouble).contiguous();
  const int64_t m = Gc.size(0);
  const int64_t r = m - k;
  const double* g = Gc.data_ptr<double>();
  const int n = static_cast<int>(k);

  // Note [Equilibration]: scale as column_scales() does (1 for a zero column or when off).
  std::vector<double> scale(static_cast<size_t>(k), 1.0);
  double trace = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    const double d = g[j * m + j];
    trace += d;
    if (options.equilibrate && d > 0.0) scale[static_cast<size_t>(j)] = 1.0 / std::sqrt(std::max(d, std::numeric_limits<double>::min()));
  }
  const double lambda = tikhonov_lambda(options, trace, k);
  std::vector<double> ghat(static_cast<size_t>(k * k));
  std::vector<double> chat(static_cast<size_t>(k * r));
  for (int64_t i = 0; i < k; ++i) {
    const double si = scale[static_cast<size_t>(i)];
    for (int64_t j = 0; j < k; ++j) ghat[static_cast<size_t>(i * k + j)] = g[i * m + j] * si * scale[static_cast<size_t>(j)];
    ghat[static_cast<size_t>(i * k + i)] += lambda * si * si;
    for (int64_t j = 0; j < r; ++j) chat[static_cast<size_t>(i * r + j)] = g[i * m + k + j] * si;
  }

  const auto eigenvalues = dense::symmetric_eigenvalues(ghat, n);  // ascending
  const double smallest = eigenvalues.front();
  const double largest = eigenvalues.back();
  const double condition = (largest <= 0.0 || smallest <= 0.0) ? kInf : std::sqrt(largest / smallest);
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
          "definite (A is rank-deficient or κ(A) ≳ 1e8); use method automatic, svd or gram_eigh, "
          "or set tikhonov");
    }
    auto y = chat;
    dense::cholesky_solve(factor, n, y, static_cast<int>(r));
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < r; ++j) y[static_cast<size_t>(i * r + j)] *= scale[static_cast<size_t>(i)];
    }
    out.x = at::from_blob(y.data(), {k, r}, at::TensorOptions().dtype(at::kDouble)).clone();
    // Note [Condition from the Gram matrix]: the rank is resolved to ~√eps64 only.
    const double threshold = std::max(rcond, std::sqrt(kEps64)) * std::sqrt(std::max(largest, 0.0));
    out.rank = std::count_if(eigenvalues.begin(), eigenvalues.end(),
                             [threshold](double e) { return std::sqrt(std::max(e, 0.0)) > threshold; });
    // An rcond above 1/κ asks for truncation, which Cholesky cannot do.
    if (may_decline && out.rank < k) return std::nullopt;
  } else {
    // Note [Minimum norm in the caller's variables]: the rank comes from the equilibrated
    // eigenvalues (σ², so the cut-off is rcond², but never below the Gram matrix's own
    // rounding k·eps64·λ_max); the solution from the unequilibrated AᵀA + λI truncated to
    // that rank, so that ‖x‖ (not ‖D⁻¹x‖) is minimal.
    const double cutoff =
        std::max(rcond * rcond, 10.0 * static_cast<double>(k) * kEps64) * std::max(largest, 0.0);
    out.rank = std::count_if(eigenvalues.begin(), eigenvalues.end(), [cutoff](double e) { return e > cutoff; });
    const auto GAA = Gc.narrow(0, 0, k).narrow(1, 0, k);
    const auto C = Gc.narrow(0, 0, k).narrow(1, k, r);
    auto Graw = GAA.clone();
    if (lambda > 0.0) Graw += lambda * at::eye(k, GAA.options());
    auto [w, V] = at::linalg_eigh(Graw);  // ascending: keep the last `rank`
    const auto Vr = V.narrow(1, k - out.rank, out.rank);
    const auto wr = w.narrow(0, k - out.rank, out.rank);
    out.x = Vr.mm((1.0 / wr).unsqueeze(1) * Vr.t().mm(C));
  }
  out.method = method;
  out.residual_norms = gram_residual_norms(Gc, k, out.x);
  return out;
}

SmallSolution solve_from_r_factor(const at::Tensor& R, int64_t k, const at::Tensor& scale,
                                  double rcond, double lambda) {
  const int64_t r = R.size(1) - k;
  const auto RA = R.narrow(1, 0, k);
  const auto RB = R.narrow(1, k, r);
  // The rank and the condition estimate come from the equilibrated R_A (with √λ·D stacked
  // under it for Tikhonov: λ‖x‖² = λ‖Dy‖²) ...
  auto equilibrated = RA;
  if (lambda > 0.0) equilibrated = at::cat({RA, at::diag(std::sqrt(lambda) * scale)}, 0);
  const auto S = at::linalg_svdvals(equilibrated);
  const double largest = S.numel() > 0 ? S[0].item<double>() : 0.0;
  const double smallest = S.numel() > 0 ? S[-1].item<double>() : 0.0;

  SmallSolution out;
  out.method = LstsqMethod::svd;
  out.rank = count_above(S, rcond * largest);
  out.condition = (S.numel() < k || smallest <= 0.0) ? kInf : largest / smallest;

  // ... and the solution from the unequilibrated R_A·D⁻¹ truncated to that rank (Note
  // [Minimum norm in the caller's variables]).
  auto matrix = RA / scale.unsqueeze(0);
  auto rhs = RB;
  if (lambda > 0.0) {
    matrix = at::cat({matrix, std::sqrt(lambda) * at::eye(k, R.options())}, 0);
    rhs = at::cat({RB, at::zeros({k, r}, R.options())}, 0);
  }
  auto [U, Sx, Vh] = at::linalg_svd(matrix, /*full_matrices=*/false);
  const auto Ur = U.narrow(1, 0, out.rank);
  const auto Vr = Vh.narrow(0, 0, out.rank).t();
  out.x = Vr.mm((1.0 / Sx.narrow(0, 0, out.rank)).unsqueeze(1) * Ur.t().mm(rhs));
  const auto y = out.x / scale.unsqueeze(1);
  const auto residual = RB - RA.mm(y);
  out.residual_norms.resize(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) {
    out.residual_norms[static_cast<size_t>(j)] = residual.select(1, j).norm().item<double>();
  }
  return out;
}

}  // namespace tidepool::linalg::detail
