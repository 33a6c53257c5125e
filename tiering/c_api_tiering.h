/* tidepool's tiering C ABI: what the Python hooks call around optimizer.step(), and
 * the VMM-backed (pointer-stable) allocation entry points. tidepool_malloc routes
 * allocations under optimizer_state of at least tidepool.tier_min_bytes to the same
 * ranges by itself (Note [tier route] in allocator/tier_routing.h); tidepool_free and
 * tidepool_record_stream accept them. Plain C, no CUDA headers: streams travel as void*
 * (a cudaStream_t on cuda).
 *
 * Errors never cross this boundary as C++ exceptions: a failing call returns a negative
 * status (or NULL) and leaves a message for tidepool_last_error() (allocator/c_api.h) on
 * the calling thread, the same slot the allocator's C ABI uses. Status codes: 0 ok, -1
 * error (see the message).
 *
 * By tag: evict moves every VMM range with that tag (pointer-stable) and every handle
 * with that tag in the device's tiered stores to host memory. Prefetch brings them back
 * within tidepool.state_budget (Note [prefetch within the state budget] in
 * c_api_tiering.cpp): the ranges made by tidepool_vmm_malloc or by tidepool_malloc's
 * route, oldest first, as long as the device's VMM-backed bytes stay within the budget;
 * the rest stays host-backed, still usable at the same address. By pointer: the VMM
 * range holding `ptr` (a prefetch also within the budget), or the ranges holding each of
 * an array of pointers.
 *
 * Note [prefetch stream]: the `stream` of the prefetch calls (by tag, by pointer, by
 * pointers) is the stream that will use the state. None of them waits for it or orders
 * anything on it: a range's migration waits, on the host, for the streams recorded as
 * its users (tidepool_vmm_malloc's stream, tidepool_vmm_record_stream,
 * tidepool_record_stream), and is complete when the call returns, so work enqueued on
 * `stream` afterwards sees the state in place. Work already queued on `stream` that uses
 * a range must be recorded (tidepool_vmm_record_stream) to be waited for. A tiered
 * store's prefetch (reached by tag) is ordered on its own copy stream, and its handles
 * are waited for by acquire (tiering/tiered_store.h). The argument is reserved for an
 * asynchronous prefetch; any value, NULL included, is accepted today.
 *
 * Thread-safety: every function may be called from any thread.
 */
#ifndef TIDEPOOL_C_API_TIERING_H
#define TIDEPOOL_C_API_TIERING_H

#include <stddef.h>
#include <stdint.h>

#include "allocator/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- pointer-stable (VMM-backed) allocations ------------------------------------ */
/* Device-backed range of at least `size` bytes under `tag`, migratable later without
 * changing its address. NULL on OOM or bad input (message set), a `tag` no tag has
 * among it (tidepool_tag_id makes one). Migration waits for
 * the work on `stream` (as tidepool_vmm_record_stream). */
TIDEPOOL_API void* tidepool_vmm_malloc(size_t size, int device, int tag, void* stream);
TIDEPOOL_API int tidepool_vmm_free(void* ptr, int device);
/* Work on `stream` uses `ptr`: migration waits for that stream first. */
TIDEPOOL_API int tidepool_vmm_record_stream(void* ptr, int device, void* stream);
/* 1 if `ptr` lies in a VMM range of `device`, else 0. */
TIDEPOOL_API int tidepool_vmm_owns(const void* ptr, int device);

/* ---- evict / prefetch -------------------------------------------------------------- */
/* The calls by tag, tidepool_vmm_owns and the stats below create nothing on a device
 * where no VMM range or tiered store exists yet (no CUDA context just for asking). A tag
 * id that names no tag (tidepool_tag_id makes them) is an error. An eviction moves the
 * ranges to host memory as far as tidepool.pinned_budget has room: what it has none for
 * stays in device memory, which is no error (said once on stderr, and counted in the stats'
 * vmm_pinned_budget_stops and vmm_bytes_left_on_device); so for tidepool_evict_ptr and
 * tidepool_evict_ptrs. */
