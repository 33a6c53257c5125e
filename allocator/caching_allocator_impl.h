// The state behind CachingAllocator, shared by the files that implement it:
//   caching_allocator.cpp  the algorithm; allocation, free lists, OOM policy
//   frees.cpp              deallocate, record_stream's events, pending blocks, empty_cache
//   stream_ordering.cpp    fences, cross-stream reuse, record_stream, release_stream
//   segments.cpp           getting memory from the backend and giving it back
//   snapshot.cpp           stats and queries, the OOM message and the JSON snapshot
//   thread_cache.cpp       per-thread caches of freed small blocks (Note [Thread caches])
// Internal to the allocator (not installed). Every member is guarded by `mutex`.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator/block.h"
#include "allocator/block_pool.h"
#include "allocator/caching_allocator.h"

namespace tidepool {
namespace detail {
struct ThreadCache;
class SpinLock;

// Cached memory counted by walking the segments (Note [Cached memory by tag]).
struct CacheCensus {
  std::size_t largest = 0;  // largest free contiguous backed range, any tag
  std::array<std::uint64_t, kTagCount> cached{};   // bytes, by the tag they are kept under
  std::array<std::uint64_t, kTagCount> largest_by_tag{};
};
}  // namespace detail

// Hidden although CachingAllocator is exported: nothing outside libtidepool.so uses it, and
// a member of an exported class would be called through the PLT even from inside the
// library, and could not be inlined (perf: the thread-cache lookup on every call).
struct __attribute__((visibility("hidden"))) CachingAllocator::Impl {
  using Block = detail::Block;
  using Segment = detail::Segment;
  using StreamPools = detail::StreamPools;

  Impl(std::unique_ptr<Backend> b, AllocatorOptions o);

  std::unique_ptr<Backend> backend;
  AllocatorOptions options;
  int device = 0;
  std::size_t granule = 0;       // backend granularity (2 MiB)
  std::size_t range_bytes = 0;   // address space per expandable range
  std::size_t device_total = 0;  // backend's total memory: no request above it can succeed
  mutable std::mutex mutex;

  std::unordered_map<const void*, Block*> blocks;  // every block, by start address
  std::map<const char*, Segment*> segments;         // every segment, by base address
  std::vector<std::unique_ptr<StreamPools>> streams;
  // Note [Released streams] (stream_ordering.cpp): the blocks of streams given up with
  // release_stream, free and live. It has no stream of its own (its `stream` is never
  // used): its free blocks are safe for every stream at once (safe_seq is the maximum),
  // it is in no `streams` entry, so pools_for never returns it and no fence is ever
  // recorded for it. Created with the allocator and never replaced.
  const std::unique_ptr<StreamPools> released;
  StreamPools* last_stream = nullptr;  // one-entry cache for pools_for
  std::vector<Block*> pending;         // blocks waiting for record_stream events
  std::vector<Block*> spare_blocks;    // recycled Block objects
  std::vector<Event> spare_events;
  AllocatorStats stats;
  // Blocks that became free in a pool (insert_free of a new free): a pending block whose
  // events completed, a quick list or thread cache flushed, a plain free. Not
  // allocations.freed, which counts the deallocate calls: a block freed then may reach its
  // pool only later (review finding: the markers below then kept moves and recycling off
  // while memory they could use was free, and reserved memory grew).
  std::uint64_t free_epoch = 0;
  // free_epoch at the last recycling scan that found nothing to release: until another
  // block becomes free, scanning again is pointless. Not set when the scan passed over
  // runs only because their streams were not known to be done with them yet
  // (release_skipped_unsettled): a fence may complete without a new free.
  std::uint64_t futile_recycle_at = UINT64_MAX;
  bool release_skipped_unsettled = false;  // the last release_cached without waiting did
  // Counts the frees after which a whole mapping slot may lie in free memory: the block,
  // merged with its free neighbours, is as long as the segment's shortest slot, or ends
  // the segment (past used_end is free), or has a free neighbour of another stream (the
  // two do not merge). Any other free leaves every slot as it was, backed under some live
  // block, so a search for movable slots would find what the last one found.
  std::uint64_t movable_epoch = 0;
  // movable_epoch at the last search for movable free runs that found none, and the slot
  // length (granules) it looked for: the small ranges' free granules never back a large
  // range's slot, so a search for one length says nothing of another.
  std::uint64_t futile_move_at = UINT64_MAX;
  std::size_t futile_move_granules = 0;
  // Set (under `mutex`) while a try_allocate runs, which waits for nothing: no move that
  // would synchronize with the allocating stream, no recycling (whose releases may).
  bool waits_forbidden = false;
  // Note [Unreleased handles] (segments.cpp): physical memory unmapped from every range
  // whose release failed, with its bytes; released by the next release_cached or at the
  // end. Backs nothing, so counted in no stat.
  std::vector<std::pair<PhysicalHandle, std::size_t>> unreleased;
  // The first error of the last release_cached that could not give something back (a
  // handle kept in `unreleased`, a segment the backend would not free); null when all
  // went. empty_cache reports it; the OOM policy goes on to its retry.
  std::exception_ptr release_error;
  // Whether a free already said it synchronized the device (Note [Free after a lost
  // stream]): once per allocator.
  bool warned_free_sync = false;
  MappingStats mapping;
  // Note [Segment events] (segment_events.h): backing changes for an observer. Recorded
  // under `mutex`; the log's own mutex is a leaf.
  SegmentEventLog segment_log;
  // Note [Thread caches] (thread_cache.cpp): the caches of every thread that allocated
  // here, and the id they find this allocator by (addresses are reused, ids are not).
  const std::uint64_t id;
  std::vector<std::shared_ptr<detail::ThreadCache>> thread_caches;

