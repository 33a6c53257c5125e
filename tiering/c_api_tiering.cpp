// The tiering C ABI (c_api_tiering.h): thin wrappers over the device's VmmPool and
// tiered stores (tiering_registry.h) that turn exceptions into status codes and a
// message in the allocator's thread-local error slot (tidepool_last_error), so that a
// caller of both C ABIs reads every error in one place.
//
// Note [prefetch within the state budget]
//   tidepool.state_budget is the device memory optimizer state may occupy. The VmmPool
//   enforces it on every migration towards the device (Note [VMM device budget] in
//   vmm_migration.h: a chunk that would take the pool's device-backed bytes over the
//   budget stays host-backed, where kernels still reach it through the same pointer,
//   only over the link). What this file adds is the order: a tag prefetch walks the
//   tag's ranges oldest first (tiering_registry.h: the order the optimizer created and
//   then walks its state), so when the budget cuts, it is the state used first that is
//   on the device; and it adds up the bytes left on the host for the caller. With no
//   configured budget (tidepool not enabled by a configuration) everything comes back.
//   Tiered stores apply their own device budget (TieredStore's device_budget_bytes,
//   which defaults to the same key).
#include "tiering/c_api_tiering.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/c_api_guard.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/device_registry.h"
#include "allocator/fork_guard.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tiering/device_budget_ledger.h"
#include "tiering/pinned_budget.h"
#include "tiering/stats_json.h"
#include "tiering/steps_in_flight.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace {

// Runs `fn`, mapping exceptions to `on_error` and the thread's last error message,
// which names the entry point `what` (allocator/c_api_guard.h).
template <typename Fn, typename R>
R guarded(const char* what, R on_error, Fn&& fn) {
  return tidepool::detail::guarded(tidepool::detail::CErrorStyle{what, false}, on_error,
                                   std::forward<Fn>(fn));
}

tidepool::Stream as_stream(void* s) { return tidepool::Stream{s}; }

// Note [prefetch within the state budget]. Returns the bytes of the tag's ranges left
// host-backed by the budget.
std::uint64_t prefetch_ranges_within_budget(tidepool::VmmPool* pool, int tag) {
  if (pool == nullptr) return 0;
  return pool->migrate_tag(tag, tidepool::MemoryLocation::device).bytes_left;
}

// Note [A call by tag that fails part-way]
// The tag's pointer-stable ranges and its tiered-store handles are separate state. A range
// whose move fails (the host out of memory, a chunk that would not map) ends the pool's
// walk there: the ranges before it moved, those after it did not, and of it the chunks of
// the batches that had completed stay moved (VmmPool::migrate: each chunk is whole on one
// side, at its address). The stores' handles are moved all the same, and the error
// then says so: the range's own message ("data stays where it was") is about that range,
// and read alone it said nothing had moved, while the earlier ranges and every handle had.
template <typename MoveRanges, typename MoveStores>
void moving_ranges_then_stores(MoveRanges&& move_ranges, MoveStores&& move_stores) {
  std::string ranges_failure;
  try {
    move_ranges();
  } catch (const std::exception& e) {
    ranges_failure = e.what();
  }
  move_stores();
  if (!ranges_failure.empty()) {
    throw tidepool::TieringError(
        ranges_failure +
        " (the tag's ranges before that one were moved, those after it were not, and of it "
        "what had moved before the failure stays moved; the tag's tiered-store handles were "
        "moved)");
  }
}

// The device's VmmPool for the calls that read or move what exists (ownership, stats,
// evict and prefetch by tag): nullptr while no range was made there, so that asking
// about a device the process never used creates nothing on it (on CUDA, a context of
// hundreds of MiB). A bad device index is still an error.
tidepool::VmmPool* existing_vmm_pool(int device) {
  tidepool::check_device(device);
  return tidepool::existing_tiering_vmm_pool(device);
}

// The calls by tag act on a tag that exists: an id naming none would otherwise move
// nothing and report success, hiding the caller's mistake.
void check_tag(int tag) {
  if (tidepool::tag_name(tag) == nullptr) {
    throw std::invalid_argument("no tag has the id " + std::to_string(tag) + " (ids 0.." +
                                std::to_string(tidepool::tag_count() - 1) + " exist)");
  }
}

// The device's VMM figures. With no range made yet: zeros, and the budget a pool would
// get (the configured one; a percentage is known once the device's allocator is).
tidepool::VmmStats vmm_stats(int device) {
  if (const tidepool::VmmPool* pool = existing_vmm_pool(device)) return pool->stats();
  tidepool::VmmStats v;
  tidepool::CachingAllocator* allocator = tidepool::existing_device_allocator(device);
  const auto budget = tidepool::configured_state_budget_bytes(
      tidepool::active_config(), allocator != nullptr ? &allocator->backend() : nullptr);
  v.has_device_budget = budget.has_value();
  v.device_budget_bytes = budget.value_or(0);
  return v;
}

}  // namespace

