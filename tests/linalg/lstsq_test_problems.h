// Constructed least-squares problems with known answers and small checks, shared by the CPU
// and GPU lstsq tests: A = Q₁·diag(σ)·Q₂ᵀ with σ log-spaced from 1 to 1/κ, so κ₂(A)
// is known exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace tidepool::linalg::testing {

// An N×k fp64 matrix with singular values log-spaced in [1/condition, 1] and random
// singular vectors (reproducible for a given seed).
inline at::Tensor matrix_with_condition(int64_t rows, int64_t k, double condition, uint64_t seed) {
  at::manual_seed(seed);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto Q1 = std::get<0>(at::linalg_qr(at::randn({rows, k}, options)));
  const auto Q2 = std::get<0>(at::linalg_qr(at::randn({k, k}, options)));
  const auto sigma = at::logspace(0.0, -std::log10(condition), k, 10.0, options);
  return Q1.mul(sigma.unsqueeze(0)).mm(Q2.t());
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

// Runs `call` and expects std::invalid_argument whose message contains `fragment`.
template <typename Call>
void expect_invalid(Call&& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one mentioning '" << fragment << "'";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}


}  // namespace tidepool::linalg::testing