TIDEPOOL_API int tidepool_evict_tag(int device, int tag);
/* `stream`: Note [prefetch stream] above. */
TIDEPOOL_API int tidepool_prefetch_tag(int device, int tag, void* stream);
/* tidepool_prefetch_tag, also writing to *bytes_left_on_host (when not NULL) how many
 * bytes of the tag's ranges stayed host-backed because of tidepool.state_budget (or for
 * want of device memory). A range move that fails part-way: Note [A call by tag that fails
 * part-way] in c_api_tiering.cpp. */
TIDEPOOL_API int tidepool_prefetch_tag_within_budget(int device, int tag, void* stream,
                                                     uint64_t* bytes_left_on_host);
/* Evict or prefetch the range holding `ptr`. A pointer no range of `device` holds is an
 * error; like tidepool_prefetch_ptrs, they create nothing on a device where no VMM range
 * exists. `stream`: Note [prefetch stream] above. */
TIDEPOOL_API int tidepool_evict_ptr(int device, void* ptr);
TIDEPOOL_API int tidepool_prefetch_ptr(int device, void* ptr, void* stream);
/* Prefetches the ranges holding ptrs[0..n), in that order, within tidepool.state_budget:
 * one call for all of an optimizer's state (the Python hooks' pre-step prefetch). Each
 * range moves once however many pointers lie in it (views, interior pointers); a pointer
 * no range of `device` holds (NULL, state in ordinary device memory) is skipped, so the
 * caller need not ask tidepool_vmm_owns first. Writes to *bytes_left_on_host (when not
 * NULL) the bytes the budget left host-backed. `ptrs` may be NULL only when n is 0.
 * Creates nothing on a device where no VMM range exists. The migrations are complete when
 * it returns (as tidepool_prefetch_ptr's); `stream`: Note [prefetch stream] above.
 * Tiered stores are not reached (their handles are not pointers; tidepool_prefetch_tag
 * reaches them). */
TIDEPOOL_API int tidepool_prefetch_ptrs(int device, const void* const* ptrs, size_t n,
                                        void* stream, uint64_t* bytes_left_on_host);
/* Evicts the ranges holding ptrs[0..n) to host memory: tidepool_prefetch_ptrs' other
 * half, with its rules (each range once, a pointer no range of `device` holds skipped,
 * `ptrs` NULL only when n is 0, nothing created on a device without a VMM range, tiered
 * stores not reached) and, like tidepool_evict_tag, no stream: a range's migration waits
 * for the streams recorded as its users, and the caller synchronizes the stream that
 * used it last (the Python hooks do). What a step evicts when another thread's step on
 * the device still runs (Note [steps in flight] in python/src/tidepool/_in_flight.py):
 * its own optimizer's state, where the tag would take the other step's too. */
TIDEPOOL_API int tidepool_evict_ptrs(int device, const void* const* ptrs, size_t n);
/* The base addresses of `device`'s ranges of `tag` that have device-backed memory and hold
 * none of except[0..n_except), oldest first: what is on the device beyond what the caller
 * names. The Python hooks ask it after a step, naming the optimizer's state, to learn the
 * state it keeps elsewhere, which they prefetch with its own before the next step
 * (Note [state outside optimizer.state] in python/src/tidepool/_state_outside.py). Writes
 * the number of such ranges to *count and the first min(*count, capacity) bases to
 * out[]; call with capacity 0 (out may then be NULL) to size the array, though ranges may
 * come and go between two calls. Pointers in no range are ignored; `except` may be NULL
 * only when n_except is 0. 0 and *count 0 on a device where no VMM range exists (nothing
 * is created); -1 with tidepool_tiering_last_error() for a bad tag or a NULL array. Tiered
 * stores' handles are not ranges and are not listed. */
