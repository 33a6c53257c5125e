// TieredPlacement: StateBuffers backed by TieredStore handles (see tiered_placement.h for
// streams, the prefetch schedule, the write-back modes and the peak measure).
#include "optimizers/tiered_placement.h"

#include <atomic>
#include <chrono>
#include <utility>

#include <c10/util/accumulate.h>

#if TIDEPOOL_HAVE_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace tidepool::optim {

const char* to_string(WriteBack mode) {
  switch (mode) {
    case WriteBack::automatic: return "automatic";
    case WriteBack::on_release: return "on_release";
    case WriteBack::on_demand: return "on_demand";
  }
  return "?";
}

namespace {

// Keys start at 1: 0 is the store's own key, for callers that bracket steps themselves.
std::uint64_t next_schedule_key() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// Whether `contents` enters the store on the device (Note [Creating on the device]).
bool copies_on_device(InitialCopy mode, const torch::Tensor& contents) {
  return mode == InitialCopy::on_device ||
         (mode == InitialCopy::automatic && contents.is_cuda());
}

// Note [Creating on the device]
// A CUDA tensor used to enter the store through host memory: a blocking copy to a
// pageable CPU tensor (which waits for the whole compute stream), then a host memcpy into
// the handle's pinned block. AADL stores a vector of the parameters' size every step, so
// that was a device-wide wait per 4 MiB chunk and the vector's bytes copied twice at
// host speed. Now the handle is created on the device (TieredStore::create with
// Tier::device: room as an acquire gets it), acquired on the use stream, filled there
// by a device-to-device copy, released dirty and, when this placement writes back on
// release, evicted: the store's D2H stream copies it to its pinned block after the use,
// overlapping what follows, and the copy is counted in the store's copy stats like every
// other write-back. No host wait, and bitwise the same bytes. If the store cannot make
// room now (every byte of the budget acquired), the buffer is created through host
// memory as before. create_zeros creates the handle in host memory, which the store
// fills with zeros: nothing to copy at all.
//
// Note [Overwriting on the device]
// overwrite() takes the route create() would take, into the handle the buffer already
// has: acquired on the use stream, filled there by a device-to-device copy, released
// dirty and written back (or kept) as a release would. The acquire is the store's
// acquire_to_overwrite: a handle written back since its last use gets its device buffer
// without loading the contents about to be replaced (Note [Acquiring to overwrite] in
// tiering/tiered_store.cpp), so writing over a buffer costs the copy and the write-back,
// where creating one allocated a host block and zeroed it on the calling thread, and
// zeroed a device buffer (and destroying the dropped one freed both). With no room on
// the device now (every byte of the budget acquired), the buffer is written through host
// memory, as create() does.
class TieredBuffer final : public StateBuffer {
 public:
  // A buffer of `sizes`/`options` holding `initial` (zeros when null), copied on the
  // device when `on_device` (Note [Creating on the device]).
  TieredBuffer(at::IntArrayRef sizes, const torch::TensorOptions& options,
               const torch::Tensor* initial, bool on_device, std::shared_ptr<TieredStore> store,
               Stream host_stream, int tag, WriteBack write_back,
               std::shared_ptr<TieredPlacement::Shared> shared)
      : StateBuffer(sizes, options),
        store_(std::move(store)),
        host_stream_(host_stream),
        write_back_(write_back),
        shared_(std::move(shared)) {
    const torch::Device device = options.device();
    const bool cuda_store = store_->backend().kind() == BackendKind::cuda;
    TORCH_CHECK(cuda_store == device.is_cuda(), "TieredPlacement: a ",
                store_->backend().name(), " tiered store cannot hold state for ", device,
                " tensors");
    TORCH_CHECK(!cuda_store || device.index() == store_->backend().device(),
                "TieredPlacement: the tiered store is on cuda:", store_->backend().device(),
                ", the state is for ", device, " tensors: use a store of that device");
#if !TIDEPOOL_HAVE_CUDA
    TORCH_CHECK(!device.is_cuda(), "TieredPlacement: CUDA state needs tidepool_optim built "
                "with CUDA (TIDEPOOL_HAVE_CUDA)");
#endif
    bytes_ = static_cast<std::size_t>(c10::multiply_integers(sizes)) *
             options.dtype().itemsize();
    TORCH_CHECK(bytes_ > 0, "TieredPlacement: an empty state tensor has no handle (the "
                "placement makes it resident)");
    // Counted first: whether this buffer is written back on release depends on it too.
    shared_->live_bytes += bytes_;
    try {
      if (initial == nullptr) {
        handle_ = store_->create(bytes_, tag);  // zeros
      } else if (on_device && create_on_device(*initial, tag)) {
        shared_->created_on_device++;
      } else {
        create_through_host(*initial, tag);
        shared_->created_through_host++;
      }
    } catch (...) {
      shared_->live_bytes -= bytes_;
      throw;
    }
    try {
      pageable_ = store_->host_tier(handle_) == HostTier::pageable;
    } catch (...) {
      // Only a query: a store that cannot answer it counts the buffer as pinned.
    }
    if (pageable_) shared_->pageable_bytes += bytes_;
  }
  ~TieredBuffer() override {
    try {
      if (acquired()) release(false);
      store_->destroy(handle_);
    } catch (const std::exception&) {
      // A destructor does not throw; the store frees what it still holds when it goes.
    }
    shared_->live_bytes -= bytes_;
    if (pageable_) shared_->pageable_bytes -= bytes_;
  }

