// The tier route and the configured tiering budgets (see tier_routing.h, Note [tier route]).
#include "allocator/tier_routing.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "allocator/tags.h"

namespace tidepool {

namespace {

// Constant-initialized (no dynamic initializer): valid whenever the tiering layer's
// static initializer registers its route, whatever order initializers run in.
constinit std::atomic<const TierRoute*> g_route{nullptr};
constinit std::atomic<std::size_t> g_tier_min_bytes{kDefaultTierMinBytes};
constinit std::atomic<bool> g_failure_reported{false};

void report_route_failure_once(const char* what) {
  if (g_failure_reported.exchange(true)) return;
  std::fprintf(stderr,
               "tidepool: the tier route failed (%s); tierable allocations it cannot serve "
               "come from the caching allocator and are not migrated (reported once)\n",
               what);
}

bool should_ask(const TierRoute* route, bool always_ask) noexcept {
  return route != nullptr && (always_ask || route->live_ranges() > 0);
}

}  // namespace

// ---- the tier route --------------------------------------------------------------------

void register_tier_route(const TierRoute* route) {
  if (route == nullptr || route->allocate == nullptr || route->owns == nullptr ||
      route->deallocate == nullptr || route->record_stream == nullptr ||
      route->release_stream == nullptr || route->live_ranges == nullptr) {
    throw std::invalid_argument(
        "tidepool: register_tier_route needs a route with all six callbacks");
  }
  const TierRoute* expected = nullptr;
  if (!g_route.compare_exchange_strong(expected, route) && expected != route) {
    throw std::logic_error("tidepool: a different tier route is already registered");
  }
}

const TierRoute* tier_route() noexcept { return g_route.load(std::memory_order_acquire); }

void set_tier_min_bytes(std::size_t bytes) noexcept {
  g_tier_min_bytes.store(bytes, std::memory_order_relaxed);
}

std::size_t tier_min_bytes() noexcept { return g_tier_min_bytes.load(std::memory_order_relaxed); }

namespace detail {

void* route_allocate(std::size_t bytes, int device, void* stream) {
  const TierRoute* route = tier_route();
  if (route == nullptr || bytes < tier_min_bytes()) return nullptr;
  const int tag = current_tag();
  static_assert(kTagCount <= 64, "TierRoute::tags is a 64-bit mask");
  if (tag < 0 || tag >= kTagCount || (route->tags >> tag & 1u) == 0) return nullptr;
  try {
    return route->allocate(bytes, device, tag, stream);
  } catch (const std::exception& e) {
    report_route_failure_once(e.what());
  } catch (...) {
    report_route_failure_once("unknown error");
  }
  return nullptr;
}

bool route_free(void* ptr, std::size_t size, int device, bool always_ask) {
  const TierRoute* route = tier_route();
  if (!should_ask(route, always_ask) || (!always_ask && size < tier_min_bytes()) ||
      !route->owns(ptr, device))
    return false;
  route->deallocate(ptr, size, device);
  return true;
}

bool route_record_stream(void* ptr, int device, void* stream, bool always_ask) {
  const TierRoute* route = tier_route();
  if (!should_ask(route, always_ask) || !route->owns(ptr, device)) return false;
  route->record_stream(ptr, device, stream);
  return true;
}

void route_release_stream(int device, void* stream) {
  // Not behind the live-range shortcut: the stores' handles may name the stream too, and
  // release is rare.
  if (const TierRoute* route = tier_route()) route->release_stream(device, stream);
}


}  // namespace detail

// ---- budgets ---------------------------------------------------------------------------

std::size_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) {
    throw std::runtime_error("tidepool: sysconf does not report the host's physical memory");
  }
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

std::optional<std::size_t> configured_state_budget_bytes(const Config& config, Backend* backend) {
  if (!config.enabled || config.state_budget.kind == Budget::Kind::unset) return std::nullopt;
  const bool fraction = config.state_budget.kind == Budget::Kind::fraction;
  if (fraction && backend == nullptr) return std::nullopt;
  // mem_info is only asked for a percentage: it may synchronise with the device.
  const std::uint64_t total = fraction ? backend->mem_info().total_bytes : 0;
  return static_cast<std::size_t>(config.state_budget.resolve(total, 0));
}

std::optional<std::size_t> configured_state_budget_bytes(const Config& config, Backend& backend) {
  return configured_state_budget_bytes(config, &backend);
}

std::optional<std::size_t> configured_pinned_budget_bytes(const Config& config) {
  if (!config.enabled || config.pinned_budget.kind == Budget::Kind::unset) return std::nullopt;
  const std::uint64_t total =
      config.pinned_budget.kind == Budget::Kind::fraction ? host_memory_bytes() : 0;
  return static_cast<std::size_t>(config.pinned_budget.resolve(total, 0));
}

}  // namespace tidepool