TIDEPOOL_API int tidepool_device_ranges_except(int device, int tag, const void* const* except,
                                               size_t n_except, void** out, size_t capacity,
                                               size_t* count);

/* For each of ptrs[0..n), the identity of `device`'s pointer-stable range holding it
 * (tidepool_vmm_owns), in ids[i]: a number no other range of the device is given in this
 * process, though its base address may be taken again once it is freed; 0 where no range
 * holds it (NULL, ordinary device memory, a freed range). So a caller that remembers a
 * range by its address can tell it from a later range at the same address: the Python
 * hooks check the state an optimizer keeps outside optimizer.state with it (Note [state
 * outside optimizer.state]). Creates nothing: on a device without ranges every id is 0.
 * 0 on success; -1 with tidepool_tiering_last_error() when ptrs or ids is NULL and n > 0
 * (ids untouched). */
TIDEPOOL_API int tidepool_range_ids(int device, const void* const* ptrs, size_t n,
                                    uint64_t* ids);

/* ---- optimizer steps in flight ------------------------------------------------------- */
/* An optimizer step that uses state on `device` begins / ends on the calling thread (the
 * Python hooks call these around each torch.optim step; an end comes on the thread of its
 * begin). While a thread other than the one that runs out of memory has a step in flight
 * on the device, the out-of-memory policy does not move the device's optimizer state to
 * the host (Note [Steps of other threads] in tiering/steps_in_flight.cpp): that step's
 * kernels may be using it. 0 ok; -1 for a device outside 0..15 (message set). An end
 * without a begin on the thread changes nothing. */
TIDEPOOL_API int tidepool_step_begin(int device);
TIDEPOOL_API int tidepool_step_end(int device);
/* Steps in flight on `device`, over all threads (0 for a device outside 0..15). */
TIDEPOOL_API int tidepool_steps_in_flight(int device);

