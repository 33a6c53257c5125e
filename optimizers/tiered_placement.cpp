// TieredPlacement: StateBuffers backed by TieredStore handles (see tiered_placement.h).
#include "optimizers/tiered_placement.h"

#include <utility>

namespace tidepool::optim {

namespace {

class TieredBuffer final : public StateBuffer {
 public:
  TieredBuffer(const torch::Tensor& initial, std::shared_ptr<TieredStore> store, Stream stream,
               int tag)
      : StateBuffer(initial.sizes(), initial.options()),
        store_(std::move(store)),
        stream_(stream) {
    const bool cuda_store = store_->backend().kind() == BackendKind::cuda;
    TORCH_CHECK(cuda_store == initial.is_cuda(), "TieredPlacement: a ",
                store_->backend().name(), " tiered store cannot hold state for ",
                initial.device(), " tensors");
    TORCH_CHECK(initial.nbytes() > 0, "TieredPlacement: empty state tensors are not supported");
    const torch::Tensor host = initial.to(torch::kCPU).contiguous();
    handle_ = store_->create(host.nbytes(), tag);
    store_->write(handle_, host.data_ptr());
  }
  ~TieredBuffer() override {
    if (acquired()) release(false);
    store_->destroy(handle_);
  }

 private:
  void do_prefetch() override { store_->prefetch(handle_, stream_); }
  torch::Tensor do_acquire() override {
    void* ptr = store_->acquire(handle_, stream_);
    // CPU compute runs on this thread: wait for the stage-in before touching the bytes.
    if (!options().device().is_cuda()) store_->backend().stream_synchronize(stream_);
    return torch::from_blob(ptr, sizes(), options());
  }
  void do_release(torch::Tensor& working, bool dirty) override {
    working = torch::Tensor();  // drop the view before the store may move the bytes
    store_->release(handle_, dirty);
  }
  torch::Tensor do_read_host() const override {
    torch::Tensor out = torch::empty(sizes(), options().device(torch::kCPU));
    store_->read(handle_, out.data_ptr());
    return out;
  }

  std::shared_ptr<TieredStore> store_;
  Stream stream_;
  TieredStore::Handle handle_ = 0;
};

}  // namespace

TieredPlacement::TieredPlacement(std::shared_ptr<TieredStore> store, Stream stream, int tag)
    : store_(std::move(store)), stream_(stream), tag_(tag) {
  TORCH_CHECK(store_ != nullptr, "TieredPlacement: the tiered store must not be null");
}

std::unique_ptr<StateBuffer> TieredPlacement::create(const torch::Tensor& initial) {
  return std::make_unique<TieredBuffer>(initial, store_, stream_, tag_);
}

}  // namespace tidepool::optim