  // --- caching_allocator.cpp ----------------------------------------------------------
  StreamPools& pools_for(Stream s);
  Block* new_block();
  void recycle(Block* b);
  Event take_event();
  // Events done with, back to the spares; with no heap to keep them there, destroyed
  // instead (a backend error then leaves them to the driver's teardown). Never throws:
  // frees, stream releases and the destructor give events back after changing state.
  void give_back_events(std::span<const Event> events) noexcept;
  // `tag`: the request's, given to memory new from the backend (Note [Cached memory by
  // tag], snapshot.cpp).
  Block* try_allocate(StreamPools& sp, std::size_t size, bool small, int tag);
  Block* try_allocate_releasing(StreamPools& sp, std::size_t size, bool small, int tag);
  // Whether a block of `size` bytes can never be backed: it is larger than the device or
  // than the process's share of it (Backend::set_device_limit).
  bool never_fits(std::size_t size) const;
  // Under `mutex`: `bytes` (rounded to `size`) from the stream's quick list, its cache or a
  // new segment; when `releasing`, the cached memory is freed first if nothing fits
  // (try_allocate_releasing). nullptr when none.
  void* allocate_locked(std::size_t bytes, std::size_t size, bool small, int tag,
                        detail::ThreadCache* tc, Stream stream, bool releasing);
  Block* choose_fit(detail::BlockPool& pool, std::size_t size, bool& at_end) const;
  Block* carve_tail(Block* b, std::size_t tail);
  void split(Block* b, std::size_t size);
  void insert_free(Block* b, bool is_new_free);
  void merge_into(Block* front, Block* back);
  void flush_quick(StreamPools& sp);
  void flush_all_quick();
  void* finish_allocation(Block* b, std::size_t bytes, int tag);

  // --- stream_ordering.cpp ------------------------------------------------------------
  Block* steal(StreamPools& sp, std::size_t size, bool small);
  // Waits for the other streams with a free block that would serve `size` but was freed
  // after their last fence passed (Note [Waiting for a stream before giving up]); true if
  // it waited for any.
  bool settle_streams_with_room(StreamPools& sp, std::size_t size, bool small);
  void refresh_fence(StreamPools& sp);
  // release_stream's work (Note [Released streams]); lock and every cache mutex held.
  std::size_t release_stream_locked(Stream s);
  // Whether the allocator keeps anything under s's handle (release_stream_locked).
  bool keeps_something_of(Stream s) const;
  // Moves every block of sp (free, pending or live) to `released`; sp then holds nothing.
  void retire_pools(StreamPools& sp);

  // --- frees.cpp ----------------------------------------------------------------------
  // One event recorded on each stream that used b besides its owner (its record_stream
  // streams, and `freeing` if `foreign`). If recording fails, none: the device was
  // synchronized instead (Note [Free after a lost stream]); if that fails too, a
  // BackendError that says the block is still allocated (Note [Failed frees]).
  std::vector<Event> record_free_events(const Block& b, Stream freeing, bool foreign);
  // record_free_events' fallback: device_synchronize, counted and said once.
  void synchronize_instead_of_events(const Block& b, const BackendError& record_error);
  void process_pending(bool wait);
  std::string describe_bad_free(const void* ptr, std::size_t bytes) const;
  std::string describe_wrong_size(const void* ptr, std::size_t bytes, std::size_t requested) const;
  std::string describe_double_free(const void* ptr, std::size_t bytes) const;

