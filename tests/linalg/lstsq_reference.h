// An independent least-squares reference in long double for the lstsq tests (x86's 64-bit
// mantissa: ~2000x finer than fp64), from the very values given (fp32 and fp64 convert
// exactly): Householder QR of [A·D; √λ·D | B; 0] and a one-sided Jacobi SVD of its R, with
// D and λ as LstsqOptions defines them. It gives σ/σ_max of the equilibrated (and
// Tikhonov-stacked) A, hence the rank at any rcond, and the minimum-‖y‖ solution keeping any
// number of directions, x = D·y, which is what lstsq.h promises to return. Plain loops: the
// problems are N ≤ ~10⁴ rows by k ≤ ~20 columns.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>

#include "optimizers/linalg/lstsq.h"

namespace tidepool::linalg::testing {

using Real = long double;

// Column-major long-double matrix.
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<Real> data;
  Matrix() = default;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), data(static_cast<size_t>(r * c), 0.0L) {}
  Real& operator()(int64_t i, int64_t j) { return data[static_cast<size_t>(j * rows + i)]; }
  Real operator()(int64_t i, int64_t j) const { return data[static_cast<size_t>(j * rows + i)]; }
};

// A 1-D (as one column) or 2-D tensor, converted exactly (fp32 and fp64 fit in long double).
inline Matrix to_matrix(const at::Tensor& t) {
  const auto m = (t.dim() == 1 ? t.unsqueeze(1) : t).to(at::kDouble).contiguous();
  Matrix out(m.size(0), m.size(1));
  const double* v = m.data_ptr<double>();
  for (int64_t i = 0; i < out.rows; ++i) {
    for (int64_t j = 0; j < out.cols; ++j) out(i, j) = v[i * out.cols + j];
  }
  return out;
}

// R (min(rows, cols) × cols) of the Householder QR of X.
inline Matrix householder_r(Matrix X) {
  const int64_t m = X.rows;
  const int64_t n = X.cols;
  const int64_t p = std::min(m, n);
  std::vector<Real> v(static_cast<size_t>(m));
  for (int64_t j = 0; j < p; ++j) {
    Real squares = 0.0L;
    for (int64_t i = j; i < m; ++i) squares += X(i, j) * X(i, j);
    if (squares == 0.0L) continue;
    const Real norm = std::sqrt(squares);
    const Real alpha = X(j, j) >= 0.0L ? -norm : norm;
    Real v_squares = 0.0L;
    for (int64_t i = j; i < m; ++i) {
      v[static_cast<size_t>(i)] = X(i, j) - (i == j ? alpha : 0.0L);
      v_squares += v[static_cast<size_t>(i)] * v[static_cast<size_t>(i)];
    }
    for (int64_t c = j; c < n; ++c) {
      Real dot = 0.0L;
      for (int64_t i = j; i < m; ++i) dot += v[static_cast<size_t>(i)] * X(i, c);
      const Real f = 2.0L * dot / v_squares;
      for (int64_t i = j; i < m; ++i) X(i, c) -= f * v[static_cast<size_t>(i)];
    }
  }
  Matrix R(p, n);
  for (int64_t i = 0; i < p; ++i) {
    for (int64_t c = i; c < n; ++c) R(i, c) = X(i, c);
  }
  return R;
}

// One-sided Jacobi (Hestenes): M·V = W with orthogonal columns, σ_i = ‖w_i‖, sorted
// descending. Accurate to long double's rounding relative to each σ's own scale.
struct Svd {
  std::vector<Real> sigma;
  Matrix V;  // k×k, column i belongs to sigma[i]
  Matrix W;  // rows×k, column i = σ_i·u_i
};

