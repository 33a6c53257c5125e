// Hooks through which the allocator asks higher layers (the tiering engine) to give
// memory back, without calling them (layers point down):
//
//  - Reclaim hooks: the step of the OOM policy where the allocator asks for memory. A
//    hook returns how many bytes it freed (informational: the allocator retries
//    regardless).
//  - Empty-cache hooks: what the C ABI's tidepool_empty_cache / tidepool_empty_cache_all
//    (which torch.cuda.empty_cache() and c10's emptyCache reach) run besides emptying the
//    allocator's cache, so that memory a higher layer only caches goes back too (the
//    tiering layer's spare host backings: Note [Empty-cache hooks] in reclaim.cpp).
//
// Both kinds are process-wide, receive the device, and are called without any allocator
// lock held, because a hook may free memory through the allocator. A hook may throw; the
// exception is swallowed and reported on stderr, since the allocation that triggered a
// reclaim must still end in a clean OutOfMemoryError or a success, and an empty_cache
// still empties the allocator's cache and the other hooks'.
#pragma once

#include <cstddef>
#include <functional>

#include "allocator/export.h"

namespace tidepool {

using ReclaimHook = std::function<std::size_t(int device, std::size_t bytes_needed)>;

// Returns an id for unregister_reclaim_hook. Throws std::invalid_argument for an empty hook.
TIDEPOOL_API int register_reclaim_hook(ReclaimHook hook);
// Unknown ids are ignored. Returns once no other thread is inside a call of the hook, and
// none starts one after (a hook may unregister itself); so the caller must hold no lock
// the hook takes (Note [Unregistering a running hook] in reclaim.cpp).
TIDEPOOL_API void unregister_reclaim_hook(int id);

// Gives back what the hook's layer caches for `device`. tidepool_empty_cache_all calls it
// for every device index below kMaxDevices, including devices tidepool holds nothing on:
// a hook must create nothing there.
using EmptyCacheHook = std::function<void(int device)>;

// Returns an id for unregister_empty_cache_hook. Throws std::invalid_argument for an
// empty hook.
TIDEPOOL_API int register_empty_cache_hook(EmptyCacheHook hook);
// Unknown ids are ignored. Waits as unregister_reclaim_hook does.
TIDEPOOL_API void unregister_empty_cache_hook(int id);

namespace detail {
struct ReclaimResult {
  std::size_t calls = 0;
  std::size_t bytes = 0;
};
// Calls every registered hook once, in registration order; none when called from inside a
// hook on this thread (Note [Nested reclaim], reclaim.cpp).
ReclaimResult run_reclaim_hooks(int device, std::size_t bytes_needed);
// For allocator/c_api.cpp: calls every registered empty-cache hook once, in registration
// order, and returns how many were called; none when called from inside one on this
// thread (Note [Empty-cache hooks], reclaim.cpp).
std::size_t run_empty_cache_hooks(int device);
}  // namespace detail

}  // namespace tidepool
