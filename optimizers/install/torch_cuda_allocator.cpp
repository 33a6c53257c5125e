// TorchCudaAllocator: LibTorch's CUDAPluggableAllocator over tidepool's PyTorch pair, with
// cacheInfo, recordStream, emptyCache, the memory statistics (getDeviceStats and both
// resets), the memory history and snapshot (memory_history.h), the profiler's memory
// events, the memory fraction and peer access connected to tidepool (see torch_cuda_allocator.h for
// why each one matters), and its one-time installation.
//
// Note [pluggable allocator in LibTorch]
// torch::cuda::CUDAPluggableAllocator (torch 2.11) takes the pair as
// std::function<void*(size_t, int, cudaStream_t)> and
// std::function<void(void*, size_t, int, cudaStream_t)>; its other hooks are either
// set_*_fn setters (record stream, reset = emptyCache) or virtual functions that raise
// (cacheInfo, resetPeakStats, getDeviceStats, ...), which a subclass overrides.
// changeCurrentAllocator makes an allocator c10's; LibTorch refuses (c10::Error) once
// its current allocator has been initialised, hence "before CUDA is first used".
#include "optimizers/install/torch_cuda_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/errors.h"
#include "allocator/pytorch_stats_fields.h"
#include "optimizers/install/memory_history.h"

namespace tidepool::optim {
namespace {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

// torch.profiler(profile_memory=True) and its memory timeline: c10's own allocator reports
// every allocation (its block's size) and free (negative) with the device's allocated and
// reserved bytes after it, and every out-of-memory; the pluggable class reports nothing.
// Only while a profiler on this thread asks for it (one thread-local lookup otherwise).
// Memory outside the caching allocator (optimizer state in pointer-stable ranges) is
// reported with the size asked for.
c10::Device cuda_device(int device) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
}
CachingAllocator::BytesInUse bytes_in_use(int device) {
  const CachingAllocator* allocator = existing_device_allocator(device);
  return allocator != nullptr ? allocator->bytes_in_use() : CachingAllocator::BytesInUse{};
}
std::size_t block_size(const void* ptr, std::size_t bytes, int device) {
  const CachingAllocator* allocator = existing_device_allocator(device);
  const std::size_t size = allocator != nullptr ? allocator->block_size(ptr) : 0;
  return size != 0 ? size : bytes;
}
void report_usage(void* ptr, std::int64_t signed_bytes, int device) {
  const CachingAllocator::BytesInUse in_use = bytes_in_use(device);
  c10::reportMemoryUsageToProfiler(ptr, signed_bytes, in_use.allocated, in_use.reserved,
                                   cuda_device(device));
}

// Note [per_process_memory_fraction in global mode]: PyTorch's own allocator caps each
// device at PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction (torch 2.11), a key
// tidepool leaves to PyTorch; with tidepool's allocator installed in its place, nothing
// read it and the cap was gone (review finding). So it is applied to each device at its
// first allocation here, as tidepool's memory fraction, unless the program set one for
// the device before (torch.cuda.set_per_process_memory_fraction, which reaches tidepool):
// applied at installation it would create a context on every device. A device's fraction
// is settled once: by the program's setMemoryFraction (any value, 1.0 included) or by this,
// whichever comes first, under one lock.
struct DeviceFractions {
  std::mutex mutex;
  std::array<std::atomic<bool>, kMaxDevices> settled{};
};
DeviceFractions& device_fractions() {
  static DeviceFractions fractions;
  return fractions;
}

void apply_configured_fraction(int device) {
  DeviceFractions& f = device_fractions();
  if (device < 0 || device >= kMaxDevices || f.settled[device].load(std::memory_order_acquire))
    return;
  const std::lock_guard lock(f.mutex);
  if (f.settled[device].load(std::memory_order_relaxed)) return;
  const double fraction =
      c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::per_process_memory_fraction();
  if (fraction < 1.0) {
    TORCH_CHECK(tidepool_set_memory_fraction(fraction, device) == 0,
                "tidepool: per_process_memory_fraction:", fraction, " (PYTORCH_CUDA_ALLOC_CONF) "
                "for device ", device, " failed: ", tidepool_last_error());
  }
  f.settled[device].store(true, std::memory_order_release);
}

// LibTorch does not check the pointer, so a failure must arrive as an exception (Note
// [OOM into PyTorch] in allocator/c_api.h): running out of memory as c10's
// OutOfMemoryError, what PyTorch's own allocator throws (Python: torch.OutOfMemoryError,
// which training loops catch to retry with a smaller batch), anything else as c10::Error.
// Both record into the allocator's memory history (memory_history.h) when it is on.
void* torch_alloc(MemoryHistory& history, size_t bytes, int device, cudaStream_t stream) {
  apply_configured_fraction(device);
  void* p = tidepool_malloc(static_cast<ssize_t>(bytes), device, stream);
  if (p != nullptr) {
    try {
      if (c10::memoryProfilingEnabled())
        report_usage(p, static_cast<std::int64_t>(block_size(p, bytes, device)), device);
      history.on_alloc(p, bytes, device, stream);
    } catch (...) {
      tidepool_pytorch_free(p, bytes, device, stream);  // the caller never gets p
      throw;
    }
    return p;
  }
  if (bytes == 0) return p;
  const std::string message = tidepool_last_error();
  if (tidepool_last_error_is_out_of_memory() != 0) {
    history.on_out_of_memory(device, bytes);  // PyTorch's OOM observers, then the error
    if (c10::memoryProfilingEnabled()) {
      const CachingAllocator::BytesInUse in_use = bytes_in_use(device);
      c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(bytes), in_use.allocated,
                                       in_use.reserved, cuda_device(device));
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, pytorch_out_of_memory_message(bytes, message));
  }
  TORCH_CHECK(false, message.empty() ? "tidepool: allocation failed" : message);
}

