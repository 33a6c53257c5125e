// PyTorch's view of a device's stats (Note [PyTorch's view of the stats] in c_api.h):
// tidepool's AllocatorStats laid out as c10's DeviceStats, with running totals that
// count from the last accumulated-stats reset of the device.
//
// Why here and not in each reader: torch.cuda.memory_stats() reaches tidepool two ways,
// through the c10 allocator of libtidepool_torch_cuda.so (C++) and, without that library,
// through the Python package's replacement of torch.cuda's functions. Deciding once what
// every PyTorch figure means, and keeping the reset point in libtidepool, gives both the
// same answer, and a reset made through one is seen through the other.
//
// The reset point is a copy of the view's running totals, per device, taken at the reset
// and subtracted on every read: tidepool's own counters are never rewound (the allocator
// uses them, and tidepool_get_stats_v1 documents them as totals since start).
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "allocator/c_api.h"
#include "allocator/c_api_guard.h"
#include "allocator/device_registry.h"
#include "allocator/pytorch_stats_fields.h"

namespace {

using tidepool::detail::to_c_stat;

// The device's figures with the totals since start. A device tidepool has not allocated
// on yet has none, and reading them creates no allocator there (on CUDA, no context).
tidepool_pytorch_stats_v1 view_since_start(int device) {
  const tidepool::CachingAllocator* allocator = tidepool::checked_existing_allocator(device);
  const tidepool::AllocatorStats s = allocator ? allocator->stats() : tidepool::AllocatorStats{};
  tidepool_pytorch_stats_v1 v{};
  v.version = 1;
  const auto all_in_large = [](tidepool_stat_v1 (&pools)[3], const tidepool::Stat& stat) {
    pools[TIDEPOOL_POOL_ALL] = pools[TIDEPOOL_POOL_LARGE] = to_c_stat(stat);
  };
  all_in_large(v.allocation, s.allocations);
  all_in_large(v.segment, s.segments);
  all_in_large(v.active, s.allocations);
  all_in_large(v.allocated_bytes, s.allocated);
  all_in_large(v.reserved_bytes, s.reserved);
  all_in_large(v.active_bytes, s.allocated);
  all_in_large(v.requested_bytes, s.requested);
  v.num_alloc_retries = s.reclaim_calls;
  v.num_ooms = s.oom_count;
  v.num_device_alloc = s.segments.allocated;
  v.num_device_free = s.segments.freed;
  v.max_split_size = -1;
  return v;
}

// Subtracts the running totals of `base` from those of `v`.
void subtract_totals(tidepool_pytorch_stats_v1& v, const tidepool_pytorch_stats_v1& base) {
  const auto minus = [](tidepool_stat_v1& s, const tidepool_stat_v1& b) {
    s.allocated -= b.allocated;
    s.freed -= b.freed;
  };
  tidepool::detail::for_each_pytorch_stat(
      v, base,
      [&](tidepool_stat_v1(&pools)[3], const tidepool_stat_v1(&b)[3]) {
        for (int p = 0; p < 3; ++p) minus(pools[p], b[p]);
      },
      minus, [](std::uint64_t& count, std::uint64_t b) { count -= b; });
}

// Device -> the since-start view at its last reset. Never destroyed: PyTorch may read
// stats during process tear-down.
struct ResetPoints {
  std::mutex mutex;
  std::map<int, tidepool_pytorch_stats_v1> of;
};
ResetPoints& reset_points() {
  static ResetPoints* points = new ResetPoints();
  return *points;
}

template <class Fn>
int guarded(Fn&& fn) {
  return tidepool::detail::guarded(tidepool::detail::kAllocatorErrorStyle, -1,
                                   std::forward<Fn>(fn));
}

}  // namespace

extern "C" {

int tidepool_get_pytorch_stats_v1(int device, tidepool_pytorch_stats_v1* out) {
  return guarded([&] {
    tidepool::detail::check_versioned_struct(out, TIDEPOOL_PYTORCH_STATS_V1_MIN_SIZE,
                                             "tidepool_pytorch_stats_v1");
    ResetPoints& points = reset_points();
    tidepool_pytorch_stats_v1 v;
    {
      // The figures are read under the lock too: a reset taken after them would make
      // their totals negative.
      std::lock_guard lock(points.mutex);
      v = view_since_start(device);
      auto it = points.of.find(device);
      if (it != points.of.end()) subtract_totals(v, it->second);
    }
    tidepool::detail::copy_versioned_struct(out, v);
    return 0;
  });
}

int tidepool_pytorch_reset_accumulated_stats(int device) {
  return guarded([&] {
    ResetPoints& points = reset_points();
    std::lock_guard lock(points.mutex);
    points.of[device] = view_since_start(device);
    return 0;
  });
}

}  // extern "C"
