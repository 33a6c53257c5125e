// SegmentEventLog: how an observer (PyTorch's memory history, optimizers/install/
// memory_history.h) learns when a caching allocator's backing changes: a plain segment
// allocated or freed, a run of an expandable range mapped or unmapped. One log per
// CachingAllocator (CachingAllocator::segment_events()); the device registry turns it on
// for every device's allocator at once (observe_segment_events, device_registry.h).
//
// Note [Segment events]
// c10's allocator traces SEGMENT_ALLOC / SEGMENT_FREE (cudaMalloc / cudaFree of a
// segment) and SEGMENT_MAP / SEGMENT_UNMAP (an expandable segment growing or shrinking)
// into the memory history under its own lock; the memory visualizer's segment timeline
// is built from them. tidepool's history has its own mutex, and takes the allocator's
// lock under it (its snapshot reads the backed ranges), so the allocator must never call
// into the history while holding its lock: that would be the reverse order. Instead the
// allocator appends each event, under its lock, to this log, a leaf with its own small
// mutex under which nothing else is taken; the history drains the log, under its own
// mutex, before it appends any entry of its own and when it takes a snapshot. Order
// therefore holds: an allocation that grew the backing has its SEGMENT_* entries drained
// by its own ALLOC entry, after them; a free's FREE_COMPLETED is appended before the
// memory goes back, so a release it enables comes later. Lock order is history, then
// allocator or log; allocator, then log; never the reverse.
// A block's free is an event too (block_freed): c10 traces FREE_COMPLETED when a block is
// free at last, which for a block other streams still use (record_stream, or freed on a
// stream other than its own) is when their work has passed it, not at the free. So the
// allocator queues it where the block becomes free: at the free (the thread cache's fast
// path included), or when the events it waited for have completed; the history turns it
// into the FREE_COMPLETED of the free it requested, in the log's order, so that a later
// ALLOC of the same block comes after it.
// Unobserved, an event costs one relaxed load. Observing starts empty; turning it off
// drops what is queued. Events name the thread that caused them, so that an observer
// that gathers a stack can give it to the events its own call caused, and to no others.
// Only the caching allocator's own backing is reported: memory the tier route serves
// (pointer-stable ranges of the tiering layer) is not the caching allocator's and never
// passes through here. Reserving or giving back an expandable range's address space is
// not an event (it backs nothing), nor is the destructor's tear-down.
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "allocator/export.h"

namespace tidepool {

struct SegmentEvent {
  enum class Kind : std::uint8_t {
    segment_allocated,  // a plain segment from Backend::device_alloc
    segment_freed,      // a plain segment given back with Backend::device_free
    mapped,             // physical memory mapped at [address, address + size)
    unmapped,           // and unmapped there (released, or moved elsewhere)
    block_freed,        // an allocated block free again: [address, address + size) is the
                        // block and its requested size (Note [Segment events])
  };
  Kind kind = Kind::segment_allocated;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  void* stream = nullptr;  // the stream whose pool the segment or range belongs to
  std::thread::id thread;  // the thread whose call caused it
};

class TIDEPOOL_API SegmentEventLog {
 public:
  bool observed() const noexcept { return observed_.load(std::memory_order_relaxed); }
  // Starts (empty) or stops (dropping what is queued) the log.
  void set_observed(bool on);
  // Queues the event if the log is observed; the caller holds the allocator's lock (or,
  // for a block the thread cache's fast path frees, that cache's lock, which draining the
  // cache needs too), so events are queued in the order the allocator made the changes.
  void record(SegmentEvent::Kind kind, const void* address, std::size_t size,
              void* stream) noexcept {
    if (observed()) push(kind, address, size, stream);
  }
  // The queued events, oldest first; the log is empty afterwards.
  std::vector<SegmentEvent> take();

 private:
  void push(SegmentEvent::Kind kind, const void* address, std::size_t size,
            void* stream) noexcept;

  std::atomic<bool> observed_{false};
  std::mutex mutex_;  // a leaf: nothing is taken under it
  std::vector<SegmentEvent> queue_;
};

}  // namespace tidepool
