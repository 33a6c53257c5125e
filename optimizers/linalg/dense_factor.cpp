// lstsq fallbacks for problems the one-pass Gram method cannot resolve.
//
// Shifted CholeskyQR3 (Fukaya, Kannan, Nakatsukasa, Yamamoto, Yanagisawa 2020): the first
// Cholesky is of AᵀA + sI with s = 11(Nk + k(k+1))·u·‖A‖²_F, which always succeeds for
// κ(A) ≲ u⁻¹ and gives Q₁ = A R₁⁻¹ with κ(Q₁) ≲ u^(-1/2); two plain CholeskyQR
// steps then make Q orthonormal to working precision. Every step is a gemm or a triangular solve on
// A's device (cuBLAS on the GPU); the three k×k Cholesky factorisations run in fp64 on the
// host. It needs one fp64 N×k copy of A (Q is built in place of it).
//
// The Householder R factor is the robust last resort: LAPACK geqrf on the CPU, cuSOLVER's
// 64-bit Xgeqrf on the GPU (torch's CUDA QR uses the 32-bit API and fails at 16,777,216×8).
#include "optimizers/linalg/dense_factor.h"

#include <limits>

namespace tidepool::linalg::detail {
namespace {

// Upper Cholesky factor on the host, or nullopt if G is not numerically positive definite.
std::optional<at::Tensor> host_upper_cholesky(const at::Tensor& G) {
  auto [L, info] = at::linalg_cholesky_ex(G.cpu());
  if (info.item<int64_t>() != 0) return std::nullopt;
  return L.t().contiguous();
}

// Q ← Q R⁻¹ on Q's device.
at::Tensor right_divide_upper(const at::Tensor& Q, const at::Tensor& R) {
  return at::linalg_solve_triangular(R.to(Q.device()), Q, /*upper=*/true, /*left=*/false);
}

}  // namespace

std::optional<CholeskyQrFactors> shifted_cholesky_qr3(const at::Tensor& A, const at::Tensor& B) {
  const double u = std::numeric_limits<double>::epsilon() / 2;
  const auto n = static_cast<double>(A.size(0));
  const auto k = static_cast<double>(A.size(1));

  auto G = A.t().mm(A).cpu();
  const double shift = 11.0 * (n * k + k * (k + 1.0)) * u * G.trace().item<double>();
  auto R1 = host_upper_cholesky(G + shift * at::eye(A.size(1), G.options()));
  if (!R1) return std::nullopt;
  auto Q = right_divide_upper(A, *R1);
  auto R = *R1;
  for (int step = 0; step < 2; ++step) {
    auto Ri = host_upper_cholesky(Q.t().mm(Q));
    if (!Ri) return std::nullopt;
    Q = right_divide_upper(Q, *Ri);
    R = Ri->mm(R);
  }
  return CholeskyQrFactors{R, Q.t().mm(B).cpu()};
}

at::Tensor householder_r_factor(const at::Tensor& X) {
#if TIDEPOOL_HAVE_CUDA
  if (X.is_cuda()) return cusolver_r_factor(X);
#endif
  return std::get<1>(at::linalg_qr(X, "r"));
}

}  // namespace tidepool::linalg::detail