 private:
  // The stream the state is used on (see tiered_placement.h).
  Stream use_stream() const {
#if TIDEPOOL_HAVE_CUDA
    if (options().device().is_cuda()) {
      return Stream{static_cast<void*>(
          c10::cuda::getCurrentCUDAStream(options().device().index()).stream())};
    }
#endif
    return host_stream_;
  }

  // Device bytes only grow inside prefetch and acquire: sampling after them sees the peak.
  void note_device_bytes() {
    const std::size_t now = store_->device_bytes();
    std::size_t peak = shared_->peak_device_bytes.load();
    while (now > peak && !shared_->peak_device_bytes.compare_exchange_weak(peak, now)) {
    }
  }

  // A load may move the host copy out of pageable memory (Note [Pageable blocks are
  // promoted] in tiering/host_promotion.cpp): pageable_bytes() follows it.
  void note_host_tier() noexcept {
    if (!pageable_) return;
    try {
      if (store_->host_tier(handle_) == HostTier::pageable) return;
    } catch (...) {
      return;  // only a query, as in the constructor
    }
    pageable_ = false;
    shared_->pageable_bytes -= bytes_;
  }

  bool write_back_on_release() const {
    switch (write_back_) {
      case WriteBack::on_release: return true;
      case WriteBack::on_demand: return false;
      case WriteBack::automatic: break;
    }
    return shared_->live_bytes.load() > store_->device_budget_bytes();
  }

  // `h`, acquired on `stream` at `ptr`: fills it with `contents` there and releases it
  // dirty, then writes it back now (on the D2H stream, after the copy) or keeps it, as a
  // release would. When the copy fails, `h` is released clean.
  void fill_acquired(TieredStore::Handle h, void* ptr, Stream stream,
                     const torch::Tensor& contents) {
    try {
      note_device_bytes();
      // CPU compute runs on this thread: wait for the handle's device copy first.
      if (!options().device().is_cuda()) store_->backend().stream_synchronize(stream);
      // On the use stream for CUDA tensors (the current one of their device).
      torch::from_blob(ptr, sizes(), options()).copy_(contents, /*non_blocking=*/true);
    } catch (...) {
      store_->release(h, /*dirty=*/false);
      throw;
    }
    store_->release(h, /*dirty=*/true);
    if (write_back_on_release()) store_->evict(h);
  }

  // Note [Creating on the device]. False, with nothing created, when the store has no
  // room for the handle on the device now.
  bool create_on_device(const torch::Tensor& initial, int tag) {
    TieredStore::Handle h = 0;
    try {
      h = store_->create(bytes_, tag, Tier::device);
    } catch (const TieringError&) {
      return false;
    }
    try {
      const Stream stream = use_stream();
      fill_acquired(h, store_->acquire(h, stream), stream, initial);
    } catch (...) {
      try {
        store_->destroy(h);
      } catch (const std::exception&) {
        // The copy's error is the one to report; the store frees the handle when it goes.
      }
      throw;
    }
    handle_ = h;
    return true;
  }

  void create_through_host(const torch::Tensor& initial, int tag) {
    handle_ = store_->create(bytes_, tag);
    try {
      write_through_host(initial);
    } catch (...) {
      store_->destroy(handle_);
      throw;
    }
  }

  // The host bytes of `contents` become the handle's (a CPU tensor's own, uncopied).
  void write_through_host(const torch::Tensor& contents) {
    const torch::Tensor host = contents.to(torch::kCPU).contiguous();
    store_->write(handle_, host.data_ptr());
  }