inline Svd one_sided_jacobi(const Matrix& M) {
  const int64_t k = M.cols;
  const Real eps = std::numeric_limits<Real>::epsilon();
  Matrix W = M;
  Matrix V(k, k);
  for (int64_t i = 0; i < k; ++i) V(i, i) = 1.0L;
  auto rotate = [](Matrix& X, int64_t i, int64_t j, Real c, Real s) {
    for (int64_t row = 0; row < X.rows; ++row) {
      const Real xi = X(row, i);
      const Real xj = X(row, j);
      X(row, i) = c * xi - s * xj;
      X(row, j) = s * xi + c * xj;
    }
  };
  for (int sweep = 0; sweep < 100; ++sweep) {
    bool rotated = false;
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = i + 1; j < k; ++j) {
        Real alpha = 0.0L, beta = 0.0L, gamma = 0.0L;
        for (int64_t row = 0; row < W.rows; ++row) {
          alpha += W(row, i) * W(row, i);
          beta += W(row, j) * W(row, j);
          gamma += W(row, i) * W(row, j);
        }
        if (gamma == 0.0L || std::fabs(gamma) <= eps * std::sqrt(alpha * beta)) continue;
        rotated = true;
        const Real zeta = (beta - alpha) / (2.0L * gamma);
        const Real t =
            std::copysign(1.0L, zeta) / (std::fabs(zeta) + std::sqrt(1.0L + zeta * zeta));
        const Real c = 1.0L / std::sqrt(1.0L + t * t);
        rotate(W, i, j, c, c * t);
        rotate(V, i, j, c, c * t);
      }
    }
    if (!rotated) break;
  }
  std::vector<Real> norms(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    Real squares = 0.0L;
    for (int64_t row = 0; row < W.rows; ++row) squares += W(row, i) * W(row, i);
    norms[static_cast<size_t>(i)] = std::sqrt(squares);
  }
  std::vector<int64_t> order(static_cast<size_t>(k));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return norms[static_cast<size_t>(a)] > norms[static_cast<size_t>(b)];
  });
  Svd out{{}, Matrix(k, k), Matrix(W.rows, k)};
  for (int64_t i = 0; i < k; ++i) {
    const int64_t from = order[static_cast<size_t>(i)];
    out.sigma.push_back(norms[static_cast<size_t>(from)]);
    for (int64_t row = 0; row < k; ++row) out.V(row, i) = V(row, from);
    for (int64_t row = 0; row < W.rows; ++row) out.W(row, i) = W(row, from);
  }
  return out;
}

// Everything the checks need about one problem, from its exact values.
struct Reference {
  int64_t rows = 0;
  int64_t k = 0;
  int64_t rhs = 0;
  Matrix A;                        // N×k as given
  Matrix B;                        // N×r as given
  std::vector<Real> column_norm;   // ‖a_j‖
  std::vector<Real> scale;         // D: 1/‖a_j‖ with equilibration (zero column: mean)
  Real frobenius = 0.0L;           // ‖A‖_F
  Real lambda = 0.0L;              // Tikhonov λ in absolute terms
  std::vector<Real> sigma;         // singular values of [A·D; √λ·D], descending
  Matrix V;                        // their right singular vectors
  Matrix projection;               // k×r: w_iᵀ c_j (w_i = σ_i·u_i, c = Qᵀ[B; 0])
  double unstacked_ratio = 0.0;    // σ_min/σ_max of A·D alone, without the Tikhonov rows

  double ratio(int64_t i) const {
    return sigma[0] > 0.0L ? static_cast<double>(sigma[static_cast<size_t>(i)] / sigma[0]) : 0.0;
  }
  int64_t rank_at(double threshold) const {
    int64_t count = 0;
    for (int64_t i = 0; i < k; ++i) count += ratio(i) > threshold ? 1 : 0;
    return count;
  }
  // The minimum-‖y‖ solution y (k×r) of min ‖[AD; √λD]y − [B; 0]‖ keeping `rank` directions.
  Matrix y_keeping(int64_t rank) const {
    Matrix y(k, rhs);
    for (int64_t i = 0; i < rank; ++i) {
      const Real s2 = sigma[static_cast<size_t>(i)] * sigma[static_cast<size_t>(i)];
      for (int64_t j = 0; j < rhs; ++j) {
        const Real coefficient = projection(i, j) / s2;
        for (int64_t row = 0; row < k; ++row) y(row, j) += V(row, i) * coefficient;
      }
    }
    return y;
  }
  // ‖b_j − A·x‖ for a solution x (k values).
  Real residual(int64_t j, const std::vector<Real>& x) const {
    Real squares = 0.0L;
    for (int64_t i = 0; i < rows; ++i) {
      Real r = B(i, j);
      for (int64_t c = 0; c < k; ++c) r -= A(i, c) * x[static_cast<size_t>(c)];
      squares += r * r;
    }
    return std::sqrt(squares);
  }
};

