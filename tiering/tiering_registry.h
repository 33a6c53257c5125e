// The process-wide tiering objects of each device, reached by the C ABI: the VmmPool for
// pointer-held tierable allocations, and every live TieredStore (stores register
// themselves on construction), so "evict tag X on device D" reaches all of them.
//
// The registry borrows a Backend per device: by default the backend of the device's
// caching allocator (device_allocator(device).backend(), created on first use), so both
// share streams and capacity; set_tiering_backend() names another one (tests).
//
// Tierable ranges: allocate_tierable_range is how pointer-stable ranges are made for the
// C ABI (tidepool_vmm_malloc) and for the allocator's tier route (Note [tier route] in
// allocator/tier_routing.h), which this file registers from a static initializer of
// libtidepool.so: allocations under optimizer_state reaching tidepool_malloc become such
// ranges. The registry remembers them in allocation order, which is the order an
// optimizer creates (and then walks) its state, so a budget-limited prefetch
// (tidepool_prefetch_tag) brings back the state the step needs first.
//
// OOM: the registry registers one allocator reclaim hook (allocator/reclaim.h) when the
// first store registers or the first VMM pool is made; on a device OOM it asks that
// device's stores to evict released state (TieredStore::reclaim), then moves the pool's
// optimizer-state ranges to the host, oldest first (Note [State pushed out under
// pressure] in tiering_registry.cpp, which a fresh range finding the device full also
// takes). Going through the registry, not a hook per store, means
// a store being destroyed is never called: it leaves the registry first, under the same
// lock. The hook only try_locks the registry, so it cannot deadlock with a thread that
// holds the registry and waits for a store whose owner is inside the allocator.
// empty_cache: with it the registry registers an empty-cache hook, through which
// tidepool_empty_cache (torch.cuda.empty_cache()) makes the device's VMM pool give back
// its spare host backings (Note [empty_cache releases the spares] in tiering_registry.cpp).
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "allocator/backend.h"
#include "allocator/export.h"

namespace tidepool {

class TieredStore;
class VmmPool;

// Borrows `backend` for `device` (not owned; must outlive tiering use). Throws
// TieringError when the device's VmmPool already exists on another backend.
TIDEPOOL_API void set_tiering_backend(int device, Backend* backend);
// The device's VmmPool, created on first use.
TIDEPOOL_API VmmPool& tiering_vmm_pool(int device);
// The device's VmmPool if it exists yet, else nullptr (creates nothing).
TIDEPOOL_API VmmPool* existing_tiering_vmm_pool(int device);
// Calls `fn` on every registered store of `device`, under the registry lock. `fn` may
// destroy a store other than the one it is called on (the walk skips it); creating a
// store, walking again or reaching the VMM pool from inside `fn` on the same thread
// throws TieringError instead of deadlocking (Note [Registry re-entry],
// tiering_registry.cpp).
TIDEPOOL_API void for_each_tiered_store(int device, const std::function<void(TieredStore&)>& fn);

// A pointer-stable range of at least `bytes` in `device`'s VmmPool, device-backed, under
// `tag`, whose migration waits for `stream`'s work. nullptr when the device has no
// memory for it; throws TieringError for bad input.
TIDEPOOL_API void* allocate_tierable_range(int device, std::size_t bytes, int tag, Stream stream);
// Releases a range of `device`'s VmmPool (after the streams that used it). Throws
// TieringError for a pointer that is not the base of one, and, when `bytes` is given, for
// a size other than the one the range was allocated with (then nothing is freed). A
// device where no range was made is not set up for the question (no pool, no context).
TIDEPOOL_API void free_tierable_range(int device, void* ptr,
                                      std::optional<std::size_t> bytes = std::nullopt);
// Work on `stream` uses the range holding `ptr` (VmmPool::record_use); TieringError, and
// nothing set up, on a device where no range was made.
TIDEPOOL_API void record_tierable_range_use(int device, void* ptr, Stream stream);
// Whether `ptr` is the base of a range made by allocate_tierable_range on `device`.
TIDEPOOL_API bool is_tierable_range(int device, const void* ptr);

namespace detail {
// What the allocator's reclaim hook runs: reclaim on every store of `device` until
// `bytes_needed` are freed, then the device's pointer-stable ranges pushed to the host.
// Returns bytes freed. The registry and the stores are waited for a bounded time (the
// ranges are moved even when the registry stays busy: Note [A busy registry in an OOM],
// tiering_registry.cpp). On a thread that holds the registry already (a store's OOM inside
// a walk) it walks the stores under that hold; a store this thread is inside gives nothing.
std::size_t reclaim_tiered_stores(int device, std::size_t bytes_needed);
// How many reclaims found the registry held by another thread, and how many of them
// waited for it (Note [One wait for a busy registry per store operation]).
TIDEPOOL_API std::uint64_t reclaims_that_found_the_registry_busy() noexcept;
TIDEPOOL_API std::uint64_t reclaims_that_waited_for_the_registry() noexcept;
// Whether an OOM hook on this thread already waited for the registry in vain during the
// store operation it is in (false outside one), and noting that it did (tiered_store.cpp).
bool registry_wait_failed_in_store_operation() noexcept;
void note_registry_wait_failed() noexcept;
// For a store's last ask before it fails: the next OOM hook may wait again.
void allow_another_registry_wait() noexcept;
void register_tiered_store(int device, TieredStore* store);
void unregister_tiered_store(int device, TieredStore* store);
}  // namespace detail

}  // namespace tidepool
