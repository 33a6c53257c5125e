// What the allocator layer knows about tiering, without calling it (layers point down):
//
//  - The tier route: the hook through which the tiering layer takes over allocations
//    under tierable tags (optimizer_state) at or above tidepool.tier_min_bytes, so that
//    tidepool_malloc / tidepool_free (allocator/c_api.h) serve them from pointer-stable,
//    migratable ranges. See Note [tier route].
//  - The configured memory budgets in bytes: tidepool.state_budget (device memory
//    optimizer state may keep) and tidepool.pinned_budget (pinned host memory), see
//    Note [tidepool keys] in config.h. A percentage is resolved against the device's
//    total memory (Backend::mem_info) or the host's physical RAM. The tiering objects
//    (TieredStore, HostArena, the tag prefetch of the tiering C ABI) take these as their
//    defaults; an explicit option of theirs wins. "nullopt" means the configuration sets
//    no budget, so the caller keeps its own default.
//
// Note [tier route]
//   The tiering layer registers one TierRoute (tiering/tiering_registry.cpp, from a
//   static initializer of libtidepool.so). Registration from a static initializer is
//   robust to load order: the route slot here is a constant-initialized atomic pointer,
//   so it is valid before any dynamic initializer runs, and the loader runs every
//   initializer of libtidepool.so before dlopen() returns or main() starts, i.e. before
//   anyone can call tidepool_malloc. Registering when the configuration is applied
//   instead would leave C++ users who never apply one (tests, trainers that link
//   tidepool directly) without routing, and would make the allocator depend on the
//   order of set-up calls.
//   A request is routed when the route exists, the calling thread's tag is in
//   route.tags, and the size is >= tier_min_bytes() (tidepool.tier_min_bytes, default
//   kDefaultTierMinBytes in config.h). If the route declines (no device memory for a
//   fresh range) or fails, the caching allocator serves the request: such a block is not
//   migratable, which costs device memory later, not correctness.
//   The free side asks the route whether it owns the pointer only while the route has
//   live ranges (TierRoute::live_ranges, counted by the tiering layer whichever way a range
//   was made or freed: a count kept here missed the ranges freed through the tiering C
//   ABI, and stayed up for good) and the size handed back is at least tier_min_bytes(),
//   so frees of small blocks, and all frees before any optimizer state exists, cost
//   nothing extra. A pointer the caching allocator rejects is offered to the route as
//   well, so both shortcuts are optimisations, never a source of truth (a range routed
//   under an older, lower threshold, or made by the tiering C ABI, is still found).
//
// Thread-safety: every function may be called from any thread; the budget functions are
// pure functions of their arguments (and, for host RAM, of sysconf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "allocator/backend.h"
#include "allocator/config.h"
#include "allocator/export.h"

namespace tidepool {

// ---- the tier route --------------------------------------------------------------------

// Callbacks of the layer that serves tierable allocations. All five are required; each
// may throw (the C ABI turns exceptions into its error slot).
struct TierRoute {
  std::uint64_t tags = 0;  // bit t set: allocations under tag t are routed
  // A range of at least `bytes` on `device`, usable on `stream`; nullptr when the device
  // has no memory for it (the caching allocator is tried next).
  void* (*allocate)(std::size_t bytes, int device, int tag, void* stream) = nullptr;
  // Whether `ptr` is the base of a live range of the route on `device`.
  bool (*owns)(const void* ptr, int device) = nullptr;
  // Frees a range `owns` said yes to. `bytes` is what the caller hands back: a size other
  // than the one the range was asked for throws and frees nothing, as the caching
  // allocator refuses a wrong size (a caller that mixed up two sizes has lost track of
  // which memory is which).
  void (*deallocate)(void* ptr, std::size_t bytes, int device) = nullptr;
  // Work on `stream` uses `ptr`: the range is not moved or released before it finishes.
  void (*record_stream)(void* ptr, int device, void* stream) = nullptr;
  // `stream` is about to be destroyed (tidepool_release_stream; the allocator has waited
  // for it only if it held something for it): wait for it if the route holds anything on
  // the device, and forget every use of it recorded on the device's ranges, so no later
  // move waits on a dead handle. Throws for a stream that is already destroyed when it
  // waits, changing nothing.
  void (*release_stream)(int device, void* stream) = nullptr;
  // The route's live ranges on every device, however made and however freed (through
  // tidepool_malloc or the tiering C ABI): while there are none, frees and record_streams
  // do not ask `owns`. Cheap and lock-free: it is read on every large free.
  std::size_t (*live_ranges)() noexcept = nullptr;
};

// Installs `route` (static storage; not copied). Registering the same route again is a
// no-op; a different one throws std::logic_error (one tiering layer per process).
// Throws std::invalid_argument when a callback is missing.
TIDEPOOL_API void register_tier_route(const TierRoute* route);
// The route, or nullptr before registration.
TIDEPOOL_API const TierRoute* tier_route() noexcept;

// tidepool.tier_min_bytes as applied (apply_config sets it; kDefaultTierMinBytes before).
TIDEPOOL_API void set_tier_min_bytes(std::size_t bytes) noexcept;
TIDEPOOL_API std::size_t tier_min_bytes() noexcept;

namespace detail {
// For allocator/c_api.cpp. route_allocate: a routed allocation of `bytes` for the
// calling thread's tag, or nullptr when the request is not routed or the route declined
// or failed (then the caching allocator serves it; a failure is reported on stderr once
// per process). route_free / route_record_stream: true when the route owned `ptr` and
// handled it; `always_ask` skips the shortcuts of the Note (for pointers the caching
// allocator rejected). `size` is the size the caller hands back on free.
void* route_allocate(std::size_t bytes, int device, void* stream);
bool route_free(void* ptr, std::size_t size, int device, bool always_ask);
bool route_record_stream(void* ptr, int device, void* stream, bool always_ask);
// route->release_stream when a route is registered.
void route_release_stream(int device, void* stream);
}  // namespace detail

// ---- budgets ---------------------------------------------------------------------------

// Physical RAM of this machine in bytes (sysconf); throws std::runtime_error when the
// system does not say.
TIDEPOOL_API std::size_t host_memory_bytes();

// tidepool.state_budget in bytes of `backend`'s device. nullopt when tidepool is not
// enabled by `config`. Note that 0 is a valid answer (keep nothing between steps).
TIDEPOOL_API std::optional<std::size_t> configured_state_budget_bytes(const Config& config,
                                                                      Backend& backend);
// The same without a backend at hand (`backend` may be null): nullopt also when the
// budget is a percentage and no backend can say how large the device is.
TIDEPOOL_API std::optional<std::size_t> configured_state_budget_bytes(const Config& config,
                                                                      Backend* backend);

// tidepool.pinned_budget in bytes of host RAM. nullopt when tidepool is not enabled by
// `config` or the key is absent (the process's pinned budget is then a quarter of RAM:
// tiering/pinned_budget.h);
// "unlimited" is all of the host's RAM.
TIDEPOOL_API std::optional<std::size_t> configured_pinned_budget_bytes(const Config& config);

}  // namespace tidepool
