// PyTorch's memory history and snapshot for tidepool as c10's CUDA allocator: what
// torch.cuda.memory._record_memory_history, _snapshot, _dump_snapshot (the memory
// visualizer's input), memory_snapshot() and the out-of-memory observers ask of c10's
// allocator, which torch's pluggable class answers with "does not yet support".
//
// What it records, as c10's own allocator does (Note [memory history] in
// memory_history.cpp): per device, a ring of trace entries (alloc, free requested, free
// completed, segment alloc / free for plain segments, segment map / unmap for the runs
// of expandable ranges, snapshot, oom) with the Python/C++ stack PyTorch's context
// recorder gathers, and for each live block the stack it was allocated under. The
// snapshot's segments are tidepool's backed ranges (CachingAllocator::backed_ranges), its
// blocks their pieces. What it leaves out: optimizer state in pointer-stable ranges (tier
// route), which moves between device and host memory and is reported by the tiering
// stats instead; the same memory torch.cuda.memory_stats() leaves out (Note [PyTorch's
// view of the stats]).
//
// Thread-safety: every member may be called from any thread. The context recorder (which
// may take Python's GIL) is never called with the history's lock held; the allocator's
// lock is taken under it (snapshot) but never the other way round, and the allocator's
// segment events reach it through a leaf queue (Note [Segment events] in
// allocator/segment_events.h). One history records at a time: two would split the
// segment events between them (the installed allocator's is the one PyTorch uses).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tidepool::optim {

class MemoryHistory {
 public:
  using CreateContextFn = c10::cuda::CUDACachingAllocator::CreateContextFn;
  using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;
  using OutOfMemoryObserver = c10::cuda::CUDACachingAllocator::OutOfMemoryObserver;

  // c10's recordHistory. Throws c10::Error for an unknown name in skip_actions (nothing
  // changes then).
  void record(bool enabled, CreateContextFn context_recorder, std::size_t max_entries,
              RecordContext when, bool clear_history, const std::vector<std::string>& skip_actions);
  MemoryHistory() = default;
  ~MemoryHistory();  // stops observing the allocators' segment events if still recording
  MemoryHistory(const MemoryHistory&) = delete;
  MemoryHistory& operator=(const MemoryHistory&) = delete;
  bool enabled() const { return recording_.load(std::memory_order_relaxed); }

  // Around tidepool's malloc and free: on_free before the memory is given back (its
  // FREE_REQUESTED), on_freed after (the FREE_COMPLETED of the blocks free by then: this
  // one, unless other streams still use it, and those whose streams have passed them).
  // Cheap while nothing is recorded and no block has a recorded stack.
  void on_alloc(void* ptr, std::size_t size, int device, void* stream);
  void on_free(void* ptr, std::size_t size, int device, void* stream);
  void on_freed(int device);
  // A request of `size` bytes on `device` failed for want of memory: an OOM entry and
  // the attached observers.
  void on_out_of_memory(int device, std::size_t size);
  void attach_out_of_memory_observer(OutOfMemoryObserver observer);
  // After tidepool gave cached memory back (c10's emptyCache): the releases' segment
  // entries, with this call's stack when `when` is ALL.
  void on_empty_cache();

  // c10's snapshot: every device's backed ranges, and the traces when asked.
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool,
                                                        bool include_traces);

 private:
  using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;
  struct Ring {
    std::vector<TraceEntry> entries;
    std::size_t next = 0;  // where the next entry goes once the ring is full
  };
  std::shared_ptr<c10::GatheredContext> gather(RecordContext level) const;
  // Pre: mutex_ held.
  void append(TraceEntry::Action action, int device, std::size_t addr, std::size_t size,
              void* stream, std::shared_ptr<c10::GatheredContext> context);
  bool tracked(const void* ptr, int device) const;
  // The device allocator's queued segment events as trace entries; `stack`: the calling
  // history call's, for the events this thread caused (when `when` is ALL). Pre: mutex_
  // held, recording.
  void drain_segment_events(int device, const std::shared_ptr<c10::GatheredContext>& stack);
  void drain_all_segment_events(const std::shared_ptr<c10::GatheredContext>& stack);

  mutable std::mutex mutex_;
  std::atomic<bool> recording_{false};
  // recording_, or some live block still has its allocation stack: frees must look.
  std::atomic<bool> watching_frees_{false};
  std::atomic<CreateContextFn> recorder_{nullptr};
  std::atomic<RecordContext> when_{RecordContext::NEVER};
  std::size_t max_entries_ = 1;
  bool observing_segments_ = false;  // this history counts as one segment-event observer
  std::vector<bool> skipped_;  // by TraceEntry::Action
  std::map<int, Ring> traces_;
  std::map<std::uintptr_t, std::shared_ptr<c10::GatheredContext>> allocated_under_;
  // Blocks whose FREE_REQUESTED is traced and FREE_COMPLETED not yet, by device and
  // address, with the stack and stream the latter carries (Note [memory history]): the
  // free's stream, which a block held for other streams may have lost by then (its
  // stream released). An ALLOC of the address drops an entry a failed free left.
  struct FreeRequested {
    std::shared_ptr<c10::GatheredContext> context;
    void* stream = nullptr;
  };
  std::map<std::pair<int, std::uintptr_t>, FreeRequested> freeing_;
  std::vector<OutOfMemoryObserver> oom_observers_;
};

}  // namespace tidepool::optim