  // Note [Overwriting on the device].
  void do_overwrite(const torch::Tensor& contents) override {
    if (copies_on_device(shared_->initial_copy.load(), contents)) {
      const Stream stream = use_stream();
      void* ptr = nullptr;
      try {
        ptr = store_->acquire_to_overwrite(handle_, stream);
      } catch (const TieringError&) {
        // No room on the device now: through host memory below.
      }
      note_host_tier();  // whether the acquire went through or not
      if (ptr != nullptr) {
        fill_acquired(handle_, ptr, stream, contents);
        shared_->overwritten_on_device++;
        return;
      }
    }
    write_through_host(contents);
    shared_->overwritten_through_host++;
  }

  void do_prefetch() override {
    store_->prefetch(handle_, use_stream());
    note_device_bytes();
    note_host_tier();
  }
  torch::Tensor do_acquire() override {
    const auto start = std::chrono::steady_clock::now();
    const Stream stream = use_stream();
    void* ptr = store_->acquire(handle_, stream);
    note_host_tier();
    try {
      note_device_bytes();
      // CPU compute runs on this thread: wait for the stage-in before touching the bytes.
      if (!options().device().is_cuda()) store_->backend().stream_synchronize(stream);
      shared_->acquire_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now() - start)
                                      .count();
      return torch::from_blob(ptr, sizes(), options());
    } catch (...) {
      // StateBuffer::acquire failed, so no release() will come: the store's hold ends here.
      store_->release(handle_, /*dirty=*/false);
      note_host_tier();
      throw;
    }
  }
  void do_release(torch::Tensor& working, bool dirty) override {
    working = torch::Tensor();  // drop the view before the store may move the bytes
    store_->release(handle_, dirty);
  }
  // After the release: a write-back that fails (the copy to the host) leaves the store's
  // device copy resident and dirty, the handle released, so the buffer is released too;
  // the next acquire gets that copy, and a checkpoint reads it.
  void do_after_release() override {
    // evict() only enqueues: the D2H stream waits on an event of the use stream, copies
    // back (dirty) and frees the buffer after that; nothing here waits for the device.
    if (write_back_on_release()) store_->evict(handle_);
    note_host_tier();  // a load ahead of the store's may have moved it
  }
  torch::Tensor do_read_host() const override {
    torch::Tensor out = torch::empty(sizes(), options().device(torch::kCPU));
    store_->read(handle_, out.data_ptr());
    return out;
  }

  std::shared_ptr<TieredStore> store_;
  Stream host_stream_;
  WriteBack write_back_;
  std::shared_ptr<TieredPlacement::Shared> shared_;
  TieredStore::Handle handle_ = 0;
  std::size_t bytes_ = 0;
  bool pageable_ = false;  // the store put the host copy in pageable memory
};

}  // namespace

TieredPlacement::TieredPlacement(std::shared_ptr<TieredStore> store, Stream host_stream, int tag,
                                 WriteBack write_back)
    : store_(std::move(store)),
      host_stream_(host_stream),
      tag_(tag),
      write_back_(write_back),
      schedule_key_(next_schedule_key()) {
  TORCH_CHECK(store_ != nullptr, "TieredPlacement: the tiered store must not be null");
}

TieredPlacement::~TieredPlacement() { store_->retire_schedule(schedule_key_); }


// An empty state tensor (a parameter of shape {0}: the reference steps it, as a no-op) has
// no bytes for the store to hold, which refuses 0-byte handles: it is a resident tensor,
// as empty on the device as anywhere.
std::unique_ptr<StateBuffer> TieredPlacement::create(const torch::Tensor& initial) {
  if (initial.numel() == 0) return ResidentPlacement().create(initial);
  const bool on_device = copies_on_device(shared_->initial_copy.load(), initial);
  return std::make_unique<TieredBuffer>(initial.sizes(), initial.options(), &initial, on_device,
                                        store_, host_stream_, tag_, write_back_, shared_);
}

std::unique_ptr<StateBuffer> TieredPlacement::create_zeros(at::IntArrayRef sizes,
                                                           const torch::TensorOptions& options) {
  if (c10::multiply_integers(sizes) == 0) return ResidentPlacement().create_zeros(sizes, options);
  return std::make_unique<TieredBuffer>(sizes, options, nullptr, false, store_, host_stream_,
                                        tag_, write_back_, shared_);
}

}  // namespace tidepool::optim
