// The process's pinned host budget and its one count (pinned_budget.h).
//
// Note [One pinned budget per process]
// tidepool.pinned_budget bounds the pinned host memory tiering may use (allocator/config.h).
// Pinned memory is taken from the OS for good while it stays pinned: it cannot be swapped
// or reclaimed, so a process that pins most of RAM starves everything else on the machine.
// Every TieredStore owns a HostArena, and every device's pointer-stable ranges a VmmPool
// whose host backings are pinned: were the budget each one's, N tiered optimizers (or N
// devices, with the default quarter of RAM) would pin N times it, and the ranges evicted
// by the Python hooks would pin without bound. So every arena and pool whose budget comes
// from the configuration or the default charges what it pins (an arena's registered slabs
// and direct mappings, a pool's host backings: mapped, kept as spares, or created ahead of
// a move) to one process-wide count, and is refused a charge that would take that count
// past the budget (a budget lowered below the count takes nothing back; new charges wait
// until enough is given back). A charge is taken before the memory is pinned, and given
// back when it is no longer pinned or when pinning it failed. Memory a destroyed arena or
// pool leaves pinned (blocks still live, a registration or backing the backend would not
// release) stays charged: it stays pinned.
// Where the budget has no room, an arena falls back to pageable memory (reported: Note
// [A budget smaller than a slab] in host_arena.cpp), and a pool's move to the host stops
// there, the rest of the range staying on the device (Note [Pinned host backings] in
// vmm_backings.cpp): host-NUMA backings have no pageable kind.
// An arena or pool given a budget of its own keeps it to itself and charges nothing here,
// as a tiered store given a device budget of its own does (Note [Shared state budget] in
// device_budget_ledger.h). That ledger is not reused here: it is kept per device, its seats
// ask each other to evict for room, and a seat gives back its charge when destroyed, while
// pinned memory is the host's, nobody here is asked to give room back, and leaked pinned
// memory must stay charged. What is left is one atomic count, which nobody waits for.
#include "tiering/pinned_budget.h"

#include <atomic>
#include <cstdint>

#include "allocator/config.h"
#include "allocator/tier_routing.h"

namespace tidepool {

namespace {
std::atomic<std::size_t>& process_count() {
  static std::atomic<std::size_t> bytes{0};
  return bytes;
}
std::atomic<std::uint64_t>& process_uncharges() {
  static std::atomic<std::uint64_t> count{0};
  return count;
}
}  // namespace

ProcessPinnedBudget process_pinned_budget() {
  if (const auto configured = configured_pinned_budget_bytes(active_config())) {
    return ProcessPinnedBudget{*configured, true};
  }
  return ProcessPinnedBudget{host_memory_bytes() / 4, false};
}

bool charge_process_pinned(std::size_t bytes, std::size_t budget, std::size_t* count_seen) {
  std::atomic<std::size_t>& count = process_count();
  std::size_t now = count.load();
  do {
    if (bytes > budget || now > budget - bytes) {
      if (count_seen != nullptr) *count_seen = now;
      return false;
    }
  } while (!count.compare_exchange_weak(now, now + bytes));
  return true;
}

void uncharge_process_pinned(std::size_t bytes) noexcept {
  process_count().fetch_sub(bytes);
  process_uncharges().fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t process_pinned_uncharges() noexcept {
  return process_uncharges().load(std::memory_order_relaxed);
}

std::size_t process_pinned_bytes() noexcept { return process_count().load(); }

}  // namespace tidepool
