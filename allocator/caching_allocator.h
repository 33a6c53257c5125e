// tidepool::CachingAllocator: the stream-ordered caching device allocator, one per
// device, over one Backend (allocator/backend.h).
//
// Note [Stream contract] (the one statement of it; README repeats it)
// Memory returned by allocate(bytes, s) may be used by work on stream s at once. After
// deallocate(p, bytes, s) the allocator may hand the memory to the next allocate on s
// immediately: work on s is ordered, so it runs after everything s already had. Another
// stream gets the memory only after an event on s says that work has finished. If work on
// other streams used p, name them with record_stream(p, other) before the free: the block
// is then held back until those streams pass the point of the free. Freeing on a stream
// other than the allocating one counts as record_stream(p, that stream) + a free on the
// allocating stream.
//
// Thread-safety: every public method may be called from any thread; a free from another
// thread than the allocating one is legal. One mutex per allocator guards its state; it
// is never held while reclaim hooks run.
//
// Errors: allocate throws OutOfMemoryError (a std::bad_alloc) when the OOM policy could
// not find memory, AllocatorUsageError for an absurd size. deallocate/record_stream throw
// AllocatorUsageError for a pointer the allocator did not hand out, a double free or a
// wrong size; the allocator's state is unchanged in that case.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "allocator/backend.h"
#include "allocator/errors.h"
#include "allocator/export.h"
#include "allocator/stats.h"

namespace tidepool {

struct AllocatorOptions {
  // Grow per-stream reserved address ranges mapped granule by granule (Note [Expandable
  // segments]) instead of one device_alloc per segment.
  bool expandable_segments = true;
  // false: never give memory back to the backend (not even on OOM or empty_cache). The
  // trace replay uses it as the baseline its modeled time is compared with.
  bool allow_release = true;
  // Exact-size quick lists for freed small blocks (Note [Quick lists]).
  bool quick_lists = true;
  // Expandable segments: when backing new granules would make reserved memory exceed
  // the peak of allocated memory by more than this fraction, fully free mapping runs
  // elsewhere are released first (Note [Recycling free runs] in segments.cpp). Negative
  // (the default): never; memory is then given back only under pressure (the OOM
  // policy) and by empty_cache. 0.02 brings GPT-2's trace from 1.069 to 1.026 reserved
  // per live byte, at the price of ~2.6x more backend calls.
  double recycle_slack = -1.0;
  // Expandable segments: among the smallest few fitting free blocks, prefer one whose
  // bytes are already backed over the best fit that would need new backing. Fewer
  // backend calls when recycling (GPT-2: 1.39x instead of 2.6x the baseline's modeled
  // time) but worse packing (ratio 1.039 instead of 1.026); off by default.
  bool prefer_backed_fit = false;
  // Address space reserved per expandable range; 0: the backend's total memory.
  std::size_t expandable_range_bytes = 0;
  // Longest run of granules mapped with one physical allocation. Longer runs mean fewer
  // backend calls; shorter ones let pressure release finer pieces.
  std::size_t max_map_run_bytes = std::size_t{64} << 20;
};

class TIDEPOOL_API CachingAllocator {
 public:
  // The allocator owns `backend`; everything it holds is given back in the destructor.
  explicit CachingAllocator(std::unique_ptr<Backend> backend, AllocatorOptions options = {});
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // bytes == 0 returns nullptr. Tag: the calling thread's current_tag().
  void* allocate(std::size_t bytes, Stream stream = {});
  // ptr == nullptr is a no-op. `bytes` must be the size passed to allocate.
  void deallocate(void* ptr, std::size_t bytes, Stream stream = {});
  // Pre: ptr is live. Marks it as used by `stream` too (see Note [Stream contract]).
  void record_stream(void* ptr, Stream stream);
  // Gives fully free backed memory back to the backend (waits for the streams that last
  // used it; blocks still waiting for record_stream events are kept). Returns bytes
  // released. A no-op when options.allow_release is false.
  std::size_t empty_cache();

  AllocatorStats stats() const;
  void reset_peak_stats();
  // JSON document: device, backend, totals, per-tag stats, segments with their blocks.
  std::string snapshot_json() const;
  // Bytes the allocation at `ptr` was made with, or 0 when ptr is not a live allocation.
  std::size_t allocation_size(const void* ptr) const;
  // True when `ptr` is the start of a live allocation of this allocator.
  bool owns(const void* ptr) const { return allocation_size(ptr) != 0; }

  Backend& backend() const;
  int device() const;
  const AllocatorOptions& options() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidepool
