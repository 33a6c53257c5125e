// Reclaim hooks: the step of the OOM policy where the allocator asks higher layers (the
// tiering engine) to give memory back. A hook is called without any allocator lock held,
// because it frees memory through the allocator; it returns how many bytes it freed
// (informational: the allocator retries regardless). Hooks are process-wide and receive
// the device that ran out. A hook may throw; the exception is swallowed and reported on
// stderr, since the allocation that triggered it must still end in a clean
// OutOfMemoryError or a success.
#pragma once

#include <cstddef>
#include <functional>

#include "allocator/export.h"

namespace tidepool {

using ReclaimHook = std::function<std::size_t(int device, std::size_t bytes_needed)>;

// Returns an id for unregister_reclaim_hook. Throws std::invalid_argument for an empty hook.
TIDEPOOL_API int register_reclaim_hook(ReclaimHook hook);
// Unknown ids are ignored. A call in flight on another thread may still finish.
TIDEPOOL_API void unregister_reclaim_hook(int id);

namespace detail {
struct ReclaimResult {
  std::size_t calls = 0;
  std::size_t bytes = 0;
};
// Calls every registered hook once, in registration order; none when called from inside a
// hook on this thread (Note [Nested reclaim], reclaim.cpp).
ReclaimResult run_reclaim_hooks(int device, std::size_t bytes_needed);
}  // namespace detail

}  // namespace tidepool
