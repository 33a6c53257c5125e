// The lstsq fallbacks that read A more than once (internal to tidepool_optim): shifted
// CholeskyQR3 and the Householder R factor. Both take fp64 tensors on A's device and hand
// small fp64 factors to the host, where small_solve.h finishes the job.
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace tidepool::linalg::detail {

// R (k×k) and QᵀB (k×r), fp64 CPU, from shifted CholeskyQR3 of A (N×k fp64, any device),
// or nullopt if a Cholesky factorisation breaks down (A is numerically rank-deficient).
struct CholeskyQrFactors {
  at::Tensor R;
  at::Tensor QtB;
};
std::optional<CholeskyQrFactors> shifted_cholesky_qr3(const at::Tensor& A, const at::Tensor& B);

// The R factor (min(N,m)×m, upper trapezoidal, fp64 CPU) of the Householder QR of X (N×m
// fp64, CPU or CUDA). CUDA uses cuSOLVER's 64-bit Xgeqrf (cusolver_qr.cpp).
at::Tensor householder_r_factor(const at::Tensor& X);

#if TIDEPOOL_HAVE_CUDA
at::Tensor cusolver_r_factor(const at::Tensor& X);
#endif

}  // namespace tidepool::linalg::detail
