// The process's pinned host budget: one count of the pinned host memory tiering holds,
// checked against tidepool.pinned_budget or, without it, a quarter of physical memory.
// Every HostArena built without a budget of its own (its slabs and direct mappings) and
// every VmmPool built without one (its host backings: CU_MEM_LOCATION_TYPE_HOST_NUMA
// memory, which is pinned) charge it, so that the budget bounds what the process pins
// however many tiered stores, devices and pointer-stable ranges it has (Note [One pinned
// budget per process] in pinned_budget.cpp).
//
// Thread-safety: every function may be called from any thread; the count is one atomic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "allocator/export.h"

namespace tidepool {

// The budget the process's pinned memory is held to now.
struct ProcessPinnedBudget {
  std::size_t bytes = 0;
  bool from_config = false;  // tidepool.pinned_budget set it (else a quarter of RAM)
};
// Resolved from the active configuration at each call: it may be applied after the
// arenas and pools that charge it exist. A VmmPool resolves it at each charge, a
// HostArena at each allocation (Note [What an arena charges] in host_arena.cpp).
TIDEPOOL_API ProcessPinnedBudget process_pinned_budget();

// Adds `bytes` to the process's count when the count stays within `budget` with them and
// returns true; else changes nothing, returns false and writes the count it saw to
// *count_seen (when not null), for the caller's message. Pre: the caller registers (or
// creates) the memory only after a true, and gives it back with uncharge_process_pinned
// once it is no longer pinned or when pinning it failed.
TIDEPOOL_API bool charge_process_pinned(std::size_t bytes, std::size_t budget,
                                        std::size_t* count_seen = nullptr);
TIDEPOOL_API void uncharge_process_pinned(std::size_t bytes) noexcept;
// Pinned bytes charged now by the process's arenas and pools, and left charged by those
// destroyed with memory still pinned.
TIDEPOOL_API std::size_t process_pinned_bytes() noexcept;
// How many times pinned bytes were given back to the process's count: room a refused
// charge may now find (HostArena::pinned_room_epoch).
TIDEPOOL_API std::uint64_t process_pinned_uncharges() noexcept;

}  // namespace tidepool
