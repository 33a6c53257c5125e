/* tidepool's C ABI: what PyTorch's pluggable allocator, the Python package and the
 * LD_PRELOAD shim call. Plain C, no CUDA headers: streams travel as void* (a
 * cudaStream_t on the cuda backend).
 *
 * tidepool_malloc / tidepool_free have exactly the signatures
 * torch.cuda.memory.CUDAPluggableAllocator expects. Both route: an allocation under a
 * tierable tag (optimizer_state) of at least tidepool.tier_min_bytes becomes a
 * pointer-stable range the tiering layer can move between device and host memory;
 * everything else is the caching allocator's (Note [tier route] in tier_routing.h).
 *
 * Errors never cross this boundary as C++ exceptions, with one deliberate exception:
 * tidepool_pytorch_malloc (Note [OOM into PyTorch]). A failing call returns NULL (or a
 * negative status) and leaves a message for tidepool_last_error() on the calling thread;
 * the tiering C ABI (tiering/c_api_tiering.h) reports into the same slot.
 * Note [OOM across the C ABI]: tidepool_malloc returns NULL only for a real OOM (after
 * its whole OOM policy ran) and for invalid requests, with its message in
 * tidepool_last_error(); and for a request of 0 bytes, which is not a failure: it clears
 * the thread's last error.
 *
 * Note [OOM into PyTorch]: PyTorch's CUDAPluggableAllocator does not check the pointer
 * its malloc returns, so a NULL would become a tensor over address 0 (seen on the H200:
 * torch.empty of 1 PiB "succeeded"). tidepool_pytorch_malloc is called only by
 * PyTorch's C++ code, never by a C caller, so where tidepool_malloc would return NULL it
 * throws a std::runtime_error carrying tidepool's message instead; PyTorch turns it into
 * a Python RuntimeError and the process lives on. Hand PyTorch's current allocator the
 * pair tidepool_pytorch_malloc / tidepool_pytorch_free; C callers use tidepool_malloc.
 *
 * Note [OOM into a MemPool]: a torch.cuda.MemPool's allocator is the exception: PyTorch's
 * caching allocator checks its NULL, frees its own cached blocks, retries, and raises
 * torch.OutOfMemoryError. So tidepool_pytorch_pool_malloc returns NULL when tidepool ran
 * out of memory (after its own OOM policy), and throws tidepool's message for any other
 * failure (a bad request, a CUDA error), which PyTorch's retry could not help and its OOM
 * message would misname.
 *
 * Note [record_stream from PyTorch]: PyTorch's CUDAPluggableAllocator drops
 * Tensor.record_stream unless a record-stream function is set on it (it is a no-op by
 * default), and the Python class offers no way to set one. Without it, memory another
 * stream still reads is handed out again on the allocating stream as soon as PyTorch
 * frees it: a silent data race in any multi-stream program. tidepool_pytorch_record_stream
 * has the shape of that function (pointer and stream, no device); the LibTorch install
 * sets it as the record-stream function, and so does the Python package when it installs
 * libtidepool_torch_cuda.so (global mode); without that library it wraps
 * torch.Tensor.record_stream to call it (in pool mode PyTorch's own allocator keeps the
 * blocks and honours record_stream itself).
 *
 * Thread-safety: every function may be called from any thread.
 */
#ifndef TIDEPOOL_C_API_H
#define TIDEPOOL_C_API_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "allocator/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- pluggable allocator entry points ------------------------------------------ */
TIDEPOOL_API void* tidepool_malloc(ssize_t size, int device, void* stream);
TIDEPOOL_API void tidepool_free(void* ptr, size_t size, int device, void* stream);
/* For torch.cuda.memory.CUDAPluggableAllocator (and LibTorch's createCustomAllocator):
 * tidepool_malloc, except that a failure throws (Note [OOM into PyTorch]); never call it
 * from C. tidepool_pytorch_free is tidepool_free. */
TIDEPOOL_API void* tidepool_pytorch_malloc(ssize_t size, int device, void* stream);
/* For a torch.cuda.MemPool's allocator (Note [OOM into a MemPool]): tidepool_malloc, whose
 * NULL means out of memory only; any other failure throws, as tidepool_pytorch_malloc's
 * do. Never call it from C. Pair it with tidepool_pytorch_free. */
TIDEPOOL_API void* tidepool_pytorch_pool_malloc(ssize_t size, int device, void* stream);
TIDEPOOL_API void tidepool_pytorch_free(void* ptr, size_t size, int device, void* stream);
/* Marks `ptr` as used on `stream` too: it is not reused until that stream's work
 * enqueued before the free has finished. */
