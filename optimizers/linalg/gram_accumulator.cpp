// GramAccumulator: an incrementally maintained fp64 Gram matrix over a ring buffer of
// column slots (see gram_accumulator.h for how AADL drives it).
//
// Each set_column computes fresh fp64 inner products of the new column with every live
// column (gram.cpp's blocked dots_with, so host columns are read in cache-sized blocks and
// CUDA columns in large ones) and writes them into row and column `slot`. No entry is ever
// updated by adding a difference, so there is no drift to correct: after any sequence of
// set_column calls the matrix equals a from-scratch Gram pass up to summation order.
#include "optimizers/linalg/gram_accumulator.h"

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "optimizers/linalg/gram.h"
#include "optimizers/linalg/small_solve.h"

namespace tidepool::linalg {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("tidepool::linalg::GramAccumulator: " + message);
}

}  // namespace

GramAccumulator::GramAccumulator(int64_t capacity) : capacity_(capacity) {
  if (capacity < 1) fail("capacity must be >= 1, got " + std::to_string(capacity));
  columns_.resize(static_cast<size_t>(capacity));
  gram_.assign(static_cast<size_t>(capacity * capacity), 0.0);
}

int64_t GramAccumulator::live_columns() const {
  int64_t count = 0;
  for (const auto& column : columns_) count += column.defined() ? 1 : 0;
  return count;
}

void GramAccumulator::check_slot(int64_t slot, const char* what) const {
  if (slot < 0 || slot >= capacity_) {
    fail(std::string(what) + ": slot " + std::to_string(slot) + " is outside [0, " +
         std::to_string(capacity_) + ")");
  }
}

void GramAccumulator::check_live(int64_t slot, const char* what) const {
  check_slot(slot, what);
  if (!columns_[static_cast<size_t>(slot)].defined()) {
    fail(std::string(what) + ": slot " + std::to_string(slot) + " is empty");
  }
}

bool GramAccumulator::has_column(int64_t slot) const {
  check_slot(slot, "has_column");
  return columns_[static_cast<size_t>(slot)].defined();
}

const at::Tensor& GramAccumulator::column(int64_t slot) const {
  check_live(slot, "column");
  return columns_[static_cast<size_t>(slot)];
}

void GramAccumulator::set_column(int64_t slot, const at::Tensor& given) {
  check_slot(slot, "set_column");
  // Note [Negative views] (lstsq.cpp): the dot products read raw memory.
  const at::Tensor column = given.defined() ? given.resolve_neg() : given;
  if (!column.defined() || column.dim() != 1 || column.size(0) == 0) {
    fail("set_column: the column must be a non-empty 1-D tensor");
  }
  // Refused here, before the dot products: a sparse column has no strided data to read,
  // and a meta one no data at all (either threw c10::Error from deep inside).
  if (column.layout() != at::kStrided) {
    fail("set_column: the column is a " + detail::layout_name(column) +
         " tensor; columns must be dense (strided): convert it with to_dense()");
  }
  if (!column.is_cpu() && !column.is_cuda()) {
    fail("set_column: the column is on " + column.device().str() +
         "; columns must be on the CPU or a CUDA device");
  }
  if (column.scalar_type() != at::kFloat && column.scalar_type() != at::kDouble) {
    fail("set_column: unsupported dtype " + std::string(c10::toString(column.scalar_type())) +
         "; columns must be float32 or float64");
  }
  std::vector<int64_t> others;
  std::vector<at::Tensor> targets{column};
  for (int64_t j = 0; j < capacity_; ++j) {
    const auto& existing = columns_[static_cast<size_t>(j)];
    if (j == slot || !existing.defined()) continue;
    if (existing.size(0) != column.size(0) || existing.scalar_type() != column.scalar_type() ||
        existing.device() != column.device()) {
      fail("set_column: the new column (" + std::to_string(column.size(0)) + " " +
           std::string(c10::toString(column.scalar_type())) + " on " + column.device().str() +
           ") does not match the live column in slot " + std::to_string(j) + " (" +
           std::to_string(existing.size(0)) + " " +
           std::string(c10::toString(existing.scalar_type())) +
           " on " + existing.device().str() + ")");
    }
    others.push_back(j);
    targets.push_back(existing);
  }
  const auto dots = detail::dots_with(column, targets);
  const double* d = dots.data_ptr<double>();
  if (!std::isfinite(d[0])) fail("set_column: the column contains NaN or Inf");
  // Validated: only now touch the state.
  columns_[static_cast<size_t>(slot)] = column;
  for (int64_t j = 0; j < capacity_; ++j) {
    entry(slot, j) = 0.0;
    entry(j, slot) = 0.0;
  }
  entry(slot, slot) = d[0];
  for (size_t i = 0; i < others.size(); ++i) {
    entry(slot, others[i]) = d[i + 1];
    entry(others[i], slot) = d[i + 1];
  }
}

void GramAccumulator::remove_column(int64_t slot) {
  check_live(slot, "remove_column");
  columns_[static_cast<size_t>(slot)] = at::Tensor();
  for (int64_t j = 0; j < capacity_; ++j) {
    entry(slot, j) = 0.0;
    entry(j, slot) = 0.0;
  }
}

void GramAccumulator::clear() {
  for (auto& column : columns_) column = at::Tensor();
  gram_.assign(gram_.size(), 0.0);
}

