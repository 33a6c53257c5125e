// The random problems of test_lstsq_random.cpp: how they are drawn (shapes, singular values,
// rank deficiency, extreme scales, options, memory layouts) and when a drawn problem's
// expected rank is unambiguous against the long-double reference (lstsq_reference.h). Kept
// apart from the checks so that each file stays one concept.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "optimizers/linalg/lstsq.h"
#include "tests/linalg/lstsq_reference.h"
#include "tests/linalg/lstsq_test_problems.h"

namespace tidepool::linalg::testing {

inline constexpr double kEps64 = std::numeric_limits<double>::epsilon();
inline constexpr double kEps32 = std::numeric_limits<float>::epsilon();
inline constexpr int64_t kMaxColumns = 20;
// Every σ/σ_max of the reference is at least this factor away from the threshold applied
// (and, for thresholds below fp64's rounding floor, from that floor).
inline constexpr double kGap = 100.0;
// Drawn σ's keep a wider margin, since equilibration moves them a little.
inline constexpr double kDesignGap = 300.0;
// κ of the kept part never exceeds this: beyond it the QR routes' κ·eps64 says nothing.
inline constexpr double kMaxCondition = 3e10;


inline const auto kF64 = at::TensorOptions().dtype(at::kDouble);

class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  int64_t integer(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng_);
  }
  bool chance(double p) { return uniform(0.0, 1.0) < p; }
  double log_uniform(double lo, double hi) {
    return std::pow(10.0, uniform(std::log10(lo), std::log10(hi)));
  }
  uint64_t seed() { return rng_() >> 1; }

 private:
  std::mt19937_64 rng_;
};

inline std::string sci(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g", v);
  return text;
}

// ---------------------------------------------------------------------------------------
// Drawing problems.

struct Problem {
  at::ScalarType dtype = at::kDouble;
  int64_t rows = 0;
  int64_t k = 0;
  int64_t rhs = 0;  // 0: B is 1-D
  LstsqOptions options;
  at::Tensor A;  // contiguous N×k
  at::Tensor B;  // contiguous N or N×r
  int dense_layout = 0;
  int b_layout = 0;
  std::vector<int> column_layouts;
  std::string construction;

  bool fp64() const { return dtype == at::kDouble; }
  int64_t rhs_columns() const { return rhs == 0 ? 1 : rhs; }
  // The rcond lstsq.h documents for options.rcond < 0.
  double resolved_rcond() const {
    if (options.rcond >= 0.0) return options.rcond;
    return std::max((fp64() ? kEps64 : kEps32) / 2.0 * std::sqrt(static_cast<double>(k)),
                    10.0 * std::sqrt(static_cast<double>(rows)) * kEps64);
  }
  double gram_condition_limit() const {
    if (options.gram_condition_limit > 0.0) return options.gram_condition_limit;
    return fp64() ? 1e4 : 1e7;
  }
  bool tiny() const { return rows < k || rows * k <= options.svd_below_elements; }
  std::string describe() const {
    std::string s = "N=" + std::to_string(rows) + " k=" + std::to_string(k) +
                    (rhs == 0 ? " b 1-D" : " r=" + std::to_string(rhs)) +
                    (fp64() ? " fp64, " : " fp32, ") + construction + "; method " +
                    method_name(options.method) + ", rcond " + sci(options.rcond);
    if (options.tikhonov > 0.0) {
      s += ", tikhonov " + sci(options.tikhonov) +
           (options.tikhonov_relative ? " relative" : " absolute");
    }
    s += options.equilibrate ? ", equilibrate" : ", no equilibration";
    s += options.exact_residual ? ", exact residual" : "";
    if (options.svd_below_elements != LstsqOptions{}.svd_below_elements)
      s += ", svd_below_elements " + std::to_string(options.svd_below_elements);
    if (options.gram_condition_limit > 0.0)
      s += ", gram_condition_limit " + sci(options.gram_condition_limit);
    s += "; layouts dense " + std::to_string(dense_layout) + " b " + std::to_string(b_layout) +
         " columns";
    for (const int layout : column_layouts) s += " " + std::to_string(layout);
    return s;
  }
};

// The threshold on σ/σ_max that `method` applies (lstsq.h, LstsqOptions::rcond).
inline double applied_rcond(LstsqMethod method, double rcond, int64_t k) {
  const bool gram = method == LstsqMethod::gram_cholesky || method == LstsqMethod::gram_eigh;
  return gram ? std::max(rcond, std::sqrt(10.0 * static_cast<double>(k) * kEps64)) : rcond;
}