TIDEPOOL_API int tidepool_record_stream(void* ptr, int device, void* stream);
/* tidepool_record_stream for PyTorch (Note [record_stream from PyTorch]): the device is
 * the one whose allocator (or pointer-stable range) owns `ptr`. 0 when recorded; 1 when
 * tidepool does not own `ptr` (NULL, or memory from elsewhere: nothing to do, as PyTorch's
 * own allocator ignores pointers it did not hand out); -1 on error (tidepool_last_error). */
TIDEPOOL_API int tidepool_pytorch_record_stream(void* ptr, void* stream);
/* Gives back what tidepool only caches on `device`: the caching allocator's fully free
 * memory, and what the layers above it cache through their empty-cache hooks
 * (allocator/reclaim.h; the tiering layer's spare host backings of pointer-stable
 * ranges). 0, or -1 on error (a hook that fails is reported on stderr, not here). */
TIDEPOOL_API int tidepool_empty_cache(int device);
/* What c10's cacheInfo answers for PyTorch's own allocator, which cuDNN's autotuner
 * (torch.backends.cudnn.benchmark) sizes its workspace by: the larger of the device's
 * free memory and the largest free block tidepool has cached there, in *largest_block.
 * 0, or -1 for a bad device or a NULL largest_block. */
TIDEPOOL_API int tidepool_cache_info(int device, size_t* largest_block);
/* torch.cuda.set_per_process_memory_fraction for tidepool: from now on at most
 * fraction x the device's total memory is allocated through tidepool on `device`, by its
 * caching allocator and its pointer-stable ranges together (Backend::set_device_limit).
 * A request beyond that goes through the OOM policy (cached memory freed, reclaim hooks:
 * the tiering layer evicts optimizer state, retry) and then fails with the clear error,
 * which names the limit. fraction in [0, 1]; 1 lifts the limit. Memory already in use
 * stays. 0, or -1 for a fraction outside [0, 1] (or NaN) or a bad device. */
TIDEPOOL_API int tidepool_set_memory_fraction(double fraction, int device);
/* The fraction last set on `device` (1.0 when none), or -1.0 for a bad device. */
TIDEPOOL_API double tidepool_get_memory_fraction(int device);
/* tidepool_empty_cache on every device tidepool has an allocator for (creating none; the
 * empty-cache hooks run for every device index), as torch.cuda.empty_cache() empties
 * every device's cache. 0, or -1 on error. */
TIDEPOOL_API int tidepool_empty_cache_all(void);
/* "`stream` (a cudaStream_t) is about to be destroyed": call it before cudaStreamDestroy
 * (LD_PRELOAD=libtidepool_preload.so does it for cudaStreamDestroy itself).
 * Waits for the stream, returns what tidepool cached for it to pools any stream may use
 * (giving fully free memory back to the device), and forgets the stream, so that a later
 * stream with the same handle starts afresh. Blocks still live from it stay valid; free
 * them on a live stream. The pointer-stable ranges of the device (optimizer state routed
 * to tiering, tidepool_vmm_malloc) forget their recorded uses by it too, so a later
 * evict or prefetch does not wait on the destroyed handle. A stream tidepool holds
 * nothing for (never allocated or freed on, never named by tidepool_record_stream, and
 * no pointer-stable range or tiered store handle of the device used it) is not waited
 * for: 0 at once, even for a handle already destroyed. A device tidepool has not
 * allocated on yet holds nothing for the stream: nothing is created there (no CUDA
 * context). -1 for a bad device, the default (NULL) stream (never destroyed, so never
 * released) or a stream tidepool holds something for that cannot be synchronized
 * (already destroyed); nothing changes then. */
TIDEPOOL_API int tidepool_release_stream(int device, void* stream);
/* Whether `ptr` lies in memory a device's caching allocator holds (handed out, held back
 * or cached; any address inside, not only an allocation's start): 1, else 0, or -1 on
 * error. For a caller that must never hand such an address to the CUDA runtime (the
 * LD_PRELOAD shim, for a free of a pointer it no longer owns: a double free there would
 * give tidepool's segment back under it). Walks every device's ranges: not for a hot
 * path. */