void GramAccumulator::recompute() {
  std::vector<int64_t> live;
  std::vector<at::Tensor> columns;
  for (int64_t j = 0; j < capacity_; ++j) {
    if (columns_[static_cast<size_t>(j)].defined()) {
      live.push_back(j);
      columns.push_back(columns_[static_cast<size_t>(j)]);
    }
  }
  gram_.assign(gram_.size(), 0.0);
  if (live.empty()) return;
  const auto G = detail::gram_of_columns(columns);
  const auto g = G.accessor<double, 2>();
  for (size_t a = 0; a < live.size(); ++a) {
    for (size_t b = 0; b < live.size(); ++b) entry(live[a], live[b]) = g[a][b];
  }
}

double GramAccumulator::inner_product(int64_t a, int64_t b) const {
  check_live(a, "inner_product");
  check_live(b, "inner_product");
  return entry(a, b);
}

at::Tensor GramAccumulator::gram(const std::vector<int64_t>& slots) const {
  const auto n = static_cast<int64_t>(slots.size());
  auto G = at::empty({n, n}, at::kDouble);
  auto g = G.accessor<double, 2>();
  for (int64_t a = 0; a < n; ++a) {
    check_live(slots[static_cast<size_t>(a)], "gram");
    for (int64_t b = 0; b < n; ++b)
      g[a][b] = entry(slots[static_cast<size_t>(a)], slots[static_cast<size_t>(b)]);
  }
  return G;
}

LstsqResult GramAccumulator::solve(const std::vector<int64_t>& a_slots, int64_t b_slot,
                                   const LstsqOptions& requested) const {
  // The same checks, in the same words, as lstsq: before the methods that delegate to it,
  // so that every method names this caller.
  detail::check_options(requested, "tidepool::linalg::GramAccumulator: solve");
  if (a_slots.empty()) fail("solve: no columns in a_slots");
  check_live(b_slot, "solve");
  for (const int64_t slot : a_slots) check_live(slot, "solve");

  std::vector<at::Tensor> a_columns;
  for (const int64_t slot : a_slots) a_columns.push_back(columns_[static_cast<size_t>(slot)]);
  const auto& b = columns_[static_cast<size_t>(b_slot)];
  if (requested.method == LstsqMethod::cholesky_qr || requested.method == LstsqMethod::svd) {
    return lstsq_columns(a_columns, b, requested);
  }

  std::vector<int64_t> slots = a_slots;
  slots.push_back(b_slot);
  const auto G = gram(slots);
  const auto k = static_cast<int64_t>(a_slots.size());
  // Note [Underflowing squares] (lstsq.cpp): a column whose squares underflow is not in G
  // to any accuracy; as lstsq does, automatic solves by the SVD from the columns and the
  // forced Gram methods refuse.
  // So does a right-hand side so small beside them that AᵀB's own products underflow.
  const int64_t tiny = detail::underflowing_column(a_columns, G, 0);
  if (tiny >= 0 || detail::underflowing_cross_products(a_columns, {b}, G) >= 0) {
    if (requested.method != LstsqMethod::automatic) {
      const std::string what =
          tiny >= 0 ? "the column in slot " +
                          std::to_string(a_slots[static_cast<size_t>(tiny)]) +
                          " is so small that its squares underflow float64 (entries below "
                          "~1e-154)"
                    : "the column in slot " + std::to_string(b_slot) +
                          " is so small beside the others that their products underflow "
                          "float64";
      fail("solve: " + what + ", which method " + method_name(requested.method) +
           " cannot resolve; rescale the columns, or use method automatic or svd");
    }
    LstsqOptions svd = requested;
    svd.method = LstsqMethod::svd;
    LstsqResult result = lstsq_columns(a_columns, b, svd);
    result.solution = result.solution.to(at::kDouble).cpu();  // automatic's contract
    return result;
  }
  const auto options = detail::resolve_defaults(requested, b.scalar_type(), b.size(0), k);
  const double rcond = options.rcond;

  // These methods return y in fp64 whatever the columns' dtype (the header says so), so
  // nothing is rounded and the residual is that of the fp64 y returned.
  constexpr auto kOutput = at::kDouble;
  std::optional<detail::SmallSolution> small;
  if (options.method == LstsqMethod::gram_eigh) {
    small = detail::solve_from_gram(G, k, options, rcond, LstsqMethod::gram_eigh, false, kOutput);
  } else {
    const bool forced = options.method == LstsqMethod::gram_cholesky;
    small = detail::solve_from_gram(G, k, options, rcond, LstsqMethod::gram_cholesky, !forced,
                                    kOutput);
    if (!small) {
      small =
          detail::solve_from_gram(G, k, options, rcond, LstsqMethod::gram_eigh, false, kOutput);
    }
  }
  // A right-hand side that small has lost bᵀb, and with it the Gram residual, and one
  // whose Gram residual overflowed: measured directly (rescaled blocks); so is any when
  // the caller asks (review finding: exact_residual was lstsq's only).
  if (options.exact_residual || detail::gram_residual_lost(small->residual_norms) ||
      detail::underflowing_column({b}, G, k) >= 0) {
    small->residual_norms = detail::direct_residual_norms(a_columns, {b}, small->x);
  }
  LstsqResult result;
  result.solution = small->x.squeeze(1);
  result.method = small->method;
  result.method_name = method_name(small->method);
  result.rank = small->rank;
  result.condition = small->condition;
  result.rcond = small->rcond;
  result.residual_norms = small->residual_norms;
  result.residual_norm = small->residual_norms.front();
  return result;
}

}  // namespace tidepool::linalg
