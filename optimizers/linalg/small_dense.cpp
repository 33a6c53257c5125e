// Plain fp64 dense kernels for lstsq's small host solves: cyclic Jacobi eigenvalues,
// Cholesky, and the two triangular solves (see small_dense.h for why they are not ATen).
//
// Jacobi (Golub & Van Loan, Algorithm 8.5.3): each rotation J(p,q) zeroes a_pq of JᵀAJ;
// with τ = (a_qq − a_pp)/(2a_pq), t = sign(τ)/(|τ| + √(1+τ²)), c = 1/√(1+t²), s = t·c
// (the smaller rotation angle, which makes the sweeps converge quadratically). Sweeps stop
// when the off-diagonal mass is below eps64·‖A‖_F·0.1 — beyond that no eigenvalue can move
// by more than fp64 rounding of ‖A‖ — or after kMaxSweeps (never reached in practice:
// n ≤ 32 converges in ≲ 10). Both masses are sums of squares, so A is first scaled by a
// power of two near 1/max|a_ij| (exact, and undone exactly on the eigenvalues).
#include "optimizers/linalg/small_dense.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tidepool::linalg::detail::dense {
namespace {

constexpr int kMaxSweeps = 60;

double off_diagonal_squares(const std::vector<double>& a, int n) {
  double sum = 0.0;
  for (int p = 0; p < n; ++p) {
    for (int q = p + 1; q < n; ++q) sum += a[p * n + q] * a[p * n + q];
  }
  return 2.0 * sum;
}

}  // namespace

std::vector<double> symmetric_eigenvalues(std::vector<double> a, int n) {
  // Unscaled, the squares overflow for entries ≳ 1.3e154 (tolerance inf) and underflow for
  // entries ≲ 1e-162 (off-diagonal mass 0): either way no sweep ran and the diagonal came
  // back as the eigenvalues, i.e. a wrong κ (lstsq's unequilibrated Gram route took a
  // κ = 1e7 problem for κ ≈ 7.5). A power of two scales without rounding.
  double peak = 0.0;
  for (const double v : a) peak = std::max(peak, std::abs(v));
  int exponent = 0;
  if (peak > 0.0 && std::isfinite(peak)) {  // inf or all-NaN: nothing to scale to
    std::frexp(peak, &exponent);
    for (double& v : a) v = std::ldexp(v, -exponent);
  }
  double frobenius_squares = 0.0;
  for (const double v : a) frobenius_squares += v * v;
  const double tolerance =
      0.1 * std::numeric_limits<double>::epsilon() * std::sqrt(frobenius_squares);
  for (int sweep = 0; sweep < kMaxSweeps; ++sweep) {
    if (!(std::sqrt(off_diagonal_squares(a, n)) > tolerance)) break;  // also stops on NaN
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (apq == 0.0) continue;
        const double tau = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
        // For huge τ, √(1+τ²) overflows; t → 1/(2τ) there.
        const double t =
            std::abs(tau) > 1e150
                ? 0.5 / tau
                : std::copysign(1.0, tau) / (std::abs(tau) + std::sqrt(1.0 + tau * tau));
        const double c = 1.0 / std::sqrt(1.0 + t * t);
        const double s = t * c;
        for (int k = 0; k < n; ++k) {  // A ← A·J: columns p and q
          const double akp = a[k * n + p];
          const double akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // A ← Jᵀ·A: rows p and q
          const double apk = a[p * n + k];
          const double aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        a[p * n + q] = 0.0;  // exactly zero in exact arithmetic; keep rounding out of it
        a[q * n + p] = 0.0;
      }
    }
  }
  std::vector<double> eigenvalues(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    eigenvalues[static_cast<size_t>(i)] = std::ldexp(a[i * n + i], exponent);
  std::sort(eigenvalues.begin(), eigenvalues.end());
  return eigenvalues;
}

bool cholesky_lower(std::vector<double>& a, int n) {
  for (int j = 0; j < n; ++j) {
    double pivot = a[j * n + j];
    for (int k = 0; k < j; ++k) pivot -= a[j * n + k] * a[j * n + k];
    if (!(pivot > 0.0) || !std::isfinite(pivot)) return false;
    const double diagonal = std::sqrt(pivot);
    a[j * n + j] = diagonal;
    for (int i = j + 1; i < n; ++i) {
      double v = a[i * n + j];
      for (int k = 0; k < j; ++k) v -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = v / diagonal;
    }
  }
  return true;
}

void cholesky_solve(const std::vector<double>& l, int n, std::vector<double>& b, int r) {
  for (int col = 0; col < r; ++col) {
    for (int i = 0; i < n; ++i) {  // L·y = b
      double v = b[i * r + col];
      for (int k = 0; k < i; ++k) v -= l[i * n + k] * b[k * r + col];
      b[i * r + col] = v / l[i * n + i];
    }
    for (int i = n - 1; i >= 0; --i) {  // Lᵀ·x = y
      double v = b[i * r + col];
      for (int k = i + 1; k < n; ++k) v -= l[k * n + i] * b[k * r + col];
      b[i * r + col] = v / l[i * n + i];
    }
  }
}

}  // namespace tidepool::linalg::detail::dense