TIDEPOOL_API int tidepool_holds_address(const void* ptr);
/* tidepool_holds_address for the caching allocator of `device` alone: 1, else 0 (also for
 * an index tidepool has no allocator for, any index: none is created), or -1 on error.
 * For a caller that no longer counts some devices' memory as tidepool's: the LD_PRELOAD
 * shim, after a cudaDeviceReset, whose new context may hand the addresses of the
 * device's old segments out again (Note [cudaDeviceReset under the shim]). */
TIDEPOOL_API int tidepool_device_holds_address(int device, const void* ptr);
/* Gives device `peer` read and write access to the memory tidepool maps through CUDA
 * virtual memory management for `device` (expandable segments, pointer-stable ranges of
 * optimizer state, device- or host-backed): every range mapped now and every range mapped
 * later, migrations included. Such ranges are accessible from their own device only, and
 * cudaDeviceEnablePeerAccess does not change that (it covers cudaMalloc memory): without
 * this call a kernel on `peer` reading them (e.g. a cross-device copy with a dtype change
 * under P2P) faults. Call cudaDeviceEnablePeerAccess (with `peer` current) as well, for
 * the rest of the device's memory; tidepool's c10 allocator does both in
 * enablePeerAccess. A device tidepool has not allocated on yet gets no context: the peer
 * is remembered for its mappings to come. Idempotent. 0, or -1 (tidepool_last_error)
 * for a device or peer that does not exist, peer == device, or a peer that cannot access
 * the device (cuDeviceCanAccessPeer); nothing changes then. */
TIDEPOOL_API int tidepool_enable_peer_access(int device, int peer);
/* Whether tidepool_enable_peer_access(device, peer) was done (by the caller, by tidepool's
 * c10 allocator, or by the LD_PRELOAD shim when the program called
 * cudaDeviceEnablePeerAccess): 1, else 0, or -1 (tidepool_last_error) for an index
 * outside 0..15. Creates no allocator. */
TIDEPOOL_API int tidepool_peer_access_enabled(int device, int peer);
/* Moves the small blocks every thread parked in its per-thread cache, on every device,
 * back to the shared pools (where any thread may reuse them); they stay cached memory.
 * tidepool_empty_cache does this itself before giving memory back. 0, or -1 on error. */
TIDEPOOL_API int tidepool_flush_thread_caches(void);

/* ---- tags ------------------------------------------------------------------------ */
/* Built-in tags; user tags get ids >= TIDEPOOL_TAG_FIRST_USER from tidepool_tag_id. */
enum {
  TIDEPOOL_TAG_UNTAGGED = 0,
  TIDEPOOL_TAG_PARAMETER = 1,
  TIDEPOOL_TAG_GRADIENT = 2,
  TIDEPOOL_TAG_ACTIVATION = 3,
  TIDEPOOL_TAG_OPTIMIZER_STATE = 4,
  TIDEPOOL_TAG_WORKSPACE = 5,
  TIDEPOOL_TAG_FIRST_USER = 6,
  TIDEPOOL_TAG_MAX = 64
};
/* Id for a tag name ("parameter", ..., or any user name); creates user tags on first
 * use. Returns -1 (and sets the last error) when the table is full or name is invalid. */
TIDEPOOL_API int tidepool_tag_id(const char* name);
/* Name of a tag id, or NULL. The string lives as long as the process. */
TIDEPOOL_API const char* tidepool_tag_name(int tag);
/* Thread-local scope: allocations made by this thread go to the innermost tag. */
TIDEPOOL_API int tidepool_tag_push(int tag);
TIDEPOOL_API int tidepool_tag_pop(void);
TIDEPOOL_API int tidepool_tag_current(void);

/* ---- stats ----------------------------------------------------------------------- */
typedef struct tidepool_stat_v1 {
  uint64_t current;   /* bytes now */
  uint64_t peak;      /* highest `current` since start or the last reset */
  uint64_t allocated; /* total ever added */
  uint64_t freed;     /* total ever removed */
} tidepool_stat_v1;

typedef struct tidepool_tag_stats_v1 {
  tidepool_stat_v1 bytes; /* live bytes under this tag (as requested, rounded) */
  uint64_t count;         /* live allocations */
  uint64_t total_count;   /* allocations ever made */
} tidepool_tag_stats_v1;

/* Cached memory by tag (Note [Cached memory by tag], allocator/snapshot.cpp has the exact
 * rules): each free block is kept under the tag of its last use (what a request leaves
 * free of the memory taken for it: the request's; merged blocks: the larger part's), so
 * the tags' cached_bytes add up to tidepool_stats_v1.cached_bytes. */
