// What the LD_PRELOAD shim's two files share (libraries.cpp sets up, tidepool_preload.cpp
// serves the interposed calls): the real libcudart's and libtidepool's functions, the
// shim's state, the re-entrancy guard (Note [re-entrancy]) and forwarding.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <unordered_map>

#include "allocator/backend.h"
#include "allocator/c_api.h"

// The functions the shim defines for the program (the library is built with hidden
// visibility).
#define TIDEPOOL_PRELOAD_EXPORT __attribute__((visibility("default")))

namespace tidepool_preload {

struct RealCudart {
  cudaError_t (*malloc)(void**, size_t) = nullptr;
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*get_device)(int*) = nullptr;
  cudaError_t (*set_device)(int) = nullptr;
  cudaError_t (*device_synchronize)() = nullptr;
  cudaError_t (*runtime_get_version)(int*) = nullptr;
  cudaError_t (*get_last_error)() = nullptr;  // Note [last error]
  cudaError_t (*peek_at_last_error)() = nullptr;
  // Note [stream-ordered calls]; bound apart (see resolve_cudart): older runtimes lack them.
  cudaError_t (*malloc_async)(void**, size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*stream_get_device)(cudaStream_t, int*) = nullptr;
  cudaError_t (*stream_is_capturing)(cudaStream_t, cudaStreamCaptureStatus*) = nullptr;
  cudaError_t (*stream_destroy)(cudaStream_t) = nullptr;  // Note [destroyed streams]
  // Note [per-thread default stream programs]; bound apart, as cudaStreamDestroy is.
  cudaError_t (*malloc_async_ptsz)(void**, size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async_ptsz)(void*, cudaStream_t) = nullptr;
  // Note [streams tidepool is given].
  cudaError_t (*stream_create_with_flags)(cudaStream_t*, unsigned) = nullptr;
  cudaError_t (*event_create_with_flags)(cudaEvent_t*, unsigned) = nullptr;
  cudaError_t (*event_record)(cudaEvent_t, cudaStream_t) = nullptr;
  cudaError_t (*stream_wait_event)(cudaStream_t, cudaEvent_t, unsigned) = nullptr;
  cudaError_t (*event_destroy)(cudaEvent_t) = nullptr;
  // Note [cudaMalloc after stream-ordered frees].
  cudaError_t (*event_query)(cudaEvent_t) = nullptr;
  cudaError_t (*stream_synchronize)(cudaStream_t) = nullptr;
  cudaError_t (*ipc_get_mem_handle)(cudaIpcMemHandle_t*, void*) = nullptr;  // Note [IPC ...]
  cudaError_t (*device_reset)() = nullptr;  // Note [cudaDeviceReset under the shim]
  // Note [calls the shim watches] (watched_calls.cpp): the other allocations, retried once
  // after tidepool's cache is given back, and the calls that make a device's stream-ordered
  // allocations the program's own pool's.
  cudaError_t (*malloc_pitch)(void**, size_t*, size_t, size_t) = nullptr;
  cudaError_t (*malloc_3d)(cudaPitchedPtr*, cudaExtent) = nullptr;
  cudaError_t (*malloc_managed)(void**, size_t, unsigned) = nullptr;
  cudaError_t (*malloc_array)(cudaArray_t*, const cudaChannelFormatDesc*, size_t, size_t,
                              unsigned) = nullptr;
  cudaError_t (*malloc_3d_array)(cudaArray_t*, const cudaChannelFormatDesc*, cudaExtent,
                                 unsigned) = nullptr;
  cudaError_t (*malloc_from_pool_async)(void**, size_t, cudaMemPool_t, cudaStream_t) = nullptr;
  cudaError_t (*malloc_from_pool_async_ptsz)(void**, size_t, cudaMemPool_t,
                                             cudaStream_t) = nullptr;
  cudaError_t (*device_set_mem_pool)(int, cudaMemPool_t) = nullptr;
  cudaError_t (*device_get_default_mem_pool)(cudaMemPool_t*, int) = nullptr;
  cudaError_t (*mem_pool_set_access)(cudaMemPool_t, const cudaMemAccessDesc*, size_t) = nullptr;
  cudaError_t (*device_enable_peer_access)(int, unsigned) = nullptr;  // Note [peer access ...]
  cudaError_t (*get_device_count)(int*) = nullptr;  // Note [device memory only]
  cudaError_t (*mem_get_info)(size_t*, size_t*) = nullptr;  // Note [free memory under ...]
};

