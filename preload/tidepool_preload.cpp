// libtidepool_preload.so: LD_PRELOAD=libtidepool_preload.so routes any program's
// cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync through tidepool, with no code
// change and no Python, and releases in tidepool each stream the program destroys.
//
// How it works:
//   - It defines those four functions, cudaStreamDestroy, cudaIpcGetMemHandle (Note [IPC of
//     tidepool's memory]), cudaDeviceReset (Note [cudaDeviceReset under the shim]), the
//     _ptsz forms of the two stream-ordered ones (Note [per-thread default stream
//     programs]), cudaGetLastError/cudaPeekAtLastError (Note [last error]), and
//     (watched_calls.cpp, Note [calls the shim watches]) the runtime's other allocations
//     and memory-pool calls, which it forwards but watches. Preloaded, these
//     definitions come first in the global symbol scope, so every dynamically linked
//     caller (PyPI torch links libcudart dynamically) reaches them instead of libcudart's.
//   - Set-up (libraries.cpp): Note [two once-flags], Note [runtime version], where the real
//     libcudart and libtidepool are found, and the configuration from the environment.
//   - cudaMalloc → tidepool_malloc on the current device (which routes optimizer state,
//     when a caller tags it, to pointer-stable ranges itself); the shim remembers each
//     pointer with its size and device, because cudaFree gives neither. cudaFree of a
//     remembered pointer synchronises the device first (cudaFree's own contract, which
//     callers rely on) and → tidepool_free; when that synchronisation fails (another
//     thread captures a graph in global mode, a failed context) it answers that error
//     and the pointer stays the program's, as the runtime's failed cudaFree leaves it;
//     any other pointer goes to the real cudaFree
//     (Note [frees of memory tidepool holds] for the exception).
//   - Note [IPC of tidepool's memory]: cudaIpcGetMemHandle exports the whole allocation a
//     pointer lies in, and cudaIpcOpenMemHandle maps that allocation's start; a program
//     (PyTorch sharing a CUDA tensor) adds its own offset from the pointer it got. A block
//     tidepool serves lies inside a larger segment (or in a VMM mapping the runtime cannot
//     export), so the importer would read other bytes, silently. The shim refuses the
//     export of any pointer in memory tidepool holds with cudaErrorInvalidValue, and says
//     why once on stderr (not under tidepool.log:off); other pointers are forwarded.
//   - Note [cudaDeviceReset under the shim]: a reset destroys every allocation, stream and
//     event of the current device's context. tidepool's cache, its events and the shim's
//     ordering streams would outlive it: memory freed before the reset would be handed out
//     again over the new context (an illegal address, or another allocation's bytes). So
//     cudaDeviceReset first synchronises and gives tidepool's cache of that device back
//     (tidepool_empty_cache, while the context still lives), forgets the shim's pointers
//     on it, then forwards; from then on the device's allocations go to the runtime
//     unchanged, and the shim says so on stderr. tidepool's allocator of the device keeps
//     the ranges of the segments it could not give back (blocks handed out, never freed),
//     but the new context may hand those addresses out again, to the program's next
//     cudaMalloc there: so that memory no longer counts as tidepool's (Note [frees of
//     memory tidepool holds], Note [IPC of tidepool's memory]; the shim asks
//     tidepool_device_holds_address of the other devices), or that allocation's cudaFree
//     would be refused (a leak), and its export too. A free of a pointer from before the
//     reset goes to the runtime, which refuses it, as without the shim.
//     Nor is a stream of the device released in tidepool before cudaStreamDestroy (Note
//     [destroyed streams]): the streams tidepool knew there died with the context, and a
//     new one may have a dead one's handle. Other devices are served as before.
//   - Note [frees during capture]: CUDA turns a cudaFreeAsync on a stream being captured
//     into a free node of the graph, which only a graph allocation may be given; the
//     runtime refuses any other pointer. tidepool would instead free the block at once,
//     at capture time, and hand it out again while the graph's kernels, replayed later,
//     still use it. So a remembered pointer freed on a capturing stream is refused with
//     cudaErrorInvalidValue and stays the program's (said once on stderr).
//     A cudaMalloc whose block a cudaFreeAsync freed in the legacy stream's order waits
//     for that stream to pass the free first (Note [cudaMalloc after stream-ordered
//     frees], legacy_frees.cpp).
//   - Note [stream-ordered calls]: cudaMallocAsync → tidepool_malloc on the stream's
//     device (cudaStreamGetDevice) and on that stream, so the memory counts in tidepool's
//     budget and stats; cudaFreeAsync of a remembered pointer (from either malloc: CUDA
//     lets cudaFreeAsync free cudaMalloc's memory, and cudaFree free cudaMallocAsync's)
//     → tidepool_free on the given stream without synchronising: tidepool's stream
//     contract (caching_allocator.h) holds the block back until that stream passes the
//     free (a cudaFree frees on the NULL stream, after its synchronisation). Any other
//     pointer goes to the real cudaFreeAsync, so no tidepool pointer reaches the runtime
//     through either free (Note [streams tidepool is given] for which stream tidepool
//     is told). Also forwarded unchanged:
//     cudaMallocAsync of 0 bytes (the runtime's answer), on a stream being captured
//     into a graph (the graph owns such an allocation, and its cudaFreeAsync is a free
//     node: tidepool must not hand the memory out at capture time), on a device the
//     program gave a pool of its own, and cudaMallocFromPoolAsync (its memory is the
//     caller's pool's: the shim only retries it, Note [calls the shim watches]).
//   - Note [streams tidepool is given]: tidepool keys its pools by stream handle, and
//     orders a free on another stream by recording an event on that stream with an event
//     of the block's device. Three kinds of handle do not fit: cudaStreamLegacy (0x1) is
//     the NULL stream under another name, so it is given as NULL, not a stream with pools
//     of its own; cudaStreamPerThread (0x2) is one handle for a different stream in each
//     thread, so tidepool never keys anything by it (memory freed on one thread's stream
//     would be another thread's at once, and an event recorded on 0x2 by another thread
//     lands on that thread's stream); and a stream of another device than the block's
//     (CUDA lets cudaFreeAsync free on any stream; the NULL handle too names the current
//     device's stream) cannot take an event of the block's device. So cudaMallocAsync on
//     either default handle allocates on NULL (memory free in NULL's order is free for the
//     per-thread stream too: a blocking stream, its later work waits for NULL's earlier
//     work), and cudaFreeAsync on the per-thread stream or on another device's stream
//     frees on a non-blocking stream the shim keeps for the block's device, after making
//     it wait for an event the shim recorded on the given stream (on that stream's
//     device, the current one for the special handles): tidepool holds the block back
//     until that stream has passed the free, as for any free on a stream other than the
//     allocating one. If that ordering fails, the free fails with the runtime's error and
//     the pointer stays the program's, to free again.
//   - Note [per-thread default stream programs]: a program built with `nvcc
//     --default-stream per-thread` (or CUDA_API_PER_THREAD_DEFAULT_STREAM) calls
//     cudaMallocAsync_ptsz and cudaFreeAsync_ptsz instead of the plain functions, and
//     passes stream 0 meaning its thread's per-thread stream. The shim defines both, or a
//     cudaFreeAsync_ptsz of one of its pointers would reach the runtime (freeing tidepool
//     memory there), and its cudaMallocAsync_ptsz memory would bypass tidepool. They
//     behave as the plain ones with stream 0 read as cudaStreamPerThread (which the
//     shim's own calls name explicitly: the shim is not built per-thread, so its 0 is the
//     legacy stream); what the shim forwards goes to the real _ptsz function, with the
//     program's own stream argument. Of the other functions the shim defines,
//     cudaMallocFromPoolAsync has a _ptsz form too, which it retries as the plain one
//     (watched_calls.cpp); the rest have none in libcudart (cudaMalloc, cudaFree and
//     cudaStreamDestroy take no default stream).
//   - Note [destroyed streams]: tidepool keys pools, fences and thread-cache lists by
//     stream handle, and CUDA may give a destroyed stream's handle to the next stream
//     created: tidepool would then treat memory freed on the dead stream as the new
//     stream's, reusable at once, while the old stream's last kernels may still run (and
//     before that it would record events on a dead handle). So cudaStreamDestroy first
//     releases the stream in tidepool (tidepool_release_stream on the stream's device,
//     cudaStreamGetDevice; Note [Released streams] in allocator/stream_ordering.cpp),
//     then forwards. The release waits for the stream only when tidepool holds
//     something for it (Note [Releasing a stream tidepool never saw]), so destroying a
//     stream tidepool never saw does not block, as cudaStreamDestroy does not. A failed
//     release (a handle already invalid) does not stop the destroy: the shim says so once
//     on stderr (not under tidepool.log:off) and forwards anyway. Forwarded with no
//     release: the NULL, legacy and per-thread handles (the runtime refuses them), calls
//     made inside tidepool, every call while tidepool is not set up (it holds nothing
//     then; the destroy does not set it up) or does not serve (Note [runtime version]),
//     and a stream of a device that was reset (Note [cudaDeviceReset under the shim]).
//   - Note [frees of memory tidepool holds]: a pointer the shim does not own may still lie
//     in memory tidepool holds: freed twice, or an address inside a block. The runtime
//     must not see it: at the start of a segment tidepool got from cudaMalloc it would
//     free the segment under tidepool, which hands it out again (the runtime too), and
//     the program's bug would become silent corruption. Without the shim the runtime
//     answers a pointer it did not hand out (or no longer holds) with
//     cudaErrorInvalidValue; the shim answers that itself, for cudaFree and
//     cudaFreeAsync, after asking tidepool (tidepool_holds_address: slow, but only frees
//     of pointers the shim does not own pay it). Memory of a device that was reset does
//     not count (Note [cudaDeviceReset under the shim]).
//   - Note [errors keep CUDA's meaning]: cudaErrorMemoryAllocation for out-of-memory
//     (tidepool_last_error_is_out_of_memory) and for a size above tidepool's limit
//     (Note [sizes beyond any device]); for any other failure of tidepool_malloc or
//     tidepool_free (tidepool prints those itself) the CUDA error behind it
//     (tidepool_last_error_cuda_code: after a kernel faulted, cudaErrorIllegalAddress,
//     as the runtime would answer), else cudaErrorInvalidValue (a bad request).
//   - Note [sizes beyond any device]: tidepool_malloc rejects a size above 2^50
//     (kMaxRequest) as a bad request, not an out-of-memory, because for its callers
//     such a size is a bug (a negative size cast). The runtime has no such rule: it
//     answers cudaErrorMemoryAllocation for any size it cannot satisfy, and a program
//     under the shim must see the code it sees without it. The shim answers those sizes
//     itself, with the runtime's code and a message, before tidepool (and before the
//     cast to tidepool_malloc's ssize_t, which would make sizes above 2^63 negative).
//   - Note [re-entrancy]: libtidepool itself calls cudaMalloc/cudaFree, which would
//     resolve to this shim too: its cuda backend makes them in the runtime by handle
//     (Note [libtidepool's own calls under the shim] in allocator/backends/cuda_backend.cpp),
//     which covers libtidepool entered directly (its C ABI, tidepool.optim); for the
//     rest, a thread-local flag marks "inside tidepool"; calls
//     made then go straight to the real libcudart. Every scope that sets it restores the
//     value it found, so a nested call (tidepool's cudaFree inside its own malloc) does
//     not clear it for the rest of the outer call.
//   - Note [last error]: the runtime keeps, per thread, the last error any of its calls
//     produced, which cudaGetLastError returns and resets and cudaPeekAtLastError
//     returns; programs check it after kernel launches (PyTorch after each one) and some
//     after every call. Under the shim it would be wrong both ways: an error the shim
//     answers itself (tidepool's out-of-memory, a bad request) never reaches the
//     runtime, so cudaGetLastError said cudaSuccess after a failed cudaMalloc; and the
//     runtime calls the shim and tidepool make for themselves, whose failures they
//     handle (a fence event that cannot be created, a query of one not yet reached,
//     tidepool's backend clearing an error it reports itself), set the program's last
//     error to one no call of the program's produced, which its next launch check
//     reports, or cleared an error the program had not read yet. So every call the shim
//     serves takes the program's pending error out of the runtime first
//     (ProgramLastError), and at its end discards what its own calls left there and
//     holds, in a thread-local slot, the call's own error if it failed, else the
//     pending one. The shim's cudaGetLastError and cudaPeekAtLastError answer the
//     runtime's error when it has one (it is then the newer: the slot is filled only
//     after the runtime's is emptied; a sticky error stays in the runtime), else the
//     slot's. Calls the shim forwards leave both alone, as the runtime's own would, and
//     a call inside tidepool sees the runtime's alone, never the program's slot.
//     A NULL devPtr is forwarded, so that the runtime answers it as it does.
//   - Note [Forked child under the shim] (fork_handlers.cpp): the shim's locks are taken
//     around every fork; in a child forked after tidepool made an allocator, frees of the
//     shim's pointers succeed with no CUDA call and everything else is forwarded.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <utility>

