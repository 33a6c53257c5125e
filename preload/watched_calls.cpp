// Runtime calls the LD_PRELOAD shim forwards but watches (libtidepool_preload.so): the
// allocations tidepool does not serve, retried after tidepool gives its cache back, and
// the memory-pool calls after which a device's stream-ordered allocations are the
// program's own pool's.
//
// Note [calls the shim watches]
// Two things a program may do beside cudaMalloc and cudaMallocAsync that tidepool serving
// those would otherwise get wrong:
//   - Other allocations. cudaMallocPitch, cudaMalloc3D, cudaMallocManaged, cudaMallocArray,
//     cudaMalloc3DArray and cudaMallocFromPoolAsync go to the runtime unchanged, but the
//     memory the program freed through cudaFree stays in tidepool's cache (a free in
//     tidepool caches; its own allocations give the cache back when they run out, the
//     runtime's cannot). Without the shim that memory would have been the driver's again,
//     so such an allocation could fail under the shim where it succeeds without it. When
//     the runtime answers cudaErrorMemoryAllocation the shim gives back tidepool's cache
//     on the device (tidepool_empty_cache) and asks once more; the program sees the
//     second answer, and its last error as that one call would have left it. The same
//     goes for a cudaMallocAsync the shim forwards (below). Allocations the shim never
//     sees (the driver API's cuMemAlloc and cuMemCreate, another process) cannot be
//     helped so: a program calls tidepool_empty_cache itself for them (libtidepool is
//     loaded into the global scope, so dlsym(RTLD_DEFAULT, "tidepool_empty_cache") finds
//     it), as PyTorch's users call torch.cuda.empty_cache().
//   - A pool of the program's own. cudaMallocAsync allocates from the device's current
//     memory pool, whose properties the program may rely on: a pool it made and made
//     current (cudaDeviceSetMemPool: its export handle types, its release threshold), or
//     the default pool after cudaMemPoolSetAccess gave other devices access to it (their
//     kernels then read the memory without peer access of their own). tidepool's memory
//     has none of that. So once the program sets a device's current pool to one that is
//     not the default, or sets access on the default pool, the shim stops serving that
//     device's cudaMallocAsync (and _ptsz) and forwards it (said once, at the first one
//     forwarded); setting the default pool back as current makes tidepool serve again
//     unless access was set on it. Noted before tidepool is set up too (a program may set
//     its pools before its first allocation). cudaMalloc does not use pools and stays
//     tidepool's. Frees need nothing: a pointer the shim did not hand out is the
//     runtime's.
//
// Note [peer access under the shim]
// cudaDeviceEnablePeerAccess gives the current device access to a peer's cudaMalloc
// memory, but not to memory mapped through CUDA's virtual memory management, which is what
// tidepool hands out (expandable segments): a program that enabled peer access and then
// read another device's buffer from a kernel faulted under the shim (review finding;
// PyTorch does this for copies between devices). So after the runtime enabled it (or
// found it enabled), the shim grants the same access to tidepool's memory of the peer
// device, now and for its mappings to come (tidepool_enable_peer_access, which sets
// tidepool up first, as a cudaMalloc would). Disabling is forwarded alone: memory that
// stays reachable breaks no program. A grant tidepool refuses (the runtime allowed it, so
// it should not) is said on stderr; the program gets the runtime's answer.
//
// Note [free memory under the shim]
// Without the shim, memory a program gave back with cudaFree is the driver's again and
// cudaMemGetInfo counts it free. Under the shim it stays in tidepool's cache, where every
// cudaMalloc and cudaMallocAsync tidepool serves still gets it (tidepool frees its cache
// before it fails), and cudaMemGetInfo would count it used: programs that size what they
// allocate by the free memory (a KV cache or a workspace sized to what is free, a pool of
// a fraction of it) would take less under the shim, or refuse to start (review finding).
// So for the current device, when tidepool has served allocations there, the runtime's
// `free` gets tidepool's cached bytes on that device added (reserved less allocated: what
// its caching allocator holds unused), at most up to `total`. What is then taken through
// a path the shim does not serve (cuMemAlloc, another process) can find that memory still
// cached: the first item above says what helps then. The question leaves the program's
// last error as the call alone would.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "allocator/backend.h"
#include "preload/shim.h"

namespace tidepool_preload {

bool give_cache_back(int device) {
  Shim& s = shim();
  // A device tidepool never served has no cache, and asking would make its allocator.
  if (!tidepool_device(device) || !has_device(s.served_devices, device)) return false;
  InsideTidepool inside;
  s.tp.clear_error();
  return s.tp.empty_cache(device) == 0;
}

namespace {

// The device (one tidepool may serve) whose default memory pool `pool` is, or -1. Asks
// device after device until the runtime says there is no such device.
int device_of_default_pool(cudaMemPool_t pool) {
  Shim& s = shim();
  if (s.cuda.device_get_default_mem_pool == nullptr) return -1;
  for (int device = 0; device < tidepool::kMaxDevices; ++device) {
    cudaMemPool_t default_pool = nullptr;
    if (s.cuda.device_get_default_mem_pool(&default_pool, device) != cudaSuccess) break;
    if (default_pool == pool) return device;
  }
  return -1;
}

// Note [free memory under the shim]: the bytes tidepool's caching allocator holds unused on
// `device`; 0 for a device it never served (asking would make its allocator) or when the
// figures cannot be read.
std::size_t cached_bytes(int device) {
  Shim& s = shim();
  if (!tidepool_device(device) || !has_device(s.served_devices, device)) return 0;
  InsideTidepool inside;
  s.tp.clear_error();
  tidepool_stats_v1 stats{};
  stats.struct_size = static_cast<std::uint32_t>(offsetof(tidepool_stats_v1, segments_acquired));
  if (s.tp.get_stats_v1(device, &stats) != 0) return 0;
  return static_cast<std::size_t>(stats.cached_bytes);
}

// Whether the pool calls below are the program's own (tidepool's are not watched) and the
// runtime the shim forwards to is the one resolved at set-up (the questions they ask it
// go there). Noted whether or not tidepool is set up yet: it may be at the next cudaMalloc.
bool watching() {
  return !t_inside_tidepool && !in_forked_child() && shim().cuda.get_last_error != nullptr;
}

}  // namespace

}  // namespace tidepool_preload