struct TidepoolAbi {
  void* (*malloc)(ssize_t, int, void*) = nullptr;
  void (*free)(void*, size_t, int, void*) = nullptr;
  const char* (*last_error)() = nullptr;
  void (*clear_error)() = nullptr;
  int (*last_error_is_out_of_memory)() = nullptr;
  int (*last_error_cuda_code)() = nullptr;  // Note [errors keep CUDA's meaning]
  int (*install_from_env)(char*, size_t) = nullptr;
  int (*config_apply)(const char*, char*, size_t) = nullptr;
  size_t (*config_active_json)(char*, size_t) = nullptr;
  int (*release_stream)(int, void*) = nullptr;
  int (*holds_address)(const void*) = nullptr;  // Note [frees of memory tidepool holds]
  int (*in_forked_child)() = nullptr;            // Note [Forked child under the shim]
  int (*empty_cache)(int) = nullptr;             // Note [cudaDeviceReset under the shim]
  // tidepool_holds_address of one device: the shim asks it once some device was reset
  // (Note [cudaDeviceReset under the shim]).
  int (*device_holds_address)(int, const void*) = nullptr;
  // Note [peer access under the shim] (watched_calls.cpp).
  int (*enable_peer_access)(int, int) = nullptr;
  // Note [free memory under the shim] (watched_calls.cpp).
  int (*get_stats_v1)(int, tidepool_stats_v1*) = nullptr;
};

struct Allocation {
  size_t size;
  int device;
  cudaStream_t stream;  // the stream tidepool allocated it on
};

// The device indices the Shim's device sets (reset_devices, ...) have a bit for.
inline constexpr int kResetTrackedDevices = 64;

struct Shim {
  std::once_flag cuda_once;  // resolves `cuda` (Note [two once-flags])
  bool serve = false;        // the runtime has tidepool's major (Note [runtime version])
  std::once_flag once;       // sets up tidepool
  // Note [Forked child under the shim]: held while either once-flag's function runs (a
  // fork waits for it), and whether each has run (the calls' fast path, without it).
  std::mutex setup_mutex;
  std::atomic<bool> cuda_resolved{false};
  std::atomic<bool> set_up{false};
  // Set in a child whose fork waited for the set-up that loaded libtidepool.
  std::atomic<bool> forked_during_setup{false};
  bool ready = false;   // both libraries loaded, configuration applied
  bool verbose = false;  // tidepool.log:info or debug
  bool quiet = false;    // tidepool.log:off
  // `ready`, readable without setting tidepool up (Note [destroyed streams]).
  std::atomic<bool> serving{false};
  std::atomic<bool> said_release_failed{false};
  std::atomic<bool> said_capture_free{false};  // Note [frees during capture]
  std::atomic<bool> said_ipc_refused{false};   // Note [IPC of tidepool's memory]
  // Note [cudaDeviceReset under the shim]: devices tidepool no longer serves, one bit per
  // index below kResetTrackedDevices (the allocator's 0..kMaxDevices-1 among them; any
  // other index is never served).
  std::atomic<std::uint64_t> reset_devices{0};
  // Note [calls the shim watches]: devices whose current memory pool the program set to
  // one of its own (cudaDeviceSetMemPool), and devices whose default pool it gave other
  // devices access to (cudaMemPoolSetAccess), one bit per index below kMaxDevices: their
  // cudaMallocAsync goes to the runtime.
  std::atomic<std::uint64_t> own_pool_devices{0};
  std::atomic<std::uint64_t> shared_pool_devices{0};
  // Devices tidepool served an allocation on (bit per index below kMaxDevices): only their
  // caches can be given back (give_cache_back makes no allocator for another).
  std::atomic<std::uint64_t> served_devices{0};
  std::atomic<bool> said_program_pool{false};
  RealCudart cuda;
  // Note [a runtime found late] (libraries.cpp): no runtime was found when `cuda` was
  // resolved; `late_cudart` is the one found since, published once, never freed.
  bool cudart_missing = false;
  std::atomic<const RealCudart*> late_cudart{nullptr};
  TidepoolAbi tp;
  std::mutex mutex;  // guards `owned`
  std::unordered_map<void*, Allocation> owned;
  // Per device, the stream cross-stream frees are ordered on (Note [streams tidepool is
  // given]); created at the first such free, never destroyed. A lock of its own: it is
  // held across CUDA calls, which must not wait for `owned`.
  std::mutex ordering_mutex;
  std::unordered_map<int, cudaStream_t> ordering_streams;
};