#include "allocator/backend.h"
#include "allocator/size_classes.h"
#include "preload/shim.h"

namespace tidepool_preload {

constinit thread_local bool t_inside_tidepool = false;
constinit thread_local cudaError_t t_held_last_error = cudaSuccess;

ProgramLastError::ProgramLastError() : pending_(shim().cuda.get_last_error()) {}

ProgramLastError::~ProgramLastError() {
  (void)shim().cuda.get_last_error();  // the shim's and tidepool's own calls' errors
  if (answer_ != cudaSuccess) {
    t_held_last_error = answer_;
  } else if (pending_ != cudaSuccess) {
    t_held_last_error = pending_;
  }
}

bool device_was_reset(int device) { return has_device(shim().reset_devices, device); }

bool tidepool_device(int device) {
  return device >= 0 && device < tidepool::kMaxDevices && !device_was_reset(device);
}

bool uses_program_pool(int device) {
  const Shim& s = shim();
  return has_device(s.own_pool_devices, device) || has_device(s.shared_pool_devices, device);
}

bool serves_device(int device) { return tidepool_device(device) && !uses_program_pool(device); }

namespace {

// The answer to a call tidepool failed (not for running out of memory): the CUDA error
// behind its failure, else cudaErrorInvalidValue (Note [errors keep CUDA's meaning]).
cudaError_t cuda_error_of_last_failure() {
  const int code = shim().tp.last_error_cuda_code();
  return code != 0 ? static_cast<cudaError_t>(code) : cudaErrorInvalidValue;
}

// Serves an allocation through tidepool on `device` and `stream` (cudaMalloc: the NULL
// stream). `call` names the CUDA function in messages.
cudaError_t serve_malloc(const char* call, void** dev_ptr, size_t size, int device,
                         cudaStream_t stream) {
  Shim& s = shim();
  *dev_ptr = nullptr;
  if (size > tidepool::kMaxRequest) {  // Note [sizes beyond any device]
    if (!s.quiet) {
      say(call, std::string(": ") + std::to_string(size) +
                    " bytes is more than any device holds (tidepool's limit is 2^50 bytes)");
    }
    return cudaErrorMemoryAllocation;
  }
  void* ptr = nullptr;
  {
    InsideTidepool inside;
    ptr = s.tp.malloc(static_cast<ssize_t>(size), device, stream);
  }
  if (ptr == nullptr) {
    // Only a real out-of-memory is cudaErrorMemoryAllocation: callers free caches and
    // retry on it, which would hide a bad request. Anything else is libtidepool's message
    // (printed already) with the CUDA error behind it, when a CUDA call failed (a kernel
    // that faulted: cudaErrorIllegalAddress), else a bad request (a device tidepool
    // cannot serve).
    if (s.tp.last_error_is_out_of_memory() == 0) return cuda_error_of_last_failure();
    if (!s.quiet) say(call, std::string(": ") + s.tp.last_error());
    return cudaErrorMemoryAllocation;
  }
  {
    std::lock_guard lock(s.mutex);
    s.owned[ptr] = Allocation{size, device, stream};
  }
  set_device(s.served_devices, device);
  *dev_ptr = ptr;
  return cudaSuccess;
}

// Removes `ptr` from the shim's table; false when the shim did not hand it out.
bool take_owned(void* ptr, Allocation& out) {
  Shim& s = shim();
  std::lock_guard lock(s.mutex);
  const auto it = s.owned.find(ptr);
  if (it == s.owned.end()) return false;
  out = it->second;
  s.owned.erase(it);
  return true;
}

// Note [frees of memory tidepool holds]: whether a pointer the shim does not own lies in
// tidepool's memory all the same. A reset device's memory does not count (Note
// [cudaDeviceReset under the shim]): its new context may hand those addresses out again.
bool tidepool_holds(void* ptr) {
  Shim& s = shim();
  InsideTidepool inside;
  if (s.reset_devices.load(std::memory_order_acquire) == 0) return s.tp.holds_address(ptr) == 1;
  for (int device = 0; device < kResetTrackedDevices; ++device) {
    if (!device_was_reset(device) && s.tp.device_holds_address(device, ptr) == 1) return true;
  }
  return false;
}

// Puts back what take_owned removed, when the free fails: the pointer is still the
// program's, to free again. emplace: a newer allocation at the same address (tidepool
// handed it out again meanwhile) keeps its own entry.
void restore_owned(void* ptr, const Allocation& a) {
  Shim& s = shim();
  std::lock_guard lock(s.mutex);
  s.owned.emplace(ptr, a);
}

// Makes `device` current for a scope, then the program's device again.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    Shim& s = shim();
    error_ = s.cuda.get_device(&previous_);
    if (error_ == cudaSuccess && previous_ != device) {
      error_ = s.cuda.set_device(device);
      switched_ = error_ == cudaSuccess;
    }
  }
  ~CurrentDevice() {
    if (switched_) shim().cuda.set_device(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
};

// Whether `stream` is one of the handles that name a default stream (NULL,
// cudaStreamLegacy, cudaStreamPerThread) rather than a stream the program created.
bool names_a_default_stream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}

// The stream tidepool is told for an allocation on `stream` (Note [streams tidepool is
// given]).
cudaStream_t allocation_stream(cudaStream_t stream) {
  return names_a_default_stream(stream) ? nullptr : stream;
}

// The shim's own stream on `device` (Note [streams tidepool is given]).
cudaError_t ordering_stream(int device, cudaStream_t& out) {
  Shim& s = shim();
  std::lock_guard lock(s.ordering_mutex);
  if (const auto it = s.ordering_streams.find(device); it != s.ordering_streams.end()) {
    out = it->second;
    return cudaSuccess;
  }
  CurrentDevice on(device);
  if (on.error() != cudaSuccess) return on.error();
  cudaStream_t created = nullptr;
  if (const cudaError_t e = s.cuda.stream_create_with_flags(&created, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return e;
  }
  s.ordering_streams.emplace(device, created);
  out = created;
  return cudaSuccess;
}

// Makes `order` wait until `stream` (of `stream_device`) has passed what is queued on it.
cudaError_t wait_for_stream(cudaStream_t order, cudaStream_t stream, int stream_device) {
  Shim& s = shim();
  // An event is recorded on a stream of its own device; the NULL and per-thread handles
  // name the current device's streams.
  CurrentDevice on(stream_device);
  if (on.error() != cudaSuccess) return on.error();
  cudaEvent_t passed = nullptr;
  cudaError_t e = s.cuda.event_create_with_flags(&passed, cudaEventDisableTiming);
  if (e != cudaSuccess) return e;
  e = s.cuda.event_record(passed, stream);
  if (e == cudaSuccess) e = s.cuda.stream_wait_event(order, passed, 0);
  // The wait keeps what it needs: destroying the event does not disturb it.
  const cudaError_t destroyed = s.cuda.event_destroy(passed);
  return e != cudaSuccess ? e : destroyed;
}

// The stream tidepool frees a block of `block_device` on for a cudaFreeAsync on `stream`
// (Note [streams tidepool is given]).
cudaError_t free_stream(cudaStream_t stream, int block_device, cudaStream_t& out) {
  Shim& s = shim();
  int stream_device = 0;
  if (const cudaError_t e = s.cuda.stream_get_device(stream, &stream_device); e != cudaSuccess) {
    return e;
  }
  if (stream_device == block_device && stream != cudaStreamPerThread) {
    out = allocation_stream(stream);
    return cudaSuccess;
  }
  cudaStream_t order = nullptr;
  if (const cudaError_t e = ordering_stream(block_device, order); e != cudaSuccess) return e;
  if (const cudaError_t e = wait_for_stream(order, stream, stream_device); e != cudaSuccess) {
    return e;
  }
  out = order;
  return cudaSuccess;
}

// Gives a pointer the shim handed out (and take_owned removed) back to tidepool, freed on
// `stream`.
cudaError_t serve_free(void* ptr, const Allocation& a, cudaStream_t stream) {
  Shim& s = shim();
  {
    InsideTidepool inside;
    s.tp.clear_error();
    s.tp.free(ptr, a.size, a.device, stream);
  }
  // tidepool_free returns nothing: a failure shows only in the thread's last error, which
  // libtidepool has also printed. A failed free leaves the block allocated in tidepool
  // (Note [Failed frees] in allocator/frees.cpp: no event and no device synchronisation
  // could be had), so the pointer stays the program's, to free again, as after the
  // shim's own failures. It goes back to the table also when tidepool no longer owns it
  // (freed behind the shim's back): otherwise the next free of it would reach the real
  // runtime, which must never see a pointer into tidepool's memory.
  if (*s.tp.last_error() == '\0') return cudaSuccess;
  restore_owned(ptr, a);
  return cuda_error_of_last_failure();
}

using MallocAsync = cudaError_t (*)(void**, size_t, cudaStream_t);
using FreeAsync = cudaError_t (*)(void*, cudaStream_t);

// What stream 0 means to a program built per-thread (Note [per-thread default stream
// programs]), named so that the shim's own calls mean it too.
cudaStream_t per_thread_default(cudaStream_t stream) {
  return stream == nullptr ? cudaStreamPerThread : stream;
}

// cudaMallocAsync and its _ptsz form once the shim serves it (Note [stream-ordered
// calls]): `stream` as the program passed it, for `real` (the runtime's function of the
// same form); `meant`, the stream it names, for everything the shim does itself.
cudaError_t serve_malloc_async(const char* call, MallocAsync RealCudart::*real, void** dev_ptr,
                               size_t size, cudaStream_t stream, cudaStream_t meant) {
  Shim& s = shim();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (const cudaError_t e = s.cuda.stream_is_capturing(meant, &capture); e != cudaSuccess) {
    return e;
  }
  if (capture != cudaStreamCaptureStatusNone) return forward(real, dev_ptr, size, stream);
  int device = 0;
  if (const cudaError_t e = s.cuda.stream_get_device(meant, &device); e != cudaSuccess) return e;
  if (!serves_device(device)) {
    if (uses_program_pool(device) && !s.quiet && !s.said_program_pool.exchange(true)) {
      say(call, ": the program gave device " + std::to_string(device) +
                    " a memory pool of its own (cudaDeviceSetMemPool, or access to its default "
                    "pool with cudaMemPoolSetAccess): its stream-ordered allocations go to the "
                    "runtime, from that pool; cudaMalloc stays tidepool's (said once)");
    }
    return forward_retrying(device, real, dev_ptr, size, stream);
  }
  return serve_malloc(call, dev_ptr, size, device, allocation_stream(meant));
}

cudaError_t malloc_async(const char* call, MallocAsync RealCudart::*real, void** dev_ptr,
                         size_t size, cudaStream_t stream, cudaStream_t meant) {
  if (dev_ptr == nullptr || t_inside_tidepool || size == 0 || !ready() || in_forked_child()) {
    return forward(real, dev_ptr, size, stream);
  }
  ProgramLastError last_error;
  return last_error.answer(serve_malloc_async(call, real, dev_ptr, size, stream, meant));
}

// cudaFreeAsync and its _ptsz form of a pointer the shim handed out (take_owned removed
// it); `meant` as for serve_malloc_async.
cudaError_t serve_free_async(void* dev_ptr, const Allocation& a, cudaStream_t meant) {
  cudaStream_t stream_for_tidepool = nullptr;
  if (const cudaError_t e = free_stream(meant, a.device, stream_for_tidepool); e != cudaSuccess) {
    restore_owned(dev_ptr, a);
    return e;
  }
  // Note [cudaMalloc after stream-ordered frees]: reusable at once on the NULL stream,
  // whichever stream it was allocated on (review finding: only blocks of the NULL stream
  // were noted, but the block of a stream the program destroyed becomes the NULL stream's
  // at once when freed there). A block another live stream holds is held back by tidepool
  // anyway; noting it costs only an overlap check.
  if (stream_for_tidepool == nullptr) note_legacy_ordered_free(dev_ptr, a.size, a.device);
  return serve_free(dev_ptr, a, stream_for_tidepool);
}

void say_once_capture_free() {
  Shim& s = shim();
  if (s.quiet || s.said_capture_free.exchange(true)) return;
  say("cudaFreeAsync: ",
      "a pointer from cudaMalloc/cudaMallocAsync outside the capture was freed on a stream "
      "being captured into a CUDA graph; the runtime refuses that (a graph's free node takes "
      "only the graph's own allocations): refused with cudaErrorInvalidValue, the memory "
      "stays allocated (said once)");
}

// Note [frees during capture]: whether `meant` is being captured into a CUDA graph (an
// error asking counts as no: the free then goes on as before and meets that error).
bool capturing(cudaStream_t meant) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  return shim().cuda.stream_is_capturing(meant, &capture) == cudaSuccess &&
         capture != cudaStreamCaptureStatusNone;
}

cudaError_t free_async(FreeAsync RealCudart::*real, void* dev_ptr, cudaStream_t stream,
                       cudaStream_t meant) {
  if (dev_ptr == nullptr || t_inside_tidepool || !ready()) return forward(real, dev_ptr, stream);
  Allocation a{};
  const bool owned = take_owned(dev_ptr, a);
  if (in_forked_child()) return owned ? cudaSuccess : forward(real, dev_ptr, stream);
  if (!owned && !tidepool_holds(dev_ptr)) return forward(real, dev_ptr, stream);
  ProgramLastError last_error;
  if (owned && capturing(meant)) {
    restore_owned(dev_ptr, a);
    say_once_capture_free();
    return last_error.answer(cudaErrorInvalidValue);
  }
  return last_error.answer(owned ? serve_free_async(dev_ptr, a, meant) : cudaErrorInvalidValue);
}

// cudaMalloc of `size` > 0 bytes once the shim serves it.
cudaError_t serve_cuda_malloc(void** dev_ptr, size_t size) {
  int device = 0;
  if (const cudaError_t e = shim().cuda.get_device(&device); e != cudaSuccess) return e;
  // A device tidepool cannot serve (reset, or an index at or above its kMaxDevices) goes
  // to the runtime; its pool is no reason to (cudaMalloc never uses it).
  if (!tidepool_device(device)) return forward(&RealCudart::malloc, dev_ptr, size);
  if (const cudaError_t e = serve_malloc("cudaMalloc", dev_ptr, size, device, nullptr);
      e != cudaSuccess) {
    return e;
  }
  // Note [cudaMalloc after stream-ordered frees].
  if (const cudaError_t e = order_after_legacy_frees(*dev_ptr, size, device); e != cudaSuccess) {
    Allocation a{};
    if (take_owned(*dev_ptr, a)) serve_free(*dev_ptr, a, nullptr);  // nobody has used it
    *dev_ptr = nullptr;
    return e;
  }
  return cudaSuccess;
}

// cudaFree of a pointer the shim handed out (take_owned removed it).
cudaError_t serve_cuda_free(void* dev_ptr, const Allocation& a) {
  // cudaFree waits for the device; callers free memory kernels just used on that promise.
  cudaError_t synced = cudaSuccess;
  {
    CurrentDevice on(a.device);
    if (on.error() != cudaSuccess) {  // nothing waited for: the block is not freed
      restore_owned(dev_ptr, a);
      return on.error();
    }
    const uint64_t mark = legacy_frees_mark(a.device);
    synced = shim().cuda.device_synchronize();
    if (synced == cudaSuccess) legacy_frees_passed(a.device, mark);
  }
  // Nothing was waited for (another thread captures a graph in global mode, or the
  // context failed): the block stays the program's, as the runtime's cudaFree leaves its
  // memory when it fails, and kernels that may still use it cannot meet a reuse.
  if (synced != cudaSuccess) {
    restore_owned(dev_ptr, a);
    return synced;
  }
  return serve_free(dev_ptr, a, nullptr);
}

// What cudaStreamDestroy does before forwarding, when tidepool serves (Note [destroyed
// streams]): releases `stream` in tidepool, or says once why it could not.
void release_before_destroy(cudaStream_t stream) {
  Shim& s = shim();
  std::string failure;
  int device = 0;
  if (const cudaError_t e = s.cuda.stream_get_device(stream, &device); e != cudaSuccess) {
    failure = "cudaStreamGetDevice failed (error " + std::to_string(e) + ")";
  } else if (!tidepool_device(device)) {
    // Note [cudaDeviceReset under the shim]: tidepool's streams there are dead; a device
    // beyond tidepool's it never served.
    return;
  } else {
    InsideTidepool inside;
    s.tp.clear_error();
    if (s.tp.release_stream(device, stream) != 0) failure = s.tp.last_error();
  }
  if (!failure.empty() && !s.quiet && !s.said_release_failed.exchange(true)) {
    say("cudaStreamDestroy: ",
        "could not release the stream in tidepool first (" + failure +
            "); destroying it anyway. tidepool may order memory freed on it wrongly if "
            "its handle is reused (said once)");
  }
}

}  // namespace

}  // namespace tidepool_preload