using tidepool::MemoryLocation;
using tidepool::TieredStore;

extern "C" {

void* tidepool_vmm_malloc(size_t size, int device, int tag, void* stream) {
  return guarded("tidepool_vmm_malloc", static_cast<void*>(nullptr), [&]() -> void* {
    check_tag(tag);  // a range under no tag could never be moved by tag
    void* p = tidepool::allocate_tierable_range(device, size, tag, as_stream(stream));
    if (p == nullptr) {
      // Without a state budget the device was full even after older ranges moved to the
      // host; with one, a range the device cannot hold goes to host memory, which had no
      // room either (its memory, or tidepool.pinned_budget).
      const tidepool::VmmPool* pool = tidepool::existing_tiering_vmm_pool(device);
      const bool budgeted = pool != nullptr && pool->device_budget_bytes().has_value();
      tidepool::set_last_error(
          "tidepool_vmm_malloc: no memory for " + std::to_string(size) + " bytes on device " +
          std::to_string(device) +
          (budgeted ? " (under tidepool.state_budget), nor room in host memory or in "
                      "tidepool.pinned_budget"
                    : " (out of device memory, after moving older state to the host)"));
    }
    return p;
  });
}

int tidepool_vmm_free(void* ptr, int device) {
  if (tidepool::in_forked_child()) return 0;  // Note [Forked child]: the parent's range
  return guarded("tidepool_vmm_free", -1, [&] {
    if (ptr != nullptr) tidepool::free_tierable_range(device, ptr);
    return 0;
  });
}

int tidepool_vmm_record_stream(void* ptr, int device, void* stream) {
  return guarded("tidepool_vmm_record_stream", -1, [&] {
    tidepool::record_tierable_range_use(device, ptr, as_stream(stream));
    return 0;
  });
}

int tidepool_vmm_owns(const void* ptr, int device) {
  return guarded("tidepool_vmm_owns", 0, [&] {
    const tidepool::VmmPool* pool = existing_vmm_pool(device);
    return pool != nullptr && pool->owns(ptr) ? 1 : 0;
  });
}

int tidepool_range_ids(int device, const void* const* ptrs, size_t n, uint64_t* ids) {
  return guarded("tidepool_range_ids", -1, [&] {
    if (n > 0 && (ptrs == nullptr || ids == nullptr)) {
      throw std::invalid_argument(std::string(ptrs == nullptr ? "ptrs" : "ids") +
                                  " is NULL but n is " + std::to_string(n));
    }
    const tidepool::VmmPool* pool = existing_vmm_pool(device);
    if (pool != nullptr) {
      pool->range_ids({ptrs, n}, {ids, n});
    } else {
      std::fill(ids, ids + n, std::uint64_t{0});
    }
    return 0;
  });
}

int tidepool_step_begin(int device) {
  return guarded("tidepool_step_begin", -1, [&] {
    tidepool::note_step_begin(device);
    return 0;
  });
}

int tidepool_step_end(int device) {
  return guarded("tidepool_step_end", -1, [&] {
    tidepool::note_step_end(device);
    return 0;
  });
}

int tidepool_steps_in_flight(int device) { return tidepool::steps_in_flight(device); }

int tidepool_evict_tag(int device, int tag) {
  return guarded("tidepool_evict_tag", -1, [&] {
    check_tag(tag);
    tidepool::VmmPool* pool = existing_vmm_pool(device);
    moving_ranges_then_stores(
        [&] {
          if (pool != nullptr) pool->migrate_tag(tag, MemoryLocation::host);
        },
        [&] {
          tidepool::for_each_tiered_store(device, [&](TieredStore& s) { s.evict_tag(tag); });
        });
    return 0;
  });
}

int tidepool_prefetch_tag_within_budget(int device, int tag, void* stream,
                                        uint64_t* bytes_left_on_host) {
  return guarded("tidepool_prefetch_tag_within_budget", -1, [&] {
    if (bytes_left_on_host != nullptr) *bytes_left_on_host = 0;
    check_tag(tag);
    tidepool::VmmPool* pool = existing_vmm_pool(device);
    std::uint64_t left = 0;
    moving_ranges_then_stores([&] { left = prefetch_ranges_within_budget(pool, tag); },
                              [&] {
                                tidepool::for_each_tiered_store(device, [&](TieredStore& s) {
                                  s.prefetch_tag(tag, as_stream(stream));
                                });
                              });
    if (bytes_left_on_host != nullptr) *bytes_left_on_host = left;
    return 0;
  });
}

int tidepool_prefetch_tag(int device, int tag, void* stream) {
  return tidepool_prefetch_tag_within_budget(device, tag, stream, nullptr);
}

namespace {
// The calls by one pointer: a device with no range creates nothing (no pool, on CUDA no
// context) just to find the pointer is not in one; that is still the error it always was.
void migrate_one_pointer(int device, void* ptr, MemoryLocation to) {
  tidepool::VmmPool* pool = existing_vmm_pool(device);
  if (pool == nullptr) {
    throw tidepool::TieringError("vmm pool: migrate of a pointer it does not own (device " +
                                 std::to_string(device) + " has no pointer-stable range)");
  }
  pool->migrate(ptr, to);
}

// The calls by pointers (tidepool_prefetch_ptrs, tidepool_evict_ptrs): the ranges holding
// ptrs[0..n) move to `to`, each once, pointers in no range skipped; nothing is created on
// a device with no range. Returns the bytes the budget left host-backed.
std::uint64_t migrate_pointers(int device, const void* const* ptrs, size_t n, MemoryLocation to) {
  if (ptrs == nullptr && n > 0) {
    throw std::invalid_argument("ptrs is NULL but n is " + std::to_string(n));
  }
  tidepool::VmmPool* pool = existing_vmm_pool(device);
  if (pool == nullptr || n == 0) return 0;  // no range anywhere on the device to move
  return pool->migrate_ranges_holding({ptrs, n}, to).bytes_left;
}
}  // namespace

int tidepool_evict_ptr(int device, void* ptr) {
  return guarded("tidepool_evict_ptr", -1, [&] {
    migrate_one_pointer(device, ptr, MemoryLocation::host);
    return 0;
  });
}

int tidepool_prefetch_ptr(int device, void* ptr, void* /*stream*/) {
  return guarded("tidepool_prefetch_ptr", -1, [&] {
    migrate_one_pointer(device, ptr, MemoryLocation::device);
    return 0;
  });
}

int tidepool_prefetch_ptrs(int device, const void* const* ptrs, size_t n, void* /*stream*/,
                           uint64_t* bytes_left_on_host) {
  return guarded("tidepool_prefetch_ptrs", -1, [&] {
    if (bytes_left_on_host != nullptr) *bytes_left_on_host = 0;
    const std::uint64_t left = migrate_pointers(device, ptrs, n, MemoryLocation::device);
    if (bytes_left_on_host != nullptr) *bytes_left_on_host = left;
    return 0;
  });
}

int tidepool_device_ranges_except(int device, int tag, const void* const* except,
                                  size_t n_except, void** out, size_t capacity, size_t* count) {
  return guarded("tidepool_device_ranges_except", -1, [&] {
    if (count == nullptr) throw std::invalid_argument("count is NULL");
    *count = 0;
    check_tag(tag);
    if (except == nullptr && n_except > 0) {
      throw std::invalid_argument("except is NULL but n_except is " + std::to_string(n_except));
    }
    if (out == nullptr && capacity > 0) {
      throw std::invalid_argument("out is NULL but capacity is " + std::to_string(capacity));
    }
    tidepool::VmmPool* pool = existing_vmm_pool(device);
    if (pool == nullptr) return 0;
    const std::vector<void*> bases = pool->device_backed_ranges(tag, {except, n_except});
    std::copy_n(bases.begin(), std::min(bases.size(), capacity), out);
    *count = bases.size();
    return 0;
  });
}

int tidepool_evict_ptrs(int device, const void* const* ptrs, size_t n) {
  return guarded("tidepool_evict_ptrs", -1, [&] {
    migrate_pointers(device, ptrs, n, MemoryLocation::host);
    return 0;
  });
}

int tidepool_get_tiering_stats_v1(int device, tidepool_tiering_stats_v1* out) {
  return guarded("tidepool_get_tiering_stats_v1", -1, [&] {
    tidepool::detail::check_versioned_struct(out, TIDEPOOL_TIERING_STATS_V1_MIN_SIZE,
                                             "tidepool_tiering_stats_v1");
    tidepool_tiering_stats_v1 full{};
    full.version = 1;
    full.device = device;
    // The stores built from the configuration share the device's one budget (Note [Shared
    // state budget] in device_budget_ledger.h): it is counted once, not once per store.
    // Each resolved it when it was built, so they differ only if the configuration
    // changed in between; the largest is what their charges together may reach.
    std::uint64_t shared_budget = 0;
    // Note [Rates from timed bytes] in copy_engine.h: the rates are of the bytes timed.
    std::uint64_t h2d_timed_bytes = 0, d2h_timed_bytes = 0;
    tidepool::for_each_tiered_store(device, [&](TieredStore& store) {
      const tidepool::TieredStoreStats s = store.stats();
      full.stores++;
      full.h2d_bytes += s.copy.h2d.bytes;
      full.d2h_bytes += s.copy.d2h.bytes;
      h2d_timed_bytes += s.copy.h2d.timed_bytes;
      d2h_timed_bytes += s.copy.d2h.timed_bytes;
      full.h2d_busy_ms += s.copy.h2d.busy_ms;
      full.d2h_busy_ms += s.copy.d2h.busy_ms;
      full.exposed_wait_ms += s.copy.exposed_wait_ms;
      full.hidden_ms += s.copy.hidden_ms();
      full.device_bytes += s.device_bytes;
      if (s.budget_shared) {
        shared_budget = std::max<std::uint64_t>(shared_budget, s.device_budget_bytes);
      } else {
        full.device_budget_bytes += s.device_budget_bytes;
      }
      full.acquires += s.acquires;
      full.prefetch_issued += s.prefetch_issued;
      full.prefetch_hits += s.prefetch_hits;
      full.prefetch_late += s.prefetch_late;
      full.misses += s.misses;
      full.prefetch_skipped += s.prefetch_skipped;
      full.evictions += s.evictions;
      full.evictions_clean += s.evictions_clean;
      full.reclaim_calls += s.reclaim_calls;
      full.reclaimed_bytes += s.reclaimed_bytes;
      full.pinned_host_bytes += s.host.pinned_in_use_bytes;
      full.pageable_host_bytes += s.host.pageable_in_use_bytes;
      full.pageable_fallbacks += s.host.pageable_allocs;
      full.off_schedule_acquires += s.off_schedule_acquires;
      full.schedule_adoptions += s.schedule_adoptions;
      if (s.budget_shared) full.shared_budget_stores++;
      full.peer_evictions += s.peer_evictions;
      full.peer_evicted_bytes += s.peer_evicted_bytes;
      full.peer_room_requests += s.peer_room_requests;
      full.loads_skipped += s.loads_skipped;
      full.host_promotions += s.host_promotions;
      full.host_promoted_bytes += s.host_promoted_bytes;
    });
    full.device_budget_bytes += shared_budget;
    if (const auto ledger = tidepool::DeviceBudgetLedger::existing(device)) {
      full.shared_budget_charged_bytes = ledger->charged_bytes();
    }
    const auto rate = [](std::uint64_t bytes, double ms) {
      return ms > 0 ? double(bytes) / (ms * 1e6) : 0.0;
    };
    full.h2d_gb_per_s = rate(h2d_timed_bytes, full.h2d_busy_ms);
    full.d2h_gb_per_s = rate(d2h_timed_bytes, full.d2h_busy_ms);
    const tidepool::VmmStats v = vmm_stats(device);
    full.vmm_ranges = v.ranges;
    full.vmm_device_bytes = v.device_backed_bytes;
    full.vmm_host_bytes = v.host_backed_bytes;
    full.vmm_bytes_to_host = v.bytes_to_host;
    full.vmm_bytes_to_device = v.bytes_to_device;
    full.vmm_failed_migrations = v.failed_migrations;
    full.vmm_migration_ms = v.migration_ms;
    full.vmm_device_budget_bytes = v.has_device_budget ? v.device_budget_bytes : UINT64_MAX;
    full.vmm_budget_stops = v.budget_stops;
    full.vmm_bytes_left_on_host = v.bytes_left_on_host;
    full.vmm_spare_host_bytes = v.spare_host_bytes;
    full.pinned_budget_bytes = tidepool::process_pinned_budget().bytes;
    full.process_pinned_bytes = tidepool::process_pinned_bytes();
    full.vmm_pinned_bytes = v.pinned_bytes;
    full.vmm_pinned_budget_stops = v.pinned_budget_stops;
    full.vmm_bytes_left_on_device = v.bytes_left_on_device;
    tidepool::detail::copy_versioned_struct(out, full);
    return 0;
  });
}

char* tidepool_tiering_snapshot_json(int device) {
  return guarded("tidepool_tiering_snapshot_json", static_cast<char*>(nullptr), [&]() -> char* {
    std::string json = "{\"device\":" + std::to_string(device) + ",\"stores\":[";
    bool first = true;
    tidepool::for_each_tiered_store(device, [&](TieredStore& s) {
      json += first ? "" : ",";
      json += s.stats_json();
      first = false;
    });
    json += "],\"vmm\":" + tidepool::to_json(vmm_stats(device)) + "}";
    return tidepool::detail::malloc_c_string(json);
  });
}

const char* tidepool_tiering_last_error(void) { return tidepool_last_error(); }

}  // extern "C"