// Runs in a DataPtr's deleter: the memory is given back whatever the history or the
// profiler do, and nothing escapes (an exception there would end the process); a failure
// of theirs (out of host memory for their bookkeeping) loses them this one event.
void torch_free(MemoryHistory& history, void* ptr, size_t bytes, int device,
                cudaStream_t stream) noexcept {
  // Note [Forked child] (allocator/fork_guard.h): tidepool frees nothing there, and the
  // history's bookkeeping before the free takes the allocator's lock, which a parent
  // thread may have held at the fork (review finding: a DataLoader worker collecting a
  // CUDA tensor it inherited hung in the deleter while the history was on).
  if (tidepool_in_forked_child() != 0) return;
  std::size_t reported = 0;
  try {
    history.on_free(ptr, bytes, device, stream);  // while the memory is still tidepool's block
    if (c10::memoryProfilingEnabled()) reported = block_size(ptr, bytes, device);
  } catch (...) {
  }
  tidepool_pytorch_free(ptr, bytes, device, stream);
  try {
    history.on_freed(device);
  } catch (...) {
  }
  if (reported == 0) return;
  try {
    report_usage(ptr, -static_cast<std::int64_t>(reported), device);
  } catch (...) {
  }
}

// Tensor::record_stream (Note [record_stream from PyTorch] in allocator/c_api.h). Memory
// tidepool did not hand out is ignored, as c10's own allocator does.
void torch_record_stream(void* ptr, cudaStream_t stream) {
  TORCH_CHECK(tidepool_pytorch_record_stream(ptr, stream) >= 0,
              "tidepool: record_stream failed: ", tidepool_last_error());
}

// c10's emptyCache: every device's cached memory goes back, as c10's own allocator does.
void torch_empty_cache() {
  TORCH_CHECK(tidepool_empty_cache_all() == 0, "tidepool: empty_cache failed: ",
              tidepool_last_error());
}

// torch.cuda.set_per_process_memory_fraction: the cap binds all of tidepool's memory on
// the device (tidepool_set_memory_fraction).
void torch_set_memory_fraction(double fraction, int device) {
  DeviceFractions& f = device_fractions();
  const std::lock_guard lock(f.mutex);  // Note [per_process_memory_fraction in global mode]
  TORCH_CHECK(tidepool_set_memory_fraction(fraction, device) == 0,
              "tidepool: setMemoryFraction failed: ", tidepool_last_error());
  if (device >= 0 && device < kMaxDevices) f.settled[device].store(true, std::memory_order_release);
}