inline double ratio_min_max(const Svd& svd) {
  return svd.sigma.front() > 0.0L
             ? static_cast<double>(svd.sigma.back() / svd.sigma.front())
             : 0.0;
}

inline Reference make_reference(const at::Tensor& A, const at::Tensor& B,
                                const LstsqOptions& options) {
  Reference ref;
  ref.A = to_matrix(A);
  ref.B = to_matrix(B);
  ref.rows = ref.A.rows;
  ref.k = ref.A.cols;
  ref.rhs = ref.B.cols;
  const int64_t n = ref.rows;
  const int64_t k = ref.k;
  Real trace = 0.0L;
  for (int64_t j = 0; j < k; ++j) {
    Real squares = 0.0L;
    for (int64_t i = 0; i < n; ++i) squares += ref.A(i, j) * ref.A(i, j);
    trace += squares;
    ref.column_norm.push_back(std::sqrt(squares));
    ref.scale.push_back(options.equilibrate && squares > 0.0L ? 1.0L / std::sqrt(squares) : 1.0L);
  }
  // A zero column's scale is the columns' mean one, 1/√(trace/k) (Note [Equilibration] in
  // small_solve.cpp): only its regularisation entry depends on it.
  for (int64_t j = 0; j < k; ++j) {
    if (options.equilibrate && ref.column_norm[static_cast<size_t>(j)] == 0.0L && trace > 0.0L)
      ref.scale[static_cast<size_t>(j)] = 1.0L / std::sqrt(trace / static_cast<Real>(k));
  }
  ref.frobenius = std::sqrt(trace);
  if (options.tikhonov > 0.0) {
    ref.lambda = options.tikhonov_relative
                     ? static_cast<Real>(options.tikhonov) * trace / static_cast<Real>(k)
                     : static_cast<Real>(options.tikhonov);
  }
  // [A·D; √λ·D | B; 0]: Tikhonov as extra rows, so that one SVD gives rank, κ and y.
  const int64_t extra = ref.lambda > 0.0L ? k : 0;
  Matrix X(n + extra, k + ref.rhs);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t i = 0; i < n; ++i) X(i, j) = ref.A(i, j) * ref.scale[static_cast<size_t>(j)];
    if (extra > 0) X(n + j, j) = std::sqrt(ref.lambda) * ref.scale[static_cast<size_t>(j)];
  }
  for (int64_t j = 0; j < ref.rhs; ++j) {
    for (int64_t i = 0; i < n; ++i) X(i, k + j) = ref.B(i, j);
  }
  const Matrix R = householder_r(X);
  Matrix RA(R.rows, k);
  for (int64_t i = 0; i < R.rows; ++i) {
    for (int64_t j = 0; j < k; ++j) RA(i, j) = R(i, j);
  }
  Svd svd = one_sided_jacobi(RA);
  ref.sigma = svd.sigma;
  ref.V = svd.V;
  ref.projection = Matrix(k, ref.rhs);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < ref.rhs; ++j) {
      Real dot = 0.0L;
      for (int64_t row = 0; row < R.rows; ++row) dot += svd.W(row, i) * R(row, k + j);
      ref.projection(i, j) = dot;
    }
  }
  ref.unstacked_ratio = ratio_min_max(svd);
  if (extra > 0) {
    Matrix AD(n, k);
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t i = 0; i < n; ++i) AD(i, j) = X(i, j);
    }
    ref.unstacked_ratio = ratio_min_max(one_sided_jacobi(householder_r(AD)));
  }
  return ref;
}

}  // namespace tidepool::linalg::testing
