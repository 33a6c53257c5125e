// The configured memory budgets in bytes, for the tiering layer: tidepool.state_budget
// (device memory optimizer state may keep between steps) and tidepool.pinned_budget
// (pinned host memory), see Note [tidepool keys] in config.h. A percentage is resolved
// against the device's total memory (Backend::mem_info) or the host's physical RAM.
//
// The tiering objects (TieredStore, HostArena) take these as their defaults; an explicit
// option of theirs wins. "nullopt" means the configuration sets no budget, so the caller
// keeps its own default.
//
// Thread-safety: pure functions of their arguments (and, for host RAM, of sysconf).
#pragma once

#include <cstddef>
#include <optional>

#include "allocator/backend.h"
#include "allocator/config.h"
#include "allocator/export.h"

namespace tidepool {

// Physical RAM of this machine in bytes (sysconf); throws std::runtime_error when the
// system does not say.
TIDEPOOL_API std::size_t host_memory_bytes();

// tidepool.state_budget in bytes of `backend`'s device. nullopt when tidepool is not
// enabled by `config`. Note that 0 is a valid answer (keep nothing between steps).
TIDEPOOL_API std::optional<std::size_t> configured_state_budget_bytes(const Config& config,
                                                                      Backend& backend);

// tidepool.pinned_budget in bytes of host RAM. nullopt when tidepool is not enabled by
// `config` or the budget is unset ("unlimited").
TIDEPOOL_API std::optional<std::size_t> configured_pinned_budget_bytes(const Config& config);

}  // namespace tidepool