// Below this, σ/σ_max cannot be told from an fp64 factorisation's rounding (lstsq.h's
// 10·√N·eps64 term of the default rcond).
inline double rounding_floor(int64_t rows) {
  return 10.0 * std::sqrt(static_cast<double>(rows)) * kEps64;
}

// log10 of a σ drawn log-uniformly from [−log_condition, 0] but outside [low, high].
inline double draw_log_sigma(Draw& draw, double log_condition, double low, double high) {
  const double lo = -log_condition;
  const double below = std::max(0.0, std::min(0.0, low) - lo);   // length of [lo, low]
  const double above = std::max(0.0, 0.0 - std::max(lo, high));  // length of [high, 0]
  if (below + above <= 0.0) return 0.0;
  const double u = draw.uniform(0.0, below + above);
  return u < below ? lo + u : std::max(lo, high) + (u - below);
}

// Columns added to the independent ones: all but `constant` (an intercept, in general
// independent of the others) make A rank-deficient.
enum class ExtraColumn { zero, duplicate, combination, constant };

inline Problem draw_problem(Draw& draw) {
  Problem p;
  p.dtype = draw.chance(0.6) ? at::kDouble : at::kFloat;
  std::string shape;
  const double shape_draw = draw.uniform(0.0, 1.0);
  if (shape_draw < 0.1) {
    p.k = draw.integer(2, kMaxColumns);
    p.rows = draw.integer(1, p.k - 1);
    shape = "wide";
  } else if (shape_draw < 0.2) {
    p.k = draw.integer(1, kMaxColumns);
    p.rows = p.k;
    shape = "square";
  } else if (shape_draw < 0.45) {
    p.k = draw.integer(1, kMaxColumns);
    p.rows = draw.integer(p.k + 1, std::max(p.k + 1, 4096 / p.k));
    shape = "small";
  } else {
    p.k = draw.integer(1, kMaxColumns);
    const int64_t lo = 4096 / p.k + 1;
    const int64_t hi = std::max<int64_t>(3000, 8192 / p.k);
    const double rows = draw.log_uniform(static_cast<double>(lo), static_cast<double>(hi));
    p.rows = std::clamp<int64_t>(std::llround(rows), lo, hi);
    shape = "tall";
  }
  p.rhs = draw.chance(0.5) ? 0 : draw.integer(1, 3);

  auto& options = p.options;
  const LstsqMethod forced[] = {LstsqMethod::gram_cholesky, LstsqMethod::cholesky_qr,
                                LstsqMethod::svd, LstsqMethod::gram_eigh};
  options.method = draw.chance(0.4) ? LstsqMethod::automatic : forced[draw.integer(0, 3)];
  options.equilibrate = draw.chance(0.75);
  options.exact_residual = draw.chance(0.5);
  if (draw.chance(0.1)) options.svd_below_elements = draw.chance(0.5) ? 0 : int64_t{1} << 30;
  if (draw.chance(0.15))
    options.gram_condition_limit = draw.log_uniform(10.0, p.fp64() ? 1e10 : 1e8);

  // Rank deficiency: extra columns appended to k0 independent ones, then shuffled.
  const bool integers = draw.chance(0.25);
  std::vector<ExtraColumn> extras;
  if (p.k >= 2 && draw.chance(0.5)) {
    const int64_t count = draw.integer(1, std::min<int64_t>(3, p.k - 1));
    for (int64_t i = 0; i < count; ++i)
      extras.push_back(static_cast<ExtraColumn>(draw.integer(0, 3)));
  }
  const int64_t k0 = p.k - static_cast<int64_t>(extras.size());
  const int64_t p0 = std::min(p.rows, k0);
  const int64_t zero_sigmas = !integers && p0 >= 2 && draw.chance(0.2)
                                  ? draw.integer(1, std::min<int64_t>(3, p0 - 1))
                                  : 0;
  // A σ set to 0 or a combination with real coefficients is singular only up to the
  // rounding of the data (~eps of the dtype): unambiguous only at an rcond well above that.
  const bool rounded_deficiency =
      zero_sigmas > 0 ||
      (!integers && std::count(extras.begin(), extras.end(), ExtraColumn::combination) > 0);
  const double default_rcond = p.resolved_rcond();
  if (rounded_deficiency) {
    options.rcond = p.fp64() ? draw.log_uniform(std::max(1e-11, 1e3 * default_rcond), 1e-3)
                             : draw.log_uniform(1e-4, 1e-3);
  } else if (draw.chance(0.4)) {
    options.rcond = draw.chance(0.2) ? 0.0 : draw.log_uniform(default_rcond, 1e-3);
  }
  const double threshold = applied_rcond(options.method, p.resolved_rcond(), p.k);

  // The independent columns (fp64, before column scaling).
  at::Tensor independent;
  std::string summary = shape + ", ";
  if (integers) {
    at::manual_seed(draw.seed());
    independent = at::randint(-9, 10, {p.rows, k0}, kF64);
    summary += "integers";
  } else {
    const double log_condition = draw.uniform(0.0, p.fp64() ? 10.0 : 4.0);
    // σ's (relative to σ_max = 1) outside the band around the threshold that will apply.
    const double low = threshold > 0.0 ? std::log10(threshold / kDesignGap) : -1e300;
    const double high = std::log10(kDesignGap * std::max(threshold, rounding_floor(p.rows)));
    std::vector<double> sigma{1.0};
    for (int64_t i = 1; i < p0; ++i)
      sigma.push_back(std::pow(10.0, draw_log_sigma(draw, log_condition, low, high)));
    std::sort(sigma.begin(), sigma.end(), std::greater<>());
    for (int64_t i = 0; i < zero_sigmas; ++i) sigma[static_cast<size_t>(p0 - 1 - i)] = 0.0;
    independent = testing::matrix_with_singular_values(
        p.rows, k0, at::tensor(at::ArrayRef<double>(sigma), kF64), draw.seed());
    summary += "U·diag(σ)·Vᵀ κ " + sci(std::pow(10.0, log_condition));
    if (zero_sigmas > 0) summary += " with " + std::to_string(zero_sigmas) + " σ = 0";
  }

  // Column scales: powers of two keep exact dependencies exact (they commute with rounding).
  std::vector<at::Tensor> columns;
  std::vector<double> scales;
  const double spread = options.equilibrate ? 4.0 : draw.uniform(0.0, 1.5);
  for (int64_t j = 0; j < k0; ++j) {
    columns.push_back(independent.select(1, j));
    scales.push_back(integers ? std::ldexp(1.0, static_cast<int>(draw.integer(
                                                    options.equilibrate ? -13 : -3,
                                                    options.equilibrate ? 13 : 3)))
                              : std::pow(10.0, draw.uniform(-spread, spread)));
  }
  summary += ", column scales";
  if (!extras.empty()) summary += ", extra columns:";
  for (const ExtraColumn kind : extras) {
    const auto source = static_cast<size_t>(draw.integer(0, k0 - 1));
    const double power = std::ldexp(1.0, static_cast<int>(draw.integer(-3, 3)));
    if (kind == ExtraColumn::zero) {
      columns.push_back(at::zeros({p.rows}, kF64));
      scales.push_back(1.0);
      summary += " zero";
    } else if (kind == ExtraColumn::constant) {
      columns.push_back(at::ones({p.rows}, kF64));
      scales.push_back(integers ? 1.0 : std::pow(10.0, draw.uniform(-spread, spread)));
      summary += " constant";
    } else if (kind == ExtraColumn::duplicate) {
      columns.push_back(columns[source]);
      scales.push_back(power * scales[source]);
      summary += " duplicate of " + std::to_string(source) + " x" + sci(power);
    } else {
      const auto other = static_cast<size_t>(draw.integer(0, k0 - 1));
      if (integers) {
        // Small integers: the combination and its power-of-two scale are exact.
        const double c1 = static_cast<double>(draw.integer(-3, 3));
        const double c2 = static_cast<double>(draw.integer(1, 3));
        columns.push_back(c1 * columns[source] + c2 * columns[other]);
        scales.push_back(power);
      } else {
        columns.push_back(draw.uniform(-2.0, 2.0) * columns[source] * scales[source] +
                          draw.uniform(-2.0, 2.0) * columns[other] * scales[other]);
        scales.push_back(1.0);
      }
      summary += " combination of " + std::to_string(source) + "," + std::to_string(other);
    }
  }
  std::vector<int64_t> order(static_cast<size_t>(p.k));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(draw.seed()));
  std::vector<at::Tensor> placed;
  for (const int64_t j : order) {
    placed.push_back(columns[static_cast<size_t>(j)] * scales[static_cast<size_t>(j)]);
  }
  const auto A64 = at::stack(placed, 1);
  p.A = A64.to(p.dtype).contiguous();
  summary += " (spread " + sci(spread) + ")";

  // B = A·x + a residual of relative size ρ (x balanced across column scales).
  at::manual_seed(draw.seed());
  const auto norms = p.A.to(at::kDouble).norm(2, {0});
  const auto inverse_norms = at::where(norms > 0, 1.0 / norms, at::ones_like(norms));
  std::vector<at::Tensor> rhs_columns;
  std::string residual_sizes;
  for (int64_t j = 0; j < p.rhs_columns(); ++j) {
    const auto consistent = A64.mv(at::randn({p.k}, kF64) * inverse_norms);
    const auto noise = at::randn({p.rows}, kF64);
    const double rho = draw.chance(0.3) ? 0.0 : draw.log_uniform(1e-8, 1.0);
    const double size = consistent.norm().item<double>();
    rhs_columns.push_back(size > 0.0 ? consistent + rho * size * noise / noise.norm() : noise);
    residual_sizes += " " + sci(rho);
  }
  p.B = (p.rhs == 0 ? rhs_columns[0] : at::stack(rhs_columns, 1)).to(p.dtype).contiguous();
  summary += ", residual sizes" + residual_sizes;

  // Extreme magnitudes (fp64): columns times 2^e so that their squares overflow fp64 (norm
  // ≥ 2^520) or underflow it (norm ≤ 2^-550), far from either edge. Exact, so with
  // equilibration the problem is unchanged; without it A and B scale together. Or B alone
  // made that small: only the solution's scale changes.
  const bool extreme = p.fp64() && draw.chance(0.1);
  if (extreme && draw.chance(0.25)) {
    const double norm = p.B.norm().item<double>();
    p.B.mul_(std::ldexp(1.0, static_cast<int>(-560 - std::floor(std::log2(norm)))));
    summary += ", B scaled to underflow its squares";
  } else if (extreme) {
    const bool huge = draw.chance(0.5);
    auto exponent_for = [&](double norm) {
      return static_cast<int>((huge ? 520 : -560) - std::floor(std::log2(norm)) +
                              static_cast<double>(draw.integer(0, 10)));
    };
    if (options.equilibrate) {
      std::vector<int64_t> nonzero;
      for (int64_t j = 0; j < p.k; ++j) {
        if (p.A.select(1, j).ne(0).any().item<bool>()) nonzero.push_back(j);
      }
      std::shuffle(nonzero.begin(), nonzero.end(), std::mt19937_64(draw.seed()));
      nonzero.resize(std::min<size_t>(nonzero.size(), draw.chance(0.5) ? 1 : 2));
      for (const int64_t j : nonzero) {
        const double norm = p.A.select(1, j).norm().item<double>();
        p.A.select(1, j).mul_(std::ldexp(1.0, exponent_for(norm)));
      }
    } else {
      const double norm = p.A.norm(2, {0}).max().item<double>();
      const double factor = std::ldexp(1.0, exponent_for(norm));
      p.A.mul_(factor);
      p.B.mul_(factor);
    }
    summary += huge ? ", columns scaled to overflow their squares"
                    : ", columns scaled to underflow their squares";
  }

  if (!extreme && draw.chance(0.35)) {
    if (draw.chance(0.5)) {
      options.tikhonov = draw.log_uniform(1e-12, 1e-2);
      options.tikhonov_relative = true;
    } else {
      // Absolute λ, drawn relative to the data so that it matters as often as not.
      const double mean_square = norms.square().mean().item<double>();
      options.tikhonov = draw.log_uniform(1e-12, 1e-2) * std::max(mean_square, 1e-300);
      options.tikhonov_relative = false;
    }
  }

  p.dense_layout = static_cast<int>(draw.integer(0, 3));
  p.b_layout = static_cast<int>(draw.integer(0, 1));
  for (int64_t j = 0; j < p.k; ++j) {
    // A constant column may also come as one element expanded (stride 0).
    const auto column = p.A.select(1, j);
    const bool constant = at::equal(column, column[0].expand({p.rows}));
    p.column_layouts.push_back(static_cast<int>(draw.integer(0, constant ? 3 : 2)));
  }
  p.construction = summary;
  return p;
}

// The threshold whose neighbourhood must be empty for the expected rank to be unambiguous.
inline double candidate_threshold(const Problem& p) {
  return applied_rcond(p.options.method, p.resolved_rcond(), p.k);
}

inline bool unambiguous(const Problem& p, const Reference& ref) {
  const double t = candidate_threshold(p);
  const double upper = kGap * std::max(t, rounding_floor(p.rows));
  for (int64_t i = 0; i < p.k; ++i) {
    const double s = ref.ratio(i);
    if (s >= t / kGap && s <= upper) return false;
  }
  const int64_t rank = ref.rank_at(t);
  return rank == 0 || 1.0 / ref.ratio(rank - 1) <= kMaxCondition;
}
}  // namespace tidepool::linalg::testing