// Memory pools: torch.cuda.MemPool, and the private pool a CUDA graph capture allocates
// from (torch.cuda.graph, torch.compile(mode="reduce-overhead")). tidepool's global mode
// has no pools: the plain pluggable class ignores beginAllocateToPool, so memory a
// captured graph still uses would be handed out again after capture and the next replay
// would overwrite it. Refusing, with the way out, is the honest answer.
[[noreturn]] void refuse_pools(c10::DeviceIndex device) {
  TORCH_CHECK(false, "tidepool: memory pools (torch.cuda.MemPool, and the private pool of a "
              "CUDA graph capture: torch.cuda.graph, torch.compile(mode=\"reduce-overhead\")) "
              "are not supported in tidepool's global mode (device ", static_cast<int>(device),
              "): their memory would be reused outside the pool. Use tidepool.mode:pool, which "
              "keeps PyTorch's allocator for them");
}

// c10's DeviceStats from tidepool's PyTorch view (Note [PyTorch's view of the stats] in
// allocator/c_api.h), which is laid out as c10's struct: a copy, no interpretation.
using C10Stat = c10::CachingAllocator::Stat;
using detail::for_each_pytorch_stat;
static_assert(
    static_cast<int>(c10::CachingAllocator::StatType::AGGREGATE) == TIDEPOOL_POOL_ALL &&
    static_cast<int>(c10::CachingAllocator::StatType::SMALL_POOL) == TIDEPOOL_POOL_SMALL &&
    static_cast<int>(c10::CachingAllocator::StatType::LARGE_POOL) == TIDEPOOL_POOL_LARGE);

C10Stat to_c10(const tidepool_stat_v1& s) {
  C10Stat out;
  out.current = static_cast<int64_t>(s.current);
  out.peak = static_cast<int64_t>(s.peak);
  out.allocated = static_cast<int64_t>(s.allocated);
  out.freed = static_cast<int64_t>(s.freed);
  return out;
}

c10::CachingDeviceAllocator::DeviceStats device_stats(c10::DeviceIndex device) {
  tidepool_pytorch_stats_v1 v{};
  v.struct_size = sizeof v;
  TORCH_CHECK(tidepool_get_pytorch_stats_v1(device, &v) == 0, "tidepool: getDeviceStats of device ",
              static_cast<int>(device), " failed: ", tidepool_last_error());
  c10::CachingDeviceAllocator::DeviceStats out;
  for_each_pytorch_stat(
      out, v,
      [](c10::CachingAllocator::StatArray& to, const tidepool_stat_v1(&from)[3]) {
        for (std::size_t p = 0; p < to.size(); ++p) to[p] = to_c10(from[p]);
      },
      [](C10Stat& to, const tidepool_stat_v1& from) { to = to_c10(from); },
      [](int64_t& to, std::uint64_t from) { to = static_cast<int64_t>(from); });
  out.max_split_size = v.max_split_size;
  return out;
}

// CUDA IPC: torch.multiprocessing sharing a CUDA tensor with another process (a Queue,
// share_memory() of a CUDA model). tidepool's memory is mapped through CUDA virtual memory
// in ranges it may remap, which legacy IPC handles cannot describe; the plain class
// answers with an invitation to file a PyTorch issue. Refused with the way out instead.
[[noreturn]] void refuse_ipc() {
  TORCH_CHECK(false, "tidepool: sharing CUDA tensors between processes (CUDA IPC: "
              "torch.multiprocessing, share_memory() of CUDA tensors) is not supported in "
              "tidepool's global mode. Use tidepool.mode:pool, which keeps PyTorch's allocator "
              "for such tensors, or share CPU tensors");
}

class TorchCudaAllocator final : public Pluggable {
 public:
  TorchCudaAllocator() : TorchCudaAllocator(std::make_shared<MemoryHistory>()) {}

