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
// A stream used with the allocator (allocate, deallocate, record_stream) must be released
// with release_stream(s) before it is destroyed: the allocator keeps per-stream pools,
// fences and thread-cache lists under the stream's handle, and would otherwise later
// record events on the dead stream or mistake a new stream with the same handle for it.
// After release_stream(s), blocks still live from s stay valid and are freed on any live
// stream (as a free on that stream); s itself must not be passed again until a stream is
// (re)created with that handle, which then starts with nothing cached.
// A stream named by record_stream and destroyed without release_stream (PyTorch releases
// none) makes the block's free wait for the whole device instead of recording an event on
// it: slow, said once per allocator, counted in AllocatorStats::free_device_syncs (Note
// [Free after a lost stream]).
//
// Thread-safety: every public method may be called from any thread; a free from another
// thread than the allocating one is legal. One mutex per allocator guards its state; it
// is never held while reclaim hooks run. Small blocks a thread frees on the stream it
// allocated them on may park in that thread's cache (Note [Thread caches]); they count as
// cached (reserved, not allocated), are reused only on that stream, and return to the
// shared pools on empty_cache, flush_thread_caches, under memory pressure and at thread
// exit.
//
// Errors: allocate throws OutOfMemoryError (a std::bad_alloc) when the OOM policy could
// not find memory, AllocatorUsageError for an absurd size. deallocate/record_stream throw
// AllocatorUsageError for a pointer the allocator did not hand out, a double free or a
// wrong size, and deallocate BackendError when neither an event on a stream that used the
// block nor a device synchronization can be had; the allocator's state is unchanged in
// those cases (Note [Failed frees]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "allocator/errors.h"
#include "allocator/export.h"
#include "allocator/segment_events.h"
#include "allocator/stats.h"

namespace tidepool {

struct AllocatorOptions {
  // Grow per-stream reserved address ranges backed slot by slot (Note [Expandable
  // segments], segments.cpp) instead of one device_alloc per segment.
  bool expandable_segments = true;
  // false: never give memory back to the backend (not even on OOM or empty_cache). The
  // trace replay uses it, with move_free_runs off, as the baseline its modeled time is
  // compared with.
  bool allow_release = true;
  // Expandable segments: before creating physical memory for a block, move the backing
  // of a slot that lies wholly in free blocks elsewhere (unmap there, map here) instead
  // (Note [Moving free runs], segments.cpp). Physical memory then follows the live bytes
  // without new backend allocations (GPT-2's trace: 1.024 reserved per live byte instead
  // of 1.069); costs one unmap + one map per slot moved.
  bool move_free_runs = true;
  // Moves happen only when new backing would make reserved memory exceed the peak of
  // allocated memory by more than this fraction; below it, new physical memory is
  // created (once: it is not released unless under pressure), which saves the moves a
  // growing working set would otherwise cause. -1: move whenever a free slot exists.
  double move_slack = 0.01;
  // Once backing the best fit would need moves, place the block at whichever end of it
  // (or of a free block of the same size) is already backed, if one is: GPT-2's trace
  // then needs 76 moves instead of 176, at the same packing.
  bool backed_fit_when_moving = true;
  // Exact-size quick lists for freed small blocks (Note [Quick lists]).
  bool quick_lists = true;
  // Per-thread caches of freed small blocks (Note [Thread caches], thread_cache.cpp): at
  // most this many bytes per thread and allocator; 0 turns them off. A cached pair on
  // one stream by one thread then takes no allocator-wide mutex.
  std::size_t thread_cache_bytes = std::size_t{4} << 20;
  // Expandable segments: when backing new slots would make reserved memory exceed the
  // peak of allocated memory by more than this fraction, fully free mapping runs
  // elsewhere are released to the backend first (Note [Recycling free runs] in
  // segments.cpp). Negative (the default): never; memory is then given back only under
  // pressure (the OOM policy) and by empty_cache. Superseded by move_free_runs, which
  // packs as well without backend allocations.
  double recycle_slack = -1.0;
  // Expandable segments: among the smallest few fitting free blocks, always prefer one
  // whose bytes are already backed over the best fit that would need new backing. Fewer
  // backend calls, worse packing (GPT-2: 1.028 instead of 1.024 with moves); off.
  bool prefer_backed_fit = false;
  // Address space reserved per expandable range; 0 or more than the backend's total
  // memory: that total.
  std::size_t expandable_range_bytes = 0;
  // Expandable large-pool ranges are backed in slots of this size (rounded down to the
  // granule), one physical allocation each; small-pool ranges in single granules.
  // Larger slots mean fewer backend allocations; smaller ones waste less at the edges
  // of live data (GPT-2's trace with moves: 16 MiB 1.020 reserved per live byte and 502
  // allocations, 32 MiB 1.024 and 254, 64 MiB 1.040 and 131).
  std::size_t map_slot_bytes = std::size_t{32} << 20;
};

// Counters of the VA mapping calls the allocator made (expandable segments), kept apart
// from the backend allocations in AllocatorStats::segments: a map or an
// unmap moves existing physical memory and costs far less than cuMemCreate/cuMemRelease.
struct MappingStats {
  // Calls that succeeded. Each map backs a new or a moved run (or puts a run back where
  // it was when mapping it elsewhere failed); each unmap precedes a release or a move.
  std::uint64_t map_calls = 0;
  std::uint64_t unmap_calls = 0;
  std::uint64_t runs_moved = 0;   // free runs moved to back another block
  std::uint64_t bytes_moved = 0;
  // Stream synchronizations a move waited for (the run held blocks the allocating stream
  // had freed with no completed fence after them yet).
  std::uint64_t move_syncs = 0;
};

// One contiguous range of memory the allocator holds from the backend, cut into the
// pieces of its blocks that lie in it (CachingAllocator::backed_ranges): what PyTorch's
// memory snapshot calls a segment. An expandable range is backed in runs, so it gives one
// MemoryRange per contiguous backed part, and a free block that spans backed and unbacked
// memory appears only with its backed part.
struct MemoryRange {
  enum class State : std::uint8_t {
    allocated,     // handed out
    pending_free,  // freed, held back until other streams pass the free (record_stream)
    free,          // cached: free, or parked in a thread cache
  };
  struct Piece {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    State state = State::free;
    std::size_t requested = 0;  // allocated: bytes the caller asked for
    int tag = 0;                // allocated: its tag
  };
  std::uintptr_t address = 0;
  std::size_t size = 0;      // the pieces tile [address, address + size)
  void* stream = nullptr;    // the stream whose pool the range belongs to (null: none)
  bool small = false;        // small-block pool
  bool expandable = false;
  std::vector<Piece> pieces;
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
  // allocate without the OOM policy, for a request that is only a hint (a tiered store's
  // prefetch): from the cache, or a new segment the device has room for; else nullptr,
  // having released no cached memory, run no reclaim hook (which would evict other
  // stores' state and wait for it), waited for nothing and counted no OOM.
  void* try_allocate(std::size_t bytes, Stream stream = {});
  // ptr == nullptr is a no-op. `bytes` must be the size passed to allocate.
  void deallocate(void* ptr, std::size_t bytes, Stream stream = {});
  // Pre: ptr is live. Marks it as used by `stream` too (see Note [Stream contract]).
  void record_stream(void* ptr, Stream stream);
  // Gives fully free backed memory back to the backend (waits for the streams that last
  // used it; blocks still waiting for record_stream events are kept). Returns bytes
  // released. A no-op when options.allow_release is false. This allocator's cache only:
  // tidepool_empty_cache (c_api.h) also runs the empty-cache hooks (Note [Empty-cache
  // hooks] in reclaim.cpp says why they are not run here).
  std::size_t empty_cache();
  // Moves every block parked in any thread's cache back into the shared pools (they then
  // serve other threads, and other streams once their stream has passed the free).
  // Returns blocks moved. (Before destroying a stream, call release_stream instead.)
  std::size_t flush_thread_caches();
  // "Stream `stream` is about to be destroyed" (Note [Stream contract]). Waits for the
  // stream, moves what threads cached for it back, drops it from live blocks' recorded
  // streams, and hands every block it owns to a pool of no stream that any stream may
  // reuse at once; of that, fully free backed memory is given back to the backend (and
  // empty address ranges the stream created), unless options.allow_release is false.
  // Live blocks allocated on it stay valid (free them on a live stream). Afterwards the
  // allocator never refers to the stream again. Returns bytes given back to the backend.
  // Throws BackendError when the stream cannot be synchronized (e.g. already destroyed);
  // nothing has changed then. A stream the allocator never saw is released at once,
  // without waiting (Note [Releasing a stream tidepool never saw], stream_ordering.cpp).
  // Throws AllocatorUsageError for the default (null) stream, which is never destroyed.
  std::size_t release_stream(Stream stream);
  // The check release_stream makes before anything else, for callers that may not have an
  // allocator to call (the C ABI, on a device tidepool never allocated on).
  static void require_releasable(int device, Stream stream);