  // --- thread_cache.cpp ---------------------------------------------------------------
  // The calling thread's cache for this allocator, or null; takes no lock.
  detail::ThreadCache* find_thread_cache() const;
  // The calling thread's cache, created and registered on first use; null once the
  // thread is exiting (its thread_local state is gone). Lock held.
  detail::ThreadCache* thread_cache();
  // Every cached block of every thread back into the pools; returns blocks moved. Lock
  // held; takes each cache's mutex.
  std::size_t drain_thread_caches();
  // Every cache's mutex, in registry order (readers of held blocks' fields and of the
  // deltas take them all; the lock is held).
  std::vector<std::unique_lock<detail::SpinLock>> lock_thread_caches() const;
  // Every thread's statistics deltas into `stats`. Lock and every cache's mutex held.
  void fold_locked_thread_caches();
  // A cache's cached blocks into the pools (both mutexes held).
  std::size_t drain_thread_cache(detail::ThreadCache& tc);
  // Ends tc's responsibility for held block b (both mutexes held); b stays as it is.
  static void release_held(detail::ThreadCache& tc, Block* b);
  // finish_allocation for the shared path. With thread caches, under this thread's cache
  // mutex: its deltas are folded first (so the shared peak sees its current bytes), and
  // a small block becomes held by the cache, so its free can take the fast path. `tc`:
  // this thread's cache if the caller looked it up (null: looked up or created here).
  void* finish_shared_allocation(Block* b, std::size_t bytes, int tag, detail::ThreadCache* tc);
  // Thread exit: folds, drains and unregisters tc (lifecycle mutex and lock held).
  void release_thread_cache(detail::ThreadCache& tc);
  // Destructor: cuts every cache loose; takes the lifecycle mutex and the lock.
  void detach_thread_caches();
  // A fresh allocator id.
  static std::uint64_t next_id();

