// AndersonHistory: the ring buffer of parameter vectors and the incremental fp64 matrices of
// Anderson acceleration (see anderson_history.h for the algebra).
#include "optimizers/anderson_history.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <utility>

namespace tidepool::optim {

namespace {

// Hints the placement to load chunk c of columns [first, last), in pass order.
void prefetch_chunk(const std::deque<AndersonHistory::Column>& columns, size_t first,
                    size_t last, size_t c) {
  for (size_t i = first; i < last; ++i) columns[i][c]->prefetch();
}

// One pass over the history, chunk index by chunk index (see anderson_history.h): loads
// chunk 0 of every vector before the first acquire (Note [Loading the history ahead of
// use]), then for each c acquires chunk c of every vector, prefetches chunk c+1 of every
// vector, hands the acquired chunks to the caller as one fp64 m × length matrix per
// compute sub-chunk, releases chunk c unmodified (also when the use throws: StateLease).
// `newest`, when defined, is the contents of the last vector, already on the compute
// device (the vector push() has just stored): its chunks are read from there instead of
// being loaded back from the placement, which holds the same bytes.
class ChunkedPass {
 public:
  ChunkedPass(const std::deque<AndersonHistory::Column>& columns, torch::Tensor newest = {})
      : columns_(columns),
        newest_(std::move(newest)),
        stored_(columns.size() - (newest_.defined() ? 1 : 0)) {}

  // fn(start, X): X is the fp64 m × length matrix of rows [start, start + length).
  template <typename Fn>
  void run(Fn&& fn) {
    const size_t chunks = columns_.front().size();
    // Note [Sub-chunks per device] (anderson_history.h).
    const int64_t sub_chunk =
        AndersonHistory::compute_chunk(columns_.front().front()->options().device());
    prefetch_chunk(columns_, 0, stored_, 0);
    for (size_t c = 0; c < chunks; ++c) {
      Acquired acquired(columns_, stored_, c);
      if (c + 1 < chunks) prefetch_chunk(columns_, 0, stored_, c + 1);
      const int64_t base = static_cast<int64_t>(c) * AndersonHistory::kStoreChunk;
      const int64_t n = columns_.front()[c]->sizes()[0];
      if (newest_.defined()) acquired.tensors.push_back(newest_.narrow(0, base, n));
      for (int64_t offset = 0; offset < n; offset += sub_chunk) {
        const int64_t length = std::min(sub_chunk, n - offset);
        std::vector<torch::Tensor> slices;
        slices.reserve(acquired.tensors.size());
        for (const auto& t : acquired.tensors) slices.push_back(t.narrow(0, offset, length));
        fn(base + offset, torch::stack(slices).to(torch::kFloat64));
      }
    }
  }

 private:
  // Chunk c of the first `count` vectors, acquired (released unmodified when it goes).
  struct Acquired {
    Acquired(const std::deque<AndersonHistory::Column>& columns, size_t count, size_t c) {
      leases.reserve(count);
      for (size_t i = 0; i < count; ++i) {
        leases.emplace_back(*columns[i][c]);
        tensors.push_back(leases.back().tensor());
      }
    }
    std::vector<StateLease> leases;
    std::vector<torch::Tensor> tensors;
  };