  AllocatorStats stats() const;
  // Bytes allocated and reserved now: stats().allocated.current and reserved.current
  // without the rest of stats() (no walk over the blocks), for a caller that asks on
  // every allocation (torch.profiler's memory events).
  struct BytesInUse {
    std::uint64_t allocated = 0;
    std::uint64_t reserved = 0;
  };
  BytesInUse bytes_in_use() const;
  // The largest contiguous free range of cached (backed) memory: what one allocation can
  // get without asking the backend for more.
  std::size_t largest_free_block() const;
  MappingStats mapping_stats() const;
  void reset_peak_stats();
  // JSON document: device, backend, totals, per-tag stats, segments with their blocks.
  std::string snapshot_json() const;
  // Every backed range with its pieces, in address order (see MemoryRange).
  std::vector<MemoryRange> backed_ranges() const;
  // Bytes the allocation at `ptr` was made with, or 0 when ptr is not a live allocation.
  std::size_t allocation_size(const void* ptr) const;
  // True when `ptr` is the start of a live allocation of this allocator.
  bool owns(const void* ptr) const { return allocation_size(ptr) != 0; }
  // Bytes the live allocation at `ptr` holds (its block: the request rounded up, what the
  // allocated stats count), or 0 when ptr is not a live allocation.
  std::size_t block_size(const void* ptr) const;

  // The allocator's backing changes, for an observer to drain (Note [Segment events] in
  // segment_events.h); unobserved until someone calls set_observed(true).
  SegmentEventLog& segment_events() const;

  Backend& backend() const;
  int device() const;
  const AllocatorOptions& options() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// snapshot_json() of an allocator that does not exist yet, for a device tidepool has not
// allocated on: its backend and options as the allocator would have them, zero stats, no
// segments. Reading a snapshot creates no allocator (on CUDA, no context on the device).
std::string snapshot_json_of_unused_device(int device, BackendKind kind);

}  // namespace tidepool
