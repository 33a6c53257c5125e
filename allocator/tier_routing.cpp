// Resolves the configured tiering budgets to bytes (see tier_routing.h).
#include "allocator/tier_routing.h"

#include <unistd.h>

#include <stdexcept>

namespace tidepool {

std::size_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) {
    throw std::runtime_error("tidepool: sysconf does not report the host's physical memory");
  }
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

std::optional<std::size_t> configured_state_budget_bytes(const Config& config, Backend& backend) {
  if (!config.enabled || config.state_budget.kind == Budget::Kind::unset) return std::nullopt;
  // mem_info is only asked for a percentage: it may synchronise with the device.
  const std::uint64_t total =
      config.state_budget.kind == Budget::Kind::fraction ? backend.mem_info().total_bytes : 0;
  return static_cast<std::size_t>(config.state_budget.resolve(total, 0));
}

std::optional<std::size_t> configured_pinned_budget_bytes(const Config& config) {
  if (!config.enabled || config.pinned_budget.kind == Budget::Kind::unset) return std::nullopt;
  const std::uint64_t total =
      config.pinned_budget.kind == Budget::Kind::fraction ? host_memory_bytes() : 0;
  return static_cast<std::size_t>(config.pinned_budget.resolve(total, 0));
}

}  // namespace tidepool