  // --- segments.cpp ---------------------------------------------------------------------
  // A free block of at least `size` bytes in sp's pool, from new backend memory (plain) or
  // the tail of sp's expandable range; null when the backend is out of memory.
  Block* grow(StreamPools& sp, std::size_t size, bool small, int tag);
  Segment* create_segment(StreamPools& sp, std::size_t bytes, bool small, bool expandable);
  // Maps any unbacked granule under `b` (expandable segments); false when out of memory.
  // When it fails (false or a throw), the runs it created are given back (Note [Failed
  // backing]).
  bool ensure_backed(Block* b);
  // Whether an expandable range has backed memory past its last block (the granule at
  // used_end is mapped); false for plain segments, which have none.
  bool backed_past_used_end(const Segment* seg) const {
    if (!seg->expandable) return false;
    const auto g = static_cast<std::size_t>(seg->used_end - seg->base) / granule;
    return g < seg->run_head.size() && seg->run_head[g] >= 0;
  }
  // ensure_backed's work on granules [first, end) of b's segment; appends the head of
  // every run it creates to `created` (room made before the first).
  bool back_block(Block* b, std::size_t first, std::size_t end,
                  std::vector<std::size_t>& created);
  // Unmaps and releases the runs at `heads`, which nothing has used; failures leave a run
  // mapped and cached or its handle in `unreleased`.
  void give_back_runs(Segment* seg, const std::vector<std::size_t>& heads) noexcept;
  // Unmaps the run at granule `head` of seg and releases its handle (Note [Unreleased
  // handles]); reserved memory and segments drop by it. Returns its bytes.
  std::size_t release_run(Segment* seg, std::size_t head);
  // A mapping run lying wholly in free blocks, which can be moved (Note [Moving free
  // runs]). `needs_sync`: it holds blocks the allocating stream freed that no completed
  // fence covers yet, so that stream must be synchronized before the run is unmapped.
  struct FreeRun {
    Segment* segment;
    std::size_t head;
    std::size_t granules;
    bool needs_sync;
  };
  // Every free run that may move now into a slot of `granules`: one run backing a whole
  // slot of that length (a handle maps whole). `unsettled`: set when such runs were
  // skipped because another stream may still use them (a later search may find them
  // settled).
  std::vector<FreeRun> find_free_runs(StreamPools& allocating, std::size_t granules,
                                      bool& unsettled);
  // Whether backing [ptr, ptr+size) of seg would take reserved memory past the point
  // where moves start (Note [Moving free runs]).
  bool backing_needs_moves(const Segment* seg, const char* ptr, std::size_t size) const;
  // (1 + slack) x the peak of allocated memory, counting a block of `size` bytes about to
  // be allocated: the reserved bytes above which moves (move_slack) or releases
  // (recycle_slack) start.
  std::uint64_t reserved_budget(std::size_t size, double slack) const;
  // Backs the unmapped slot at granule `head` of seg (`granules` long) with a run of the
  // same length taken from `movable`; false when none has that length.
  bool move_free_run(Segment* seg, std::size_t head, std::size_t granules,
                     std::vector<FreeRun>& movable, StreamPools& allocating);
  // Granules of the slot starting at granule `head` (the last slot of a range may be short).
  static std::size_t slot_length(const Segment* seg, std::size_t head) {
    return std::min<std::size_t>(seg->slot_granules, seg->run_head.size() - head);
  }
  // Granules in the shortest slot of an expandable segment: its last, when the range is
  // not a whole number of slots.
  static std::size_t shortest_slot(const Segment* seg) {
    const std::size_t rest = seg->run_head.size() % seg->slot_granules;
    return rest != 0 ? rest : seg->slot_granules;
  }
  // create_physical + map of granules [head, head+granules) of seg; false when out of memory.
  bool create_run(Segment* seg, std::size_t head, std::size_t granules);
  // Whether the device, within the process's memory-fraction limit, has room to back a
  // whole slot of `bytes` (Note [Expandable segments]).
  bool whole_slot_affordable(std::size_t bytes);
  // Backend::map / unmap of one run plus its bookkeeping (run tables, mapped_bytes,
  // mapping counters); reserved bytes are the caller's business.
  void map_run(Segment* seg, std::size_t head, std::size_t granules, PhysicalHandle h);
  PhysicalHandle unmap_run(Segment* seg, std::size_t head);
  // Bytes that backing [lo, hi) of an expandable segment would add: its unmapped slots.
  std::size_t unbacked_bytes(const Segment* seg, const char* lo, const char* hi) const;
  // Gives fully free backed memory back (plain segments, mapping runs), stopping once at
  // least `want` bytes are found. A release the backend refuses does not stop the others
  // (its error goes to release_error; Note [Unreleased handles]). `wait`: synchronize the
  // streams that last used it; otherwise take only memory whose frees a completed fence
  // covers, or that `waitable` (the allocating stream, then synchronized) freed. Lock held.
  // `only_owner`: release only memory whose blocks all belong to that pool (release_stream
  // passes `released`).
  std::size_t release_cached(std::size_t want = SIZE_MAX, bool wait = true,
                             StreamPools* waitable = nullptr,
                             const StreamPools* only_owner = nullptr);
  // release_physical of an unmapped handle; on failure the handle goes to `unreleased`
  // (room reserved by the caller) and the error is rethrown.
  void release_unmapped(PhysicalHandle h, std::size_t bytes);
  // Tries to release every handle in `unreleased`; one that fails stays listed, and the
  // first failure goes to release_error.
  void retry_unreleased() noexcept;
  // Gives back the address space of expandable ranges of released streams that hold
  // nothing any more (no backing, every block free in `released`). Returns ranges dropped.
  std::size_t drop_empty_released_ranges();
  void destroy_everything();
  // The stream a segment's memory belongs to, as snapshots and segment events name it:
  // its creator's, or none once a released stream's pool holds it.
  void* segment_stream(const Segment* seg) const {
    return seg->creator == released.get() ? nullptr : seg->creator->stream.handle;
  }

  // --- snapshot.cpp ---------------------------------------------------------------------
  // All three read held blocks: the lock and every thread cache's mutex must be held.
  AllocatorStats compute_stats() const;
  // Cached memory, per tag and in total (Note [Cached memory by tag]).
  detail::CacheCensus cache_census() const;
  std::size_t largest_free_backed() const { return cache_census().largest; }
  std::string oom_message(std::size_t bytes, std::size_t rounded, Stream s,
                          std::size_t reclaim_calls, std::size_t reclaimed) const;
  std::string snapshot_json() const;
  std::vector<MemoryRange> backed_ranges() const;
};

}  // namespace tidepool
