// AndersonHistory: the ring buffer of parameter vectors and the incremental fp64 matrices of
// Anderson acceleration (see anderson_history.h for the algebra).
#include "optimizers/anderson_history.h"

#include <algorithm>
#include <utility>

namespace tidepool::optim {

namespace {

// Elements per column per chunk of a streaming pass: with the deepest history (15) the fp64
// chunk matrices stay around 30 MiB, small next to what they stream.
constexpr int64_t kChunk = int64_t{1} << 18;

// Acquires every buffer for the duration of one pass and releases them unmodified.
class AcquiredColumns {
 public:
  explicit AcquiredColumns(const std::deque<std::unique_ptr<StateBuffer>>& buffers)
      : buffers_(buffers) {
    for (const auto& buffer : buffers_) columns_.push_back(buffer->acquire());
  }
  ~AcquiredColumns() {
    for (const auto& buffer : buffers_) buffer->release(/*dirty=*/false);
  }
  AcquiredColumns(const AcquiredColumns&) = delete;
  AcquiredColumns& operator=(const AcquiredColumns&) = delete;

  // Rows [start, start + length) of every column as an fp64 m × length matrix.
  torch::Tensor chunk(int64_t start, int64_t length) const {
    std::vector<torch::Tensor> slices;
    slices.reserve(columns_.size());
    for (const auto& column : columns_) slices.push_back(column.narrow(0, start, length));
    return torch::stack(slices).to(torch::kFloat64);
  }
  int64_t length() const { return columns_.front().numel(); }
  const torch::Tensor& front() const { return columns_.front(); }

 private:
  const std::deque<std::unique_ptr<StateBuffer>>& buffers_;
  std::vector<torch::Tensor> columns_;
};

}  // namespace

AndersonHistory::AndersonHistory(int64_t depth, std::shared_ptr<StatePlacement> placement)
    : depth_(depth), placement_(std::move(placement)) {
  TORCH_CHECK(depth_ >= 1, "AndersonHistory: depth must be >= 1, got ", depth_);
  TORCH_CHECK(placement_ != nullptr, "AndersonHistory: placement must not be null");
  gram_ = torch::zeros({0, 0}, torch::kFloat64);
  rhs_ = torch::zeros({0}, torch::kFloat64);
}

void AndersonHistory::push(const torch::Tensor& x) {
  if (size() == depth_) {
    columns_.pop_front();
    // The oldest DR column goes with the oldest vector.
    if (gram_.size(0) > 0) gram_ = gram_.slice(0, 1).slice(1, 1).contiguous();
  }
  append(x);
}

void AndersonHistory::replace_newest(const torch::Tensor& x) {
  TORCH_CHECK(size() > 0, "AndersonHistory: replace_newest on an empty history");
  drop_newest_column();
  append(x);
}

void AndersonHistory::drop_newest_column() {
  columns_.pop_back();
  const int64_t k = gram_.size(0);
  if (k > 0) gram_ = gram_.slice(0, 0, k - 1).slice(1, 0, k - 1).contiguous();
}

void AndersonHistory::append(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 1, "AndersonHistory: vectors must be 1-D, got ", x.sizes());
  if (!columns_.empty()) {
    const auto& first = *columns_.front();
    TORCH_CHECK(x.numel() == first.sizes()[0] && x.scalar_type() == first.options().dtype() &&
                    x.device() == first.options().device(),
                "AndersonHistory: vector of length ", x.numel(), " (", x.scalar_type(), ", ",
                x.device(), ") does not match the stored ones (length ", first.sizes()[0], ")");
  }
  columns_.push_back(placement_->create(x));
  update_matrices();
}