// The one Shim, never destroyed: cudaFree may run from late destructors.
Shim& shim();

// Note [re-entrancy] (tidepool_preload.cpp): set while the thread is inside tidepool.
extern constinit thread_local bool t_inside_tidepool;

// Note [re-entrancy]: restores the value it found, not false, so that the end of a
// nested call leaves the outer one still "inside".
class InsideTidepool {
 public:
  InsideTidepool() : previous_(t_inside_tidepool) { t_inside_tidepool = true; }
  ~InsideTidepool() { t_inside_tidepool = previous_; }
  InsideTidepool(const InsideTidepool&) = delete;
  InsideTidepool& operator=(const InsideTidepool&) = delete;

 private:
  bool previous_;
};

// Note [last error] (tidepool_preload.cpp): the program's last error while the runtime
// does not hold it.
extern constinit thread_local cudaError_t t_held_last_error;

// Note [last error]: for a call the shim serves, from before its first runtime call to
// the end; answer() passes the call's result through. Only once the runtime is resolved.
class ProgramLastError {
 public:
  ProgramLastError();
  ~ProgramLastError();
  ProgramLastError(const ProgramLastError&) = delete;
  ProgramLastError& operator=(const ProgramLastError&) = delete;
  cudaError_t answer(cudaError_t e) {
    answer_ = e;
    return e;
  }

 private:
  cudaError_t pending_;
  cudaError_t answer_ = cudaSuccess;
};

// Whether `device` is in `devices` (one of the Shim's sets of devices).
inline bool has_device(const std::atomic<std::uint64_t>& devices, int device) {
  return device >= 0 && device < kResetTrackedDevices &&
         (devices.load(std::memory_order_acquire) >> device & 1u) != 0;
}

// Puts `device` in `devices` (or, with `in` false, takes it out). Only tidepool's indices
// (below kMaxDevices) are kept: no other is ever served, so none needs a bit.
inline void set_device(std::atomic<std::uint64_t>& devices, int device, bool in = true) {
  if (device < 0 || device >= tidepool::kMaxDevices) return;
  const std::uint64_t bit = std::uint64_t{1} << device;
  if (in) {
    devices.fetch_or(bit, std::memory_order_acq_rel);
  } else {
    devices.fetch_and(~bit, std::memory_order_acq_rel);
  }
}

// Note [cudaDeviceReset under the shim]: whether tidepool no longer serves `device`.
bool device_was_reset(int device);

// Whether tidepool may serve `device` at all: one of its indices (below kMaxDevices), not
// reset. Any other device's calls go to the runtime.
bool tidepool_device(int device);

// Whether tidepool serves stream-ordered allocations on `device`: a tidepool_device not
// given a pool of the program's own (Note [calls the shim watches]).
bool serves_device(int device);