  const std::deque<AndersonHistory::Column>& columns_;
  torch::Tensor newest_;
  size_t stored_;  // vectors read from the placement: all but a defined newest_
};

// The contents of one stored vector as one tensor on the compute device.
torch::Tensor gather(const AndersonHistory::Column& column) {
  std::vector<torch::Tensor> pieces;
  pieces.reserve(column.size());
  for (const auto& chunk : column) pieces.push_back(StateLease(*chunk).tensor().clone());
  return torch::cat(pieces);
}

}  // namespace

AndersonHistory::AndersonHistory(int64_t depth, std::shared_ptr<StatePlacement> placement)
    : depth_(depth), placement_(std::move(placement)) {
  TORCH_CHECK(depth_ >= 1, "AndersonHistory: depth must be >= 1, got ", depth_);
  TORCH_CHECK(placement_ != nullptr, "AndersonHistory: placement must not be null");
  gram_ = torch::zeros({0, 0}, torch::kFloat64);
  rhs_ = torch::zeros({0}, torch::kFloat64);
}

// Note [A failed push]: storing a vector and the pass that updates the matrices can fail
// (a tiered store that cannot load a chunk, a device out of memory). The columns and the
// matrices must stay in step (the Gram matrix of a history one column longer than it is
// makes every later pass fail, and an extrapolation read γ past its end), so push and
// replace_newest keep what they drop until the new vector is in, and put everything back
// when it is not: a failed call leaves the history as it was.
void AndersonHistory::push(const torch::Tensor& x) {
  const Rollback rollback{gram_, rhs_, length_};  // replaced, never written in place
  std::optional<Column> dropped;
  if (size() == depth_) {
    dropped = std::move(columns_.front());
    columns_.pop_front();
    // The oldest DR column goes with the oldest vector.
    if (gram_.size(0) > 0) gram_ = gram_.slice(0, 1).slice(1, 1).contiguous();
  }
  append_or_roll_back(x, rollback, [&] {
    if (dropped) columns_.push_front(std::move(*dropped));
  });
  if (dropped) keep_spare(std::move(*dropped));
}

void AndersonHistory::replace_newest(const torch::Tensor& x) {
  TORCH_CHECK(size() > 0, "AndersonHistory: replace_newest on an empty history");
  const Rollback rollback{gram_, rhs_, length_};
  Column dropped = std::move(columns_.back());
  drop_newest_column();
  append_or_roll_back(x, rollback, [&] { columns_.push_back(std::move(dropped)); });
  keep_spare(std::move(dropped));
}

template <class PutBackDropped>
void AndersonHistory::append_or_roll_back(const torch::Tensor& x, const Rollback& rollback,
                                          PutBackDropped put_back_dropped) {
  const size_t before = columns_.size();
  try {
    append(x);
  } catch (...) {
    if (columns_.size() > before) {  // stored, then the pass failed
      Column stored = std::move(columns_.back());
      columns_.pop_back();
      keep_spare(std::move(stored));
    }
    put_back_dropped();
    gram_ = rollback.gram;
    rhs_ = rollback.rhs;
    length_ = rollback.length;
    throw;
  }
}

void AndersonHistory::prefetch(Pass pass) const {
  const auto m = static_cast<size_t>(size());
  size_t first = 0, last = m;  // the stored vectors the pass reads
  switch (pass) {
    case Pass::after_push:
      // push drops the oldest when full; the pass runs once three vectors are held.
      if (m == static_cast<size_t>(depth_)) first = 1;
      if (m - first + 1 < 3) return;
      break;
    case Pass::after_replace_newest:
      // replace_newest drops the newest and stores x in its place.
      if (m < 3) return;
      last = m - 1;
      break;
    case Pass::combine:
      if (m < 2) return;
      break;
  }
  prefetch_chunk(columns_, first, last, 0);
}

void AndersonHistory::drop_newest_column() {
  columns_.pop_back();
  const int64_t k = gram_.size(0);
  if (k > 0) gram_ = gram_.slice(0, 0, k - 1).slice(1, 0, k - 1).contiguous();
}

AndersonHistory::Column AndersonHistory::store(const torch::Tensor& x) {
  const auto chunk = [&](size_t c) {
    const int64_t start = static_cast<int64_t>(c) * kStoreChunk;
    return x.narrow(0, start, std::min(kStoreChunk, x.numel() - start));
  };
  const auto chunks = static_cast<size_t>((x.numel() + kStoreChunk - 1) / kStoreChunk);
  // Note [Reusing dropped columns]. The spare fits a vector of the history's length; after
  // restore() (another length, dtype or device) it may not, and goes.
  Column column = std::exchange(spare_, Column());
  const bool fits = !column.empty() && column.size() == chunks &&
                    column.back()->sizes() == chunk(chunks - 1).sizes() &&
                    x.scalar_type() == column.front()->options().dtype() &&
                    x.device() == column.front()->options().device();
  if (fits) {
    try {
      for (size_t c = 0; c < chunks; ++c) column[c]->overwrite(chunk(c));
    } catch (...) {
      spare_ = std::move(column);
      throw;
    }
    return column;
  }
  column.clear();
  for (size_t c = 0; c < chunks; ++c) column.push_back(placement_->create(chunk(c)));
  return column;
}

void AndersonHistory::keep_spare(Column column) noexcept {
  if (placement_->reuse_dropped_buffers()) spare_ = std::move(column);
}

bool AndersonHistory::accepts(int64_t length, c10::ScalarType dtype,
                              const c10::Device& device) const {
  if (columns_.empty()) return true;
  const StateBuffer& first = *columns_.front().front();
  return length == length_ && dtype == first.options().dtype() &&
         device == first.options().device();
}

std::string AndersonHistory::describe_vectors() const {
  if (columns_.empty()) return "nothing";
  const StateBuffer& first = *columns_.front().front();
  std::ostringstream os;
  os << length_ << " elements of " << c10::typeMetaToScalarType(first.options().dtype()) << " on "
     << first.options().device();
  return os.str();
}

void AndersonHistory::append(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.numel() > 0, "AndersonHistory: vectors must be 1-D and not "
              "empty, got ", x.sizes());
  TORCH_CHECK(accepts(x.numel(), x.scalar_type(), x.device()), "AndersonHistory: vector of ",
              x.numel(), " elements of ", x.scalar_type(), " on ", x.device(),
              " does not match the stored ones (", describe_vectors(), ")");
  Column column = store(x);
  length_ = x.numel();
  columns_.push_back(std::move(column));
  update_matrices(x);
}