typedef struct tidepool_tag_cache_v1 {
  uint64_t cached_bytes;       /* free backed bytes kept under this tag */
  uint64_t largest_free_block; /* largest free contiguous range among them */
  double fragmentation;        /* 1 - largest_free_block / cached_bytes (0 when none) */
} tidepool_tag_cache_v1;

typedef struct tidepool_stats_v1 {
  uint32_t struct_size; /* set by the caller to sizeof(tidepool_stats_v1) */
  uint32_t version;     /* set by tidepool: 1 */
  int32_t device;
  int32_t backend;          /* 0 host, 1 cuda */
  tidepool_stat_v1 allocated; /* bytes in live blocks */
  tidepool_stat_v1 reserved;  /* bytes taken from the backend */
  uint64_t cached_bytes;      /* reserved - allocated */
  uint64_t segments_acquired; /* backend allocations ever made */
  uint64_t segments_released; /* backend allocations ever given back */
  uint64_t alloc_count, free_count;
  uint64_t cache_hits, cache_misses;
  uint64_t oom_count;
  uint64_t reclaim_calls;
  uint64_t reclaimed_bytes;
  double fragmentation; /* 1 - largest free block / cached bytes (0 when none cached) */
  tidepool_tag_stats_v1 tags[TIDEPOOL_TAG_MAX];
  /* Appended fields (a caller with an older, shorter struct_size gets the prefix). */
  tidepool_stat_v1 requested;   /* bytes live callers asked for (allocated is rounded) */
  uint64_t cross_stream_reuses; /* free blocks handed from one stream to another */
  /* Counts with their peaks: live allocations (allocated = alloc_count, freed =
   * free_count) and live backend allocations (allocated = segments_acquired, freed =
   * segments_released). */
  tidepool_stat_v1 allocations;
  tidepool_stat_v1 segments;
  uint64_t largest_free_block; /* largest free contiguous backed range, any tag */
  tidepool_tag_cache_v1 tag_cache[TIDEPOOL_TAG_MAX]; /* by tag id, as tags[] */
} tidepool_stats_v1;

/* Fills `out` (out->struct_size must be set; Note [Versioned structs]: a caller built
 * against an older, shorter struct gets the prefix it knows). 0 on success, -1 on error. */
TIDEPOOL_API int tidepool_get_stats_v1(int device, tidepool_stats_v1* out);
/* Every peak (bytes and counts, per tag too) becomes the current value. */
TIDEPOOL_API int tidepool_reset_peak_stats(int device);

/* ---- PyTorch's view of the stats ------------------------------------------------- */
/* Note [PyTorch's view of the stats]: torch.cuda.memory_stats() and LibTorch's
 * c10::cuda::CUDACachingAllocator::getDeviceStats read c10's DeviceStats. This struct is
 * that struct, field for field, filled from tidepool's stats of the device; the c10
 * allocator of libtidepool_torch_cuda.so and the Python package copy it without
 * interpreting it, so both show the same figures. What they mean here:
 *   - index TIDEPOOL_POOL_ALL is the whole caching allocator. tidepool does keep blocks
 *     up to 1 MiB (kSmallMax, size_classes.h) in small pools of their own, per stream, but
 *     its stats are not kept per pool, so LARGE repeats ALL and SMALL is zero.
 *   - active = allocated (tidepool holds blocks freed while other streams still use them
 *     back without counting them); inactive_split is zero (free blocks coalesce and go
 *     back with their range); oversize_*, num_sync_all_streams are zero; max_split_size is
 *     -1, PyTorch's "no limit".
 *   - num_alloc_retries counts reclaim-hook calls (tidepool's retry after freeing cache
 *     is inside the same request), num_device_alloc/free the backend allocations.
 *   - Optimizer state in pointer-stable ranges (tier route) is not included: it moves
 *     between device and host memory; tidepool_get_tiering_stats_v1 reports it.
 * The running totals (the `allocated` and `freed` of every stat, and the num_* counts)
 * count from the last tidepool_pytorch_reset_accumulated_stats of the device, as c10's
 * resetAccumulatedStats makes them; currents and peaks are tidepool's. tidepool's own
 * stats (tidepool_get_stats_v1) keep counting since start. */