using namespace tidepool_preload;

extern "C" {

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMalloc(void** dev_ptr, size_t size) {
  if (dev_ptr == nullptr || t_inside_tidepool || !ready() || in_forked_child()) {
    return forward(&RealCudart::malloc, dev_ptr, size);
  }
  if (size == 0) {
    *dev_ptr = nullptr;
    return cudaSuccess;
  }
  ProgramLastError last_error;
  return last_error.answer(serve_cuda_malloc(dev_ptr, size));
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaFree(void* dev_ptr) {
  // cudaFree(nullptr) is the classic "initialise the context" call: always CUDA's, and it
  // does not set tidepool up (forward resolves the real cudaFree itself).
  if (dev_ptr == nullptr || t_inside_tidepool || !ready()) {
    return forward(&RealCudart::free, dev_ptr);
  }
  Allocation a{};
  const bool owned = take_owned(dev_ptr, a);
  if (in_forked_child()) return owned ? cudaSuccess : forward(&RealCudart::free, dev_ptr);
  if (!owned && !tidepool_holds(dev_ptr)) return forward(&RealCudart::free, dev_ptr);
  ProgramLastError last_error;
  return last_error.answer(owned ? serve_cuda_free(dev_ptr, a) : cudaErrorInvalidValue);
}

// Note [stream-ordered calls].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocAsync(void** dev_ptr, size_t size,
                                                    cudaStream_t stream) {
  return malloc_async("cudaMallocAsync", &RealCudart::malloc_async, dev_ptr, size, stream,
                      stream);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaFreeAsync(void* dev_ptr, cudaStream_t stream) {
  return free_async(&RealCudart::free_async, dev_ptr, stream, stream);
}

// Note [per-thread default stream programs].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocAsync_ptsz(void** dev_ptr, size_t size,
                                                         cudaStream_t stream) {
  return malloc_async("cudaMallocAsync_ptsz", &RealCudart::malloc_async_ptsz, dev_ptr, size,
                      stream, per_thread_default(stream));
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaFreeAsync_ptsz(void* dev_ptr, cudaStream_t stream) {
  return free_async(&RealCudart::free_async_ptsz, dev_ptr, stream, per_thread_default(stream));
}

// Note [destroyed streams].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Shim& s = shim();
  if (!names_a_default_stream(stream) && !t_inside_tidepool &&
      s.serving.load(std::memory_order_acquire) && !in_forked_child()) {
    ProgramLastError last_error;
    release_before_destroy(stream);
  }
  return forward(&RealCudart::stream_destroy, stream);
}

// Note [cudaDeviceReset under the shim].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaDeviceReset() {
  Shim& s = shim();
  int device = -1;
  if (t_inside_tidepool || !s.serving.load(std::memory_order_acquire) || in_forked_child() ||
      s.cuda.get_device(&device) != cudaSuccess ||
      !tidepool_device(device)) {  // reset already, or never served: nothing to say
    return forward(&RealCudart::device_reset);
  }
  {
    ProgramLastError last_error;
    InsideTidepool inside;
    (void)s.cuda.device_synchronize();  // the reset waits too; the cache is freed after it
    s.tp.clear_error();
    const bool emptied = s.tp.empty_cache(device) == 0;
    set_device(s.reset_devices, device);
    std::size_t dropped = 0;
    {
      std::lock_guard lock(s.mutex);
      for (auto it = s.owned.begin(); it != s.owned.end();) {
        if (it->second.device == device) {
          dropped += it->second.size;
          it = s.owned.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (!s.quiet) {
      say("cudaDeviceReset: ",
          "tidepool no longer serves device " + std::to_string(device) +
              " in this process: its allocations go to the runtime unchanged" +
              (emptied ? std::string() : " (its cache could not be given back first: " +
                                              std::string(s.tp.last_error()) + ")") +
              (dropped == 0 ? std::string()
                            : "; " + std::to_string(dropped) +
                                  " bytes it had handed out and not freed are gone with the "
                                  "reset, as the runtime's are"));
    }
  }
  return forward(&RealCudart::device_reset);
}

// Note [IPC of tidepool's memory].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle,
                                                        void* dev_ptr) {
  Shim& s = shim();
  if (dev_ptr == nullptr || t_inside_tidepool || !s.serving.load(std::memory_order_acquire) ||
      in_forked_child() || !tidepool_holds(dev_ptr)) {
    return forward(&RealCudart::ipc_get_mem_handle, handle, dev_ptr);
  }
  ProgramLastError last_error;
  if (!s.quiet && !s.said_ipc_refused.exchange(true)) {
    say("cudaIpcGetMemHandle: ",
        "CUDA IPC of memory tidepool serves is not supported: the runtime would export the "
        "whole segment the block lies in, and the importer would map other bytes than the "
        "block's; refused with cudaErrorInvalidValue (said once). Run the sharing process "
        "without the shim, or allocate the shared tensors outside it");
  }
  return last_error.answer(cudaErrorInvalidValue);
}

// Note [last error].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaGetLastError() {
  const cudaError_t runtimes = forward(&RealCudart::get_last_error);
  if (t_inside_tidepool) return runtimes;
  const cudaError_t held = std::exchange(t_held_last_error, cudaSuccess);
  return runtimes != cudaSuccess ? runtimes : held;
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaPeekAtLastError() {
  const cudaError_t runtimes = forward(&RealCudart::peek_at_last_error);
  if (t_inside_tidepool || runtimes != cudaSuccess) return runtimes;
  return t_held_last_error;
}

// For tidepool's Python start-up hook (python/src/tidepool/_startup.py), which stands aside
// only for a shim that serves: 1 when the shim is set up and serves the allocations (it
// claimed the tidepool keys), 0 when it is set up and off (it forwards every call and said
// why on stderr: no runtime found, another CUDA major, no libtidepool; the keys are still
// in the variables), -1 when it is not set up yet (nothing named tidepool at start-up; it
// sets up at the first cudaMalloc). Sets nothing up.
TIDEPOOL_PRELOAD_EXPORT int tidepool_preload_state() {
  Shim& s = shim();
  if (!s.set_up.load(std::memory_order_acquire)) return -1;
  return s.ready ? 1 : 0;
}

// For the same hook and tidepool.install() when PyTorch's variables name tidepool only
// after the process started (set at run time, before CUDA starts): the shim sets up now,
// claiming the keys before PyTorch reads them (it would reject them), not at the first
// cudaMalloc. What the first cudaMalloc would do: a configuration it cannot apply ends the
// process, as there (the hook checks the keys first). Returns tidepool_preload_state().
TIDEPOOL_PRELOAD_EXPORT int tidepool_preload_set_up() {
  (void)ready();
  return tidepool_preload_state();
}

}  // extern "C"