// The streaming pass after `newest` was appended: G's new row/column and all of c.
void AndersonHistory::update_matrices(const torch::Tensor& newest) {
  const int64_t m = size();
  if (m < 3) {
    gram_ = torch::zeros({0, 0}, torch::kFloat64);
    rhs_ = torch::zeros({0}, torch::kFloat64);
    return;
  }
  const int64_t k = m - 2;
  TORCH_INTERNAL_ASSERT(gram_.size(0) == k - 1, "AndersonHistory: Gram matrix out of step");
  const auto fp64 = columns_.front().front()->options().dtype(torch::kFloat64);
  torch::Tensor new_row = torch::zeros({k}, fp64);
  torch::Tensor rhs = torch::zeros({k}, fp64);
  ChunkedPass(columns_, newest).run([&](int64_t, const torch::Tensor& X) {
    const torch::Tensor DX = X.slice(0, 1) - X.slice(0, 0, m - 1);
    const torch::Tensor DR = DX.slice(0, 1) - DX.slice(0, 0, m - 2);
    new_row.add_(DR.matmul(DR[k - 1]));
    rhs.add_(DR.matmul(DX[m - 2]));
  });
  const torch::Tensor row = new_row.cpu();
  torch::Tensor gram = torch::zeros({k, k}, torch::kFloat64);
  if (k > 1) gram.slice(0, 0, k - 1).slice(1, 0, k - 1).copy_(gram_);
  gram.select(0, k - 1).copy_(row);
  gram.select(1, k - 1).copy_(row);
  gram_ = gram;
  rhs_ = rhs.cpu();
}

torch::Tensor AndersonHistory::combine(const torch::Tensor& u, const torch::Tensor& newest,
                                      const torch::Tensor& out) const {
  const int64_t m = size();
  TORCH_CHECK(m >= 2 && u.numel() == m - 1, "AndersonHistory::combine: ", u.numel(),
              " weights for ", m, " vectors");
  const StateBuffer& first = *columns_.front().front();
  const auto fits = [&](const torch::Tensor& t) {
    return !t.defined() || (t.dim() == 1 && t.numel() == length_ &&
                            t.scalar_type() == first.options().dtype() &&
                            t.device() == first.options().device());
  };
  TORCH_CHECK(fits(newest) && fits(out), "AndersonHistory::combine: the newest vector and the "
              "output must be 1-D tensors of ", length_, " elements (", first.options().dtype(),
              ", ", first.options().device(), ")");
  TORCH_CHECK(!out.defined() || out.is_contiguous(),
              "AndersonHistory::combine: the output must be contiguous");
  const torch::Tensor weights = u.to(first.options().dtype(torch::kFloat64));
  torch::Tensor result = out.defined() ? out : torch::empty({length_}, first.options());
  ChunkedPass(columns_, newest).run([&](int64_t start, const torch::Tensor& X) {
    const torch::Tensor DX = X.slice(0, 1) - X.slice(0, 0, m - 1);
    result.narrow(0, start, X.size(1)).copy_(X[m - 1] + weights.matmul(DX));
  });
  return result;
}

torch::Tensor AndersonHistory::newest() const {
  TORCH_CHECK(size() > 0, "AndersonHistory::newest on an empty history");
  return gather(columns_.back());
}

std::vector<torch::Tensor> AndersonHistory::read_host() const {
  std::vector<torch::Tensor> out;
  for (const auto& column : columns_) {
    std::vector<torch::Tensor> pieces;
    for (const auto& chunk : column) pieces.push_back(chunk->read_host());
    out.push_back(torch::cat(pieces));
  }
  return out;
}

void AndersonHistory::restore(const std::vector<torch::Tensor>& vectors,
                              const torch::Tensor& gram, const torch::Tensor& rhs,
                              const torch::TensorOptions& compute) {
  const int64_t m = static_cast<int64_t>(vectors.size());
  const int64_t k = matrix_order(m);
  TORCH_CHECK(m <= depth_, "AndersonHistory::restore: ", m, " vectors for depth ", depth_);
  TORCH_CHECK(gram.dim() == 2 && gram.size(0) == k && gram.size(1) == k && rhs.dim() == 1 &&
                  rhs.size(0) == k,
              "AndersonHistory::restore: matrices of shape ", gram.sizes(), " and ",
              rhs.sizes(), " do not fit ", m, " vectors");
  std::deque<Column> columns;
  for (const auto& v : vectors) {
    TORCH_CHECK(v.dim() == 1 && v.numel() > 0 && v.numel() == vectors.front().numel(),
                "AndersonHistory::restore: vectors must be 1-D, not empty and of one length");
    columns.push_back(store(v.to(compute)));
  }
  columns_ = std::move(columns);
  length_ = vectors.empty() ? 0 : vectors.front().numel();
  gram_ = gram.to(torch::kFloat64).cpu().contiguous();
  rhs_ = rhs.to(torch::kFloat64).cpu().contiguous();
}

std::unique_ptr<AndersonHistory> AndersonHistory::restored(
    const std::vector<torch::Tensor>& vectors, const torch::Tensor& gram, const torch::Tensor& rhs,
    const torch::TensorOptions& compute) const {
  auto history = std::make_unique<AndersonHistory>(depth_, placement_);
  history->restore(vectors, gram, rhs, compute);
  return history;
}

}  // namespace tidepool::optim