using namespace tidepool_preload;

extern "C" {

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocPitch(void** dev_ptr, size_t* pitch, size_t width,
                                                    size_t height) {
  return forward_allocation(&RealCudart::malloc_pitch, dev_ptr, pitch, width, height);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMalloc3D(cudaPitchedPtr* pitched, cudaExtent extent) {
  return forward_allocation(&RealCudart::malloc_3d, pitched, extent);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocManaged(void** dev_ptr, size_t size,
                                                      unsigned flags) {
  return forward_allocation(&RealCudart::malloc_managed, dev_ptr, size, flags);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocArray(cudaArray_t* array,
                                                    const cudaChannelFormatDesc* desc,
                                                    size_t width, size_t height,
                                                    unsigned flags) {
  return forward_allocation(&RealCudart::malloc_array, array, desc, width, height, flags);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMalloc3DArray(cudaArray_t* array,
                                                      const cudaChannelFormatDesc* desc,
                                                      cudaExtent extent, unsigned flags) {
  return forward_allocation(&RealCudart::malloc_3d_array, array, desc, extent, flags);
}

// From a pool the program names: always the runtime's. The retry gives back the cache of
// the current device (the pool's may be another; its room is the device's memory all
// the same when they are one).
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocFromPoolAsync(void** dev_ptr, size_t size,
                                                            cudaMemPool_t pool,
                                                            cudaStream_t stream) {
  return forward_allocation(&RealCudart::malloc_from_pool_async, dev_ptr, size, pool, stream);
}

// A program built per-thread (Note [per-thread default stream programs]) calls this form.
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocFromPoolAsync_ptsz(void** dev_ptr, size_t size,
                                                                 cudaMemPool_t pool,
                                                                 cudaStream_t stream) {
  return forward_allocation(&RealCudart::malloc_from_pool_async_ptsz, dev_ptr, size, pool,
                            stream);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaDeviceSetMemPool(int device, cudaMemPool_t pool) {
  const cudaError_t e = forward(&RealCudart::device_set_mem_pool, device, pool);
  if (e == cudaSuccess && watching()) {
    // A pool that cannot be told from the default (no function to ask) counts as the
    // program's: forwarding its allocations is right either way. Note [last error]: the
    // question leaves the program's last error as the call alone would.
    Shim& s = shim();
    ProgramLastError last_error;
    cudaMemPool_t default_pool = nullptr;
    const bool is_default =
        s.cuda.device_get_default_mem_pool != nullptr &&
        s.cuda.device_get_default_mem_pool(&default_pool, device) == cudaSuccess &&
        default_pool == pool;
    set_device(s.own_pool_devices, device, !is_default);
  }
  return e;
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaDeviceEnablePeerAccess(int peer_device, unsigned flags) {
  const cudaError_t e = forward(&RealCudart::device_enable_peer_access, peer_device, flags);
  if ((e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) || !watching() ||
      !tidepool_device(peer_device)) {
    return e;
  }
  ProgramLastError last_error;  // the runtime's answer stays the program's last error
  int current = 0;
  if (!ready() || in_forked_child() || shim().cuda.get_device(&current) != cudaSuccess ||
      !tidepool_device(current)) {
    return e;
  }
  Shim& s = shim();
  InsideTidepool inside;
  s.tp.clear_error();
  if (s.tp.enable_peer_access(peer_device, current) != 0) {
    say("", std::string("cudaDeviceEnablePeerAccess: tidepool could not give device ") +
                std::to_string(current) + " access to its memory of device " +
                std::to_string(peer_device) + ": " + s.tp.last_error());
  }
  return e;
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  const cudaError_t e = forward(&RealCudart::mem_get_info, free_bytes, total_bytes);
  if (e != cudaSuccess || free_bytes == nullptr || total_bytes == nullptr ||
      !shim().serving.load(std::memory_order_acquire) || !watching()) {
    return e;
  }
  ProgramLastError last_error;  // Note [free memory under the shim]
  int device = 0;
  if (shim().cuda.get_device(&device) != cudaSuccess) return e;
  const std::size_t cached = cached_bytes(device);
  const std::size_t room = *total_bytes > *free_bytes ? *total_bytes - *free_bytes : 0;
  *free_bytes += std::min(cached, room);
  return e;
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool,
                                                         const cudaMemAccessDesc* map,
                                                         size_t count) {
  const cudaError_t e = forward(&RealCudart::mem_pool_set_access, pool, map, count);
  if (e == cudaSuccess && watching()) {
    ProgramLastError last_error;  // the questions' "no such device" is not the program's
    if (const int device = device_of_default_pool(pool); device >= 0) {
      set_device(shim().shared_pool_devices, device);
    }
  }
  return e;
}

}  // extern "C"