  // torch.cuda.memory._record_memory_history, _snapshot / _dump_snapshot (the memory
  // visualizer), memory_snapshot(), and the out-of-memory observers.
  void recordHistory(bool enabled,
                     c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries,
                     c10::cuda::CUDACachingAllocator::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    history_->record(enabled, context_recorder, alloc_trace_max_entries, when, clear_history,
                     skip_actions);
  }
  bool isHistoryEnabled() override { return history_->enabled(); }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool,
                                                        bool include_traces) override {
    return history_->snapshot(mempool, include_traces);
  }
  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    history_->attach_out_of_memory_observer(std::move(observer));
  }

  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t /*mempool_id*/,
                          std::shared_ptr<CUDAAllocator> /*allocator*/) override {
    refuse_pools(device);
  }
  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t /*mempool_id*/,
                           std::function<bool(cudaStream_t)> /*filter*/) override {
    refuse_pools(device);
  }

  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* /*ptr*/) override {
    refuse_ipc();
  }
  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override { refuse_ipc(); }

  double getMemoryFraction(c10::DeviceIndex device) override {
    // Note [per_process_memory_fraction in global mode]: until the first allocation on the
    // device applies the configured fraction (or the program sets one), the answer is the
    // one that allocation will apply (review finding: it was 1.0 until then).
    if (device >= 0 && device < kMaxDevices &&
        !device_fractions().settled[device].load(std::memory_order_acquire)) {
      return std::min(1.0, c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::
                               per_process_memory_fraction());
    }
    const double fraction = tidepool_get_memory_fraction(device);
    TORCH_CHECK(fraction >= 0.0, "tidepool: getMemoryFraction of device ",
                static_cast<int>(device), " failed: ", tidepool_last_error());
    return fraction;
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    TORCH_CHECK(tidepool_cache_info(device, largest_block) == 0, "tidepool: cacheInfo of device ",
                static_cast<int>(device), " failed: ", tidepool_last_error());
  }

  // torch.cuda.memory_stats() and everything that reads it (memory_allocated,
  // max_memory_reserved, memory_summary, ...), and LibTorch's getDeviceStats.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return device_stats(device);
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    TORCH_CHECK(tidepool_pytorch_reset_accumulated_stats(device) == 0,
                "tidepool: resetAccumulatedStats of device ", static_cast<int>(device),
                " failed: ", tidepool_last_error());
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(tidepool_reset_peak_stats(device) == 0, "tidepool: resetPeakStats of device ",
                static_cast<int>(device), " failed: ", tidepool_last_error());
  }

  // A zero-byte raw_alloc returns null, and the plain class keeps null in its map of live
  // pointers once: a second zero-byte buffer freed (two at once, e.g. Thrust temporaries)
  // would throw "not allocated here", possibly from a destructor. Null frees nothing, as in
  // c10's own allocator.
  void raw_delete(void* ptr) override {
    if (ptr != nullptr) Pluggable::raw_delete(ptr);
  }

  // NCCL's buffer registration (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK) attaches a
  // trace tracker, then registers every segment of snapshot() with each new communicator
  // and counts on the tracker's SEGMENT_FREE to deregister one. tidepool unmaps, moves and
  // releases the memory of its ranges (SEGMENT_UNMAP, which NCCL's hook ignores: PyTorch
  // turns the hook off for its own expandable segments for that reason), so NCCL would keep
  // registrations of pages no longer there, and memory mapped at those addresses later
  // would fall inside them. Accepting the tracker and not calling it was that; refused
  // here, with what to do, before ProcessGroupNCCL registers anything.
  void attachAllocatorTraceTracker(
      c10::cuda::CUDACachingAllocator::AllocatorTraceTracker /*tracker*/) override {
    TORCH_CHECK(false,
                "tidepool: allocator trace trackers (NCCL buffer registration, "
                "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) are not supported in "
                "tidepool's global mode: NCCL would keep registrations of memory tidepool "
                "remaps and releases. Unset TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK "
                "(NCCL runs without registered buffers)");
  }

  // A copy between devices: tidepool's memory is mapped through CUDA virtual memory for its
  // own device only, which a plain cudaMemcpyAsync across devices cannot rely on (c10's
  // expandable segments have the same rule); cudaMemcpyPeerAsync names both devices.
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (dst_device != src_device)
      return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
    return Pluggable::memcpyAsync(dst, dst_device, src, src_device, count, stream, p2p_enabled);
  }

  // PyTorch enables P2P before a kernel on `dev` reads memory of `dev_to_access` (a
  // cross-device copy with a dtype change or a non-contiguous source). The plain class
  // calls cudaDeviceEnablePeerAccess, which does not reach ranges mapped through CUDA VMM
  // (Note [Peer access to mapped ranges] in allocator/backend.h): tidepool's own grant
  // follows, as c10's allocator follows it with addPeerAccess for expandable segments.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    Pluggable::enablePeerAccess(dev, dev_to_access);
    TORCH_CHECK(tidepool_enable_peer_access(dev_to_access, dev) == 0,
                "tidepool: enablePeerAccess(", static_cast<int>(dev), ", ",
                static_cast<int>(dev_to_access), ") failed: ", tidepool_last_error());
  }

 private:
  explicit TorchCudaAllocator(std::shared_ptr<MemoryHistory> history)
      : Pluggable([history](size_t bytes, int device, cudaStream_t stream) {
                    return torch_alloc(*history, bytes, device, stream);
                  },
                  [history](void* ptr, size_t bytes, int device, cudaStream_t stream) {
                    torch_free(*history, ptr, bytes, device, stream);
                  }),
        history_(std::move(history)) {
    set_record_stream_fn(torch_record_stream);
    set_reset_fn([history = history_] {
      torch_empty_cache();
      history->on_empty_cache();  // the releases' SEGMENT_FREE / SEGMENT_UNMAP entries
    });
    set_memory_fraction_fn(torch_set_memory_fraction);
  }

  std::shared_ptr<MemoryHistory> history_;
};