// Note [calls the shim watches]: whether the program gave `device` a pool of its own.
bool uses_program_pool(int device);

// Says "tidepool preload: <what><message>" on stderr.
void say(const char* what, const std::string& message);

// Resolves the forwarding target once (Note [two once-flags] in libraries.cpp).
void resolve_cudart_once();

// Note [a runtime found late]: the runtime loaded after `cuda` found none, or null.
const RealCudart* cudart_found_late();

// Sets tidepool up once; whether it serves allocations (libraries.cpp).
bool ready();

// Note [Forked child under the shim] (fork_handlers.cpp).
// Takes the shim's locks around every fork from now on. Once, when the shim is loaded.
void register_fork_handlers();
// Whether this process is a child that may not use tidepool. Only once ready().
bool in_forked_child();

// Note [cudaMalloc after stream-ordered frees] (legacy_frees.cpp); `device` is the current
// device in each.
// Before tidepool frees, in the legacy stream's order, a block it allocated on the NULL
// stream.
void note_legacy_ordered_free(void* ptr, size_t size, int device);
// After cudaMalloc got [ptr, ptr + size): waits for the legacy stream when that memory was
// freed in its order and the stream may not have passed the free. The runtime's error.
cudaError_t order_after_legacy_frees(void* ptr, size_t size, int device);
// Taken before a synchronisation of `device`; after it succeeded, legacy_frees_passed
// forgets the frees noted before the mark.
uint64_t legacy_frees_mark(int device);
void legacy_frees_passed(int device, uint64_t mark);
// The lock of those frees, for the fork handlers alone.
std::mutex& legacy_frees_mutex();

// The real runtime's function `fn`, for calls tidepool does not serve (its own, pointers
// it does not own, or all of them when it is off). Resolves the target first: the call
// may be the process's first (cudaFree(NULL) before tidepool is set up, Note [two
// once-flags]).
template <typename Fn, typename... Args>
cudaError_t forward(Fn RealCudart::*fn, Args... args) {
  Shim& s = shim();
  resolve_cudart_once();
  Fn real = s.cuda.*fn;
  if (real == nullptr) {
    const RealCudart* late = cudart_found_late();
    if (late == nullptr || late->*fn == nullptr) return cudaErrorInitializationError;
    real = late->*fn;
  }
  InsideTidepool inside;
  return real(args...);
}

// Note [calls the shim watches] (watched_calls.cpp): after an allocation the runtime
// failed for memory, gives back tidepool's cache on `device`; whether a retry may find
// more room (tidepool serves the device and emptied its cache).
bool give_cache_back(int device);

// A forwarded allocation for `device`, retried once after give_cache_back when the runtime
// answers cudaErrorMemoryAllocation. For callers that hold a ProgramLastError (or whose
// call must leave the last error as the runtime's own would, see forward_allocation).
template <typename Fn, typename... Args>
cudaError_t forward_retrying(int device, Fn RealCudart::*fn, Args... args) {
  cudaError_t e = forward(fn, args...);
  if (e == cudaErrorMemoryAllocation && give_cache_back(device)) e = forward(fn, args...);
  return e;
}

// An allocation the shim forwards on the current device: retried as forward_retrying says
// while tidepool serves, with the program's last error kept as one call would leave it.
template <typename Fn, typename... Args>
cudaError_t forward_allocation(Fn RealCudart::*fn, Args... args) {
  Shim& s = shim();
  if (t_inside_tidepool || !s.serving.load(std::memory_order_acquire) || in_forked_child()) {
    return forward(fn, args...);
  }
  ProgramLastError last_error;
  int device = -1;
  if (s.cuda.get_device(&device) != cudaSuccess) device = -1;  // no retry: forward as is
  return last_error.answer(forward_retrying(device, fn, args...));
}

}  // namespace tidepool_preload
