// What host_arena.cpp (pinned slabs and direct mappings) and pageable_fallback.cpp (the
// blocks served from pageable memory when pinned memory fails, and the warning) share:
// the block alignment and how a pinned failure's reason is classified. Internal to
// tiering/.
#pragma once

#include <cstddef>
#include <string>

namespace tidepool::host_arena_detail {

inline constexpr std::size_t kBlockAlign = 256;  // every block HostArena hands out

// Why pinned memory failed, read once from the reason its failure path wrote; allocate()
// (Note [A budget smaller than a slab] in host_arena.cpp), the stats and the warning all
// go by it.
enum class FallbackCause { register_failed, no_mimalloc, budget_spent, other };

inline FallbackCause fallback_cause(const std::string& reason) {
  if (reason.rfind("host_register", 0) == 0) return FallbackCause::register_failed;
  if (reason.rfind("mimalloc", 0) == 0) return FallbackCause::no_mimalloc;
  if (reason.find("budget") != std::string::npos) return FallbackCause::budget_spent;
  return FallbackCause::other;
}

}  // namespace tidepool::host_arena_detail