// The streaming pass after a vector was appended: G's new row/column and all of c.
void AndersonHistory::update_matrices() {
  const int64_t m = size();
  if (m < 3) {
    gram_ = torch::zeros({0, 0}, torch::kFloat64);
    rhs_ = torch::zeros({0}, torch::kFloat64);
    return;
  }
  const int64_t k = m - 2;
  TORCH_INTERNAL_ASSERT(gram_.size(0) == k - 1, "AndersonHistory: Gram matrix out of step");
  AcquiredColumns columns(columns_);
  const auto fp64 = columns.front().options().dtype(torch::kFloat64);
  torch::Tensor new_row = torch::zeros({k}, fp64);
  torch::Tensor rhs = torch::zeros({k}, fp64);
  const int64_t n = columns.length();
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t length = std::min(kChunk, n - start);
    const torch::Tensor X = columns.chunk(start, length);
    const torch::Tensor DX = X.slice(0, 1) - X.slice(0, 0, m - 1);
    const torch::Tensor DR = DX.slice(0, 1) - DX.slice(0, 0, m - 2);
    new_row.add_(DR.matmul(DR[k - 1]));
    rhs.add_(DR.matmul(DX[m - 2]));
  }
  const torch::Tensor row = new_row.cpu();
  torch::Tensor gram = torch::zeros({k, k}, torch::kFloat64);
  if (k > 1) gram.slice(0, 0, k - 1).slice(1, 0, k - 1).copy_(gram_);
  gram.select(0, k - 1).copy_(row);
  gram.select(1, k - 1).copy_(row);
  gram_ = gram;
  rhs_ = rhs.cpu();
}

torch::Tensor AndersonHistory::combine(const torch::Tensor& u) const {
  const int64_t m = size();
  TORCH_CHECK(m >= 2 && u.numel() == m - 1, "AndersonHistory::combine: ", u.numel(),
              " weights for ", m, " vectors");
  AcquiredColumns columns(columns_);
  const torch::Tensor& like = columns.front();
  const torch::Tensor weights = u.to(like.options().dtype(torch::kFloat64));
  torch::Tensor out = torch::empty_like(like);
  const int64_t n = columns.length();
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t length = std::min(kChunk, n - start);
    const torch::Tensor X = columns.chunk(start, length);
    const torch::Tensor DX = X.slice(0, 1) - X.slice(0, 0, m - 1);
    out.narrow(0, start, length).copy_(X[m - 1] + weights.matmul(DX));
  }
  return out;
}

torch::Tensor AndersonHistory::newest() const {
  TORCH_CHECK(size() > 0, "AndersonHistory::newest on an empty history");
  StateBuffer& buffer = *columns_.back();
  torch::Tensor copy = buffer.acquire().clone();
  buffer.release(/*dirty=*/false);
  return copy;
}

std::vector<torch::Tensor> AndersonHistory::read_host() const {
  std::vector<torch::Tensor> out;
  for (const auto& buffer : columns_) out.push_back(buffer->read_host());
  return out;
}

void AndersonHistory::restore(const std::vector<torch::Tensor>& vectors,
                              const torch::Tensor& gram, const torch::Tensor& rhs,
                              const torch::TensorOptions& compute) {
  const int64_t m = static_cast<int64_t>(vectors.size());
  const int64_t k = std::max<int64_t>(m - 2, 0);
  TORCH_CHECK(m <= depth_, "AndersonHistory::restore: ", m, " vectors for depth ", depth_);
  TORCH_CHECK(gram.dim() == 2 && gram.size(0) == k && gram.size(1) == k && rhs.dim() == 1 &&
                  rhs.size(0) == k,
              "AndersonHistory::restore: matrices of shape ", gram.sizes(), " and ",
              rhs.sizes(), " do not fit ", m, " vectors");
  std::deque<std::unique_ptr<StateBuffer>> columns;
  for (const auto& v : vectors) {
    TORCH_CHECK(v.dim() == 1 && v.numel() == vectors.front().numel(),
                "AndersonHistory::restore: vectors must be 1-D and of one length");
    columns.push_back(placement_->create(v.to(compute)));
  }
  columns_ = std::move(columns);
  gram_ = gram.to(torch::kFloat64).cpu().contiguous();
  rhs_ = rhs.to(torch::kFloat64).cpu().contiguous();
}

}  // namespace tidepool::optim