/* ---- stats ---------------------------------------------------------------------------- */
typedef struct tidepool_tiering_stats_v1 {
  uint32_t struct_size; /* set by the caller to sizeof(tidepool_tiering_stats_v1) */
  uint32_t version;     /* set by tidepool: 1 */
  int32_t device;
  uint32_t stores;      /* live tiered stores on the device */
  /* copy engines of all stores. The bytes are counted when enqueued, the busy time when a
   * batch of transfers is done and collected; the rates are of the bytes whose time is
   * collected (Note [Rates from timed bytes] in tiering/copy_engine.h), so they err low,
   * never high. */
  uint64_t h2d_bytes, d2h_bytes;
  double h2d_busy_ms, d2h_busy_ms;
  double h2d_gb_per_s, d2h_gb_per_s;
  /* Host time callers were blocked on transfers, and the busy time not so exposed. A copy
   * a GPU stream waited for (an acquire that missed) is hidden: no device-side stall is
   * measured (Note [Exposed and hidden copy time] in tiering/copy_engine.h). */
  double exposed_wait_ms;
  double hidden_ms;
  /* residency. device_budget_bytes: each store's budget of its own, plus once the device's
   * tidepool.state_budget that the stores built from the configuration share */
  uint64_t device_bytes, device_budget_bytes;
  uint64_t acquires, prefetch_issued, prefetch_hits, prefetch_late, misses, prefetch_skipped;
  uint64_t evictions, evictions_clean;
  uint64_t reclaim_calls, reclaimed_bytes;
  /* host tiers */
  uint64_t pinned_host_bytes, pageable_host_bytes, pageable_fallbacks;
  /* pointer-stable ranges */
  uint64_t vmm_ranges, vmm_device_bytes, vmm_host_bytes;
  uint64_t vmm_bytes_to_host, vmm_bytes_to_device, vmm_failed_migrations;
  double vmm_migration_ms;
  /* Appended (a caller with an older, shorter struct_size gets the prefix it knows).
   * The device budget of the VMM ranges (tidepool.state_budget; UINT64_MAX: none, or a
   * percentage of a device tidepool has not used yet), how many prefetches stopped
   * short, and the bytes those left in host memory: at the budget, or where the device
   * itself had no memory for a chunk (Note [A device with no room for a prefetch] in
   * tiering/vmm_migration.cpp). */
  uint64_t vmm_device_budget_bytes, vmm_budget_stops, vmm_bytes_left_on_host;
  /* Appended: the stores' prefetch schedules (tiering/prefetch_policy.h). Acquires that
   * did not come where the replayed schedule expected them, and how many steps changed
   * a schedule: a handle merged in, an order adopted (Note [Adopting a step]). A count of
   * off-schedule acquires that keeps growing with no adoptions means the steps keep
   * changing their order, or their handles in no pattern (Note [Steps of several
   * shapes]). */
  uint64_t off_schedule_acquires, schedule_adoptions;
  /* Appended: tidepool.state_budget is the device's, shared by the device's tiered stores
   * built from the configuration and its VMM ranges (Note [Shared state budget] in
   * tiering/device_budget_ledger.h). The stores that share it; the bytes charged to it
   * now by all that share it (stores and ranges; at most the budget, unless ranges
   * allocated on the device, which no budget limits, took more); the handles stores
   * evicted to give another store room, and their bytes; and the acquires (and creates on
   * the device) that asked the other stores for room, each once. */
  uint64_t shared_budget_stores, shared_budget_charged_bytes;
  uint64_t peer_evictions, peer_evicted_bytes, peer_room_requests;
  /* Appended: acquires to overwrite (TieredStore::acquire_to_overwrite) that found their
   * handle on the host and gave it a device buffer without loading it. */
  uint64_t loads_skipped;
  /* Appended: pinned host memory the pointer-stable ranges keep for their next move to
   * the host (spare host backings, freed by moves to the device), which
   * tidepool_empty_cache gives back. */
  uint64_t vmm_spare_host_bytes;
  /* Appended: pinned host memory (Note [One pinned budget per process] in
   * tiering/pinned_budget.cpp). The process's pinned budget (tidepool.pinned_budget, else
   * a quarter of RAM) and what all of tidepool's host arenas and pointer-stable ranges,
   * on every device, have pinned against it now; the pinned host memory this device's
   * ranges hold (host backings mapped, spare, or waiting for a release), the moves to the
   * host the budget cut short, and the bytes those left in device memory (Note [Pinned
   * host backings] in tiering/vmm_backings.cpp). */
  uint64_t pinned_budget_bytes, process_pinned_bytes;
  uint64_t vmm_pinned_bytes, vmm_pinned_budget_stops, vmm_bytes_left_on_device;
  /* Appended: the stores' host blocks moved from the pageable fallback into pinned memory
   * once it had room for them, and their bytes (Note [Pageable blocks are promoted] in
   * tiering/host_promotion.cpp). */
  uint64_t host_promotions, host_promoted_bytes;
} tidepool_tiering_stats_v1;

/* The size of tidepool_tiering_stats_v1 as first released; struct_size may not be less. */
#define TIDEPOOL_TIERING_STATS_V1_MIN_SIZE \
  (offsetof(tidepool_tiering_stats_v1, vmm_migration_ms) + sizeof(double))

/* Fills `out` (out->struct_size must be at least TIDEPOOL_TIERING_STATS_V1_MIN_SIZE; it
 * is set to the bytes written). 0 ok, -1 error. */
TIDEPOOL_API int tidepool_get_tiering_stats_v1(int device, tidepool_tiering_stats_v1* out);
/* JSON: {"stores":[...],"vmm":{...}}. malloc'd; release with free() (or
 * tidepool_string_free, which is free()). NULL on error. */
TIDEPOOL_API char* tidepool_tiering_snapshot_json(int device);

/* Deprecated: tidepool_last_error(), which tiering errors now land in; kept so that
 * callers built against the separate slot keep working. */
TIDEPOOL_API const char* tidepool_tiering_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* TIDEPOOL_C_API_TIERING_H */
