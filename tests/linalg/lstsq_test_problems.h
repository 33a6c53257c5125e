// Constructed least-squares problems with known answers and small checks, shared by the CPU
// and GPU lstsq tests: A = Q₁·diag(σ)·Q₂ᵀ with σ log-spaced from 1 to 1/κ (or given), so
// κ₂(A) is known exactly, and the same A or B in other memory layouts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace tidepool::linalg::testing {

// An N×k fp64 matrix Q₁·diag(σ)·Q₂ᵀ with the given min(N, k) singular values (any order,
// zeros allowed) and random orthonormal Q₁ (N×p), Q₂ (k×p), reproducible for a given seed.
inline at::Tensor matrix_with_singular_values(int64_t rows, int64_t k, const at::Tensor& sigma,
                                              uint64_t seed) {
  if (sigma.numel() != std::min(rows, k)) {
    throw std::invalid_argument("matrix_with_singular_values: need min(rows, k) values");
  }
  at::manual_seed(seed);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const int64_t p = sigma.numel();
  const auto Q1 = std::get<0>(at::linalg_qr(at::randn({rows, p}, options)));
  const auto Q2 = std::get<0>(at::linalg_qr(at::randn({k, p}, options)));
  return Q1.mul(sigma.to(at::kDouble).unsqueeze(0)).mm(Q2.t());
}

// An N×k fp64 matrix (N ≥ k) with singular values log-spaced in [1/condition, 1] and
// random singular vectors (reproducible for a given seed).
inline at::Tensor matrix_with_condition(int64_t rows, int64_t k, double condition, uint64_t seed) {
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto sigma = at::logspace(0.0, -std::log10(condition), k, 10.0, options);
  return matrix_with_singular_values(rows, k, sigma, seed);
}

// A 1-D tensor of the given values (at::tensor of a braced list is ambiguous in ATen).
inline at::Tensor values(const std::vector<double>& v, at::ScalarType dtype = at::kDouble) {
  return at::tensor(at::ArrayRef<double>(v), at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// max|x − reference| / max|reference|.
inline double relative_error(const at::Tensor& x, const at::Tensor& reference) {
  const auto x64 = x.to(at::kCPU, at::kDouble);
  const auto r64 = reference.to(at::kCPU, at::kDouble);
  return (x64 - r64).abs().max().item<double>() / r64.abs().max().item<double>();
}

// The same values in other memory arrangements (fresh copies), to check that no result
// depends on how its input is laid out. A (N×k) in layout 0..3.
inline at::Tensor dense_in_layout(const at::Tensor& A, int layout) {
  const int64_t n = A.size(0);
  const int64_t k = A.size(1);
  switch (layout) {
    case 0: return A.clone();                    // row-major
    case 1: return A.t().contiguous().t();       // column-major: each column contiguous
    case 2: {                                    // a block of a wider matrix
      auto wider = at::zeros({n, k + 3}, A.options());
      wider.narrow(1, 1, k).copy_(A);
      return wider.narrow(1, 1, k);
    }
    default: {                                   // every other row of a taller one
      auto taller = at::zeros({2 * n, k}, A.options());
      auto view = taller.slice(0, 0, 2 * n, 2);
      view.copy_(A);
      return view;
    }
  }
}

// A column (N) in layout 0..3; 3 (stride 0) only for a constant column.
inline at::Tensor column_in_layout(const at::Tensor& column, int layout) {
  const int64_t n = column.size(0);
  switch (layout) {
    case 0: return column.contiguous().clone();  // its own allocation
    case 1: {                                    // every third element of a buffer
      auto buffer = at::zeros({3 * n + 1}, column.options());
      auto view = buffer.slice(0, 1, 1 + 3 * n, 3);
      view.copy_(column);
      return view;
    }
    case 2: {                                    // a column of a row-major N×2 matrix
      auto pair = at::zeros({n, 2}, column.options());
      pair.select(1, 1).copy_(column);
      return pair.select(1, 1);
    }
    default: return column[0].clone().expand({n});  // a constant column: stride 0
  }
}

// B (N or N×r) in layout 0..1.
inline at::Tensor rhs_in_layout(const at::Tensor& B, int layout) {
  if (layout == 0) return B.clone();
  if (B.dim() == 2) return B.t().contiguous().t();
  auto buffer = at::zeros({2 * B.size(0)}, B.options());
  auto view = buffer.slice(0, 0, 2 * B.size(0), 2);
  view.copy_(B);
  return view;
}

// Runs `call` and expects an `Error` whose message contains `fragment`.
template <typename Error, typename Call>
void expect_thrown(Call&& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one mentioning '" << fragment << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

// Bad input: std::invalid_argument.
template <typename Call>
void expect_invalid(Call&& call, const std::string& fragment) {
  expect_thrown<std::invalid_argument>(std::forward<Call>(call), fragment);
}

// A problem the forced method cannot solve (a breakdown, a refusal): std::runtime_error.
template <typename Call>
void expect_refused(Call&& call, const std::string& fragment) {
  expect_thrown<std::runtime_error>(std::forward<Call>(call), fragment);
}


}  // namespace tidepool::linalg::testing