std::mutex& install_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> make_torch_cuda_allocator() {
  return std::make_shared<TorchCudaAllocator>();
}

// Note [the installed allocator is never destroyed]
// What c10's CUDA allocator holds may belong to Python: the stacks of the memory history
// (trace entries, live blocks' allocation stacks) are PyTorch's CapturedTracebacks, whose
// destructor hands their Python frames to a free list in libtorch_python, and an
// out-of-memory observer from torch._C._cuda_attach_out_of_memory_observer holds a Python
// callable. LibTorch keeps the installed allocator in a static shared_ptr of
// libtorch_cuda (CUDAPluggableAllocator's current_custom_allocator), whose destructor
// runs at exit after Python is finalized and after libtorch_python's own statics (that
// free list among them) are destroyed, libtorch_python having been loaded later:
// destroying the allocator there wrote into the destroyed free list, and a program that
// had used torch.cuda.memory._record_memory_history died at exit with "double free or
// corruption" (H200, 2026-12-04). So one reference is never dropped: the allocator lives
// until the process is gone, as c10's own allocator leaks its trace ring for the same
// reason. (It must live that long anyway: c10's registry holds a plain pointer to it.)
void install_torch_cuda_allocator() {
  using Allocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;
  std::lock_guard lock(install_mutex());
  // A second swap would fail (ours is initialised by then) and gain nothing.
  static std::shared_ptr<Allocator>* installed = nullptr;  // never deleted once set
  if (installed != nullptr) return;
  auto holder = std::make_unique<std::shared_ptr<Allocator>>(make_torch_cuda_allocator());
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(*holder);
  installed = holder.release();
  // changeCurrentAllocator swaps what c10::cuda::CUDACachingAllocator calls, not c10's
  // registry of allocators by device type, where c10's own allocator stays otherwise:
  // torch.accelerator's memory functions (at::accelerator::getDeviceStats, emptyCache,
  // ...) and code that asks GetAllocator(kCUDA) would reach an allocator nobody uses.
  c10::SetAllocator(c10::DeviceType::CUDA, installed->get(), /*priority=*/0);
}

}  // namespace tidepool::optim

const char* tidepool_torch_cuda_built_for(void) { return TORCH_VERSION; }

int tidepool_torch_install_cuda_allocator(void) {
  try {
    tidepool::optim::install_torch_cuda_allocator();
    return 0;
  } catch (const c10::Error& e) {
    tidepool::set_last_error(
        std::string("tidepool: cannot make tidepool PyTorch's CUDA allocator: ") +
        e.what_without_backtrace());
  } catch (const std::exception& e) {
    tidepool::set_last_error(
        std::string("tidepool: cannot make tidepool PyTorch's CUDA allocator: ") + e.what());
  }
  return -1;
}