enum { TIDEPOOL_POOL_ALL = 0, TIDEPOOL_POOL_SMALL = 1, TIDEPOOL_POOL_LARGE = 2 };
typedef struct tidepool_pytorch_stats_v1 {
  uint32_t struct_size; /* set by the caller to sizeof(tidepool_pytorch_stats_v1) */
  uint32_t version;     /* set by tidepool: 1 */
  tidepool_stat_v1 allocation[3];     /* counts */
  tidepool_stat_v1 segment[3];
  tidepool_stat_v1 active[3];
  tidepool_stat_v1 inactive_split[3];
  tidepool_stat_v1 allocated_bytes[3]; /* bytes */
  tidepool_stat_v1 reserved_bytes[3];
  tidepool_stat_v1 active_bytes[3];
  tidepool_stat_v1 inactive_split_bytes[3];
  tidepool_stat_v1 requested_bytes[3];
  uint64_t num_alloc_retries;
  uint64_t num_ooms;
  tidepool_stat_v1 oversize_allocations;
  tidepool_stat_v1 oversize_segments;
  uint64_t num_sync_all_streams;
  uint64_t num_device_alloc;
  uint64_t num_device_free;
  int64_t max_split_size;
} tidepool_pytorch_stats_v1;
/* The size of tidepool_pytorch_stats_v1 as first released; struct_size may not be less
 * (fields appended later are not written for a caller built before them). */
#define TIDEPOOL_PYTORCH_STATS_V1_MIN_SIZE \
  (offsetof(tidepool_pytorch_stats_v1, max_split_size) + sizeof(int64_t))
/* Fills `out` (Note [Versioned structs]). 0, or -1 on error (tidepool_last_error). */
TIDEPOOL_API int tidepool_get_pytorch_stats_v1(int device, tidepool_pytorch_stats_v1* out);
/* c10's resetAccumulatedStats: the running totals of the PyTorch view count from now on.
 * 0, or -1 for a bad device. */
TIDEPOOL_API int tidepool_pytorch_reset_accumulated_stats(int device);

/* JSON snapshot of segments, blocks and stats. Returns a malloc'd string the caller
 * frees with tidepool_string_free, or NULL on error. A device tidepool has not allocated
 * on gets an empty snapshot, and nothing is created there (on CUDA, no context). */
TIDEPOOL_API char* tidepool_snapshot_json(int device);
TIDEPOOL_API void tidepool_string_free(char* s);

/* ---- errors ---------------------------------------------------------------------- */
/* The last error message on this thread ("" if none). Valid until the next call. */
TIDEPOOL_API const char* tidepool_last_error(void);
TIDEPOOL_API void tidepool_clear_error(void);
/* 1 when this thread's last error is an out-of-memory (the request did not fit after the
 * whole OOM policy ran), 0 for any other error or none: lets a caller tell "too big for
 * now" from a bad request, as PyTorch does with torch.OutOfMemoryError. */
TIDEPOOL_API int tidepool_last_error_is_out_of_memory(void);
/* The CUDA error code behind this thread's last error (a cudaError_t, or a CUresult for
 * the driver's memory calls: the two agree for the errors a call can meet after a kernel
 * faulted, e.g. 700 for an illegal address), 0 when it came from no CUDA call. The
 * LD_PRELOAD shim answers a failed cudaMalloc with it, as the runtime would have. */
TIDEPOOL_API int tidepool_last_error_cuda_code(void);

/* ---- forked children ------------------------------------------------------------- */
/* 1 when this process was forked after tidepool made a device allocator (in it, or in an
 * ancestor it was forked from), else 0. In such a child frees do nothing, the tag calls
 * work as before, and every other entry point fails (Note [Forked child] in
 * allocator/fork_guard.h). For a caller that
 * must choose before it calls in: the LD_PRELOAD shim then leaves CUDA's calls to the
 * runtime. Answers in the child too, without a lock. */
TIDEPOOL_API int tidepool_in_forked_child(void);

/* ---- configuration --------------------------------------------------------------- */
/* Selects the backend before first use: "cuda", "host" or "auto" (cuda when a GPU is
 * present). Returns -1 once any device allocator exists. */
TIDEPOOL_API int tidepool_set_backend(const char* name);
/* Name of the backend in use for `device` ("cuda" or "host"); NULL for an index outside
 * 0..15 (tidepool_last_error says so). */
TIDEPOOL_API const char* tidepool_backend_name(int device);

#ifdef __cplusplus
}  /* extern "C" */

#include <string_view>

namespace tidepool {
/* The calling thread's tidepool_last_error() slot, for the other C ABIs of libtidepool
 * (tiering/c_api_tiering.cpp), so that a caller reads every error in one place. */
TIDEPOOL_API void set_last_error(std::string_view message);
}  // namespace tidepool
#endif

#endif /* TIDEPOOL_C_API_H */
