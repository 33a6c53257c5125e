// The fields of PyTorch's stats (c10's DeviceStats, which tidepool_pytorch_stats_v1 copies
// field for field: Note [PyTorch's view of the stats] in c_api.h), listed once.
//
// Why here: libtidepool resets the running totals of its C struct (pytorch_stats.cpp) and
// libtidepool_torch_cuda.so copies that struct into c10's
// (optimizers/install/torch_cuda_allocator.cpp); both walk the same fields. A template
// over both structs, because the fields have the same names in each and libtidepool,
// which includes this header, must not depend on c10.
#pragma once

namespace tidepool::detail {

// Calls, for each field `f` of PyTorch's stats that is a running total or holds some:
// `pools(to.f, from.f)` for the per-pool arrays (indexed by TIDEPOOL_POOL_*),
// `stat(to.f, from.f)` for the single stats, `count(to.f, from.f)` for the plain counts.
// max_split_size is a setting, not a figure, and is left to the caller.
template <class To, class From, class PoolsFn, class StatFn, class CountFn>
void for_each_pytorch_stat(To& to, const From& from, PoolsFn&& pools, StatFn&& stat,
                           CountFn&& count) {
  pools(to.allocation, from.allocation);
  pools(to.segment, from.segment);
  pools(to.active, from.active);
  pools(to.inactive_split, from.inactive_split);
  pools(to.allocated_bytes, from.allocated_bytes);
  pools(to.reserved_bytes, from.reserved_bytes);
  pools(to.active_bytes, from.active_bytes);
  pools(to.inactive_split_bytes, from.inactive_split_bytes);
  pools(to.requested_bytes, from.requested_bytes);
  count(to.num_alloc_retries, from.num_alloc_retries);
  count(to.num_ooms, from.num_ooms);
  stat(to.oversize_allocations, from.oversize_allocations);
  stat(to.oversize_segments, from.oversize_segments);
  count(to.num_sync_all_streams, from.num_sync_all_streams);
  count(to.num_device_alloc, from.num_device_alloc);
  count(to.num_device_free, from.num_device_free);
}

}  // namespace tidepool::detail
