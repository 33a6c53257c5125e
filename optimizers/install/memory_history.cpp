// MemoryHistory: c10's memory history and snapshot over tidepool (see memory_history.h).
//
// Note [memory history]
// torch.cuda.memory._record_memory_history(enabled, context, stacks, max_entries) becomes
// recordHistory(enabled, context_recorder, max_entries, when, clear, skip_actions) on
// c10's allocator. What this does with it follows c10's own CUDACachingAllocator, so the
// memory visualizer reads tidepool's snapshot as it reads PyTorch's:
//   - While enabled, every malloc and free of the caching allocator's memory appends to
//     the device's ring of at most max_entries trace entries: ALLOC; FREE_REQUESTED at the
//     free, and FREE_COMPLETED when the block is free at last: at once, or, for a block
//     other streams still use (record_stream), once their work has passed it, as c10
//     does (the allocator queues that moment: Note [Segment events] in
//     allocator/segment_events.h); SNAPSHOT at each snapshot; OOM (addr = the device's
//     free bytes) when a request fails.
//   - Backing changes become SEGMENT_ALLOC / SEGMENT_FREE (a plain segment) and
//     SEGMENT_MAP / SEGMENT_UNMAP (a run of an expandable range mapped, or unmapped when
//     released or moved), with address, size, stream and device as c10 sets them. The
//     allocator queues them (Note [Segment events] in allocator/segment_events.h) and
//     the history drains the device's queue before each entry it appends and at each
//     snapshot, so the SEGMENT_MAP an allocation needed precedes its ALLOC, and the
//     SEGMENT_UNMAP a release made follows the FREE_COMPLETED of the blocks it held.
//     c10 records them with the allocation's stack, or with the releasing call's when
//     `when` is ALL; here they carry a stack only when `when` is ALL: the stack of the
//     call that drains them (an allocation, an out-of-memory, an emptyCache) if it ran
//     on the thread that caused them, else none (a free's own stack is gathered before
//     the memory goes back, and a release comes later).
//   - `when` says which stacks are gathered: STATE the allocating stack of each live
//     block (shown in the snapshot), ALLOC also on alloc entries, ALL also on frees (a
//     free entry without its own stack carries the block's allocating one).
//   - Disabling stops recording and drops the entries, as clear does (c10: a history
//     turned off and on again must not join two runs across a gap nothing was traced
//     in); live blocks keep their stacks until they are freed. A new max_entries keeps
//     the newest entries.
//   - Times are microseconds since the epoch (c10 keeps approximate clock ticks and
//     converts them when it takes a snapshot; the snapshot reads the converted field).
// Memory tidepool routes to pointer-stable ranges (optimizer state, the tier route) is
// neither traced nor in the segments: it is not the caching allocator's, and it moves
// between device and host memory.
#include "optimizers/install/memory_history.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>
#include <utility>

#include "allocator/device_registry.h"

namespace tidepool::optim {
namespace {

using c10::CachingDeviceAllocator::TraceEntry;
using c10::cuda::CUDACachingAllocator::RecordContext;
using c10::cuda::CUDACachingAllocator::SnapshotInfo;

constexpr std::size_t kActions = static_cast<std::size_t>(TraceEntry::Action::OOM) + 1;

std::size_t action_index(TraceEntry::Action action) { return static_cast<std::size_t>(action); }

time_t now_us() {
  return static_cast<time_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count());
}

TraceEntry::Action trace_action(SegmentEvent::Kind kind) {
  switch (kind) {
    case SegmentEvent::Kind::segment_allocated: return TraceEntry::SEGMENT_ALLOC;
    case SegmentEvent::Kind::segment_freed: return TraceEntry::SEGMENT_FREE;
    case SegmentEvent::Kind::mapped: return TraceEntry::SEGMENT_MAP;
    case SegmentEvent::Kind::unmapped: return TraceEntry::SEGMENT_UNMAP;
    case SegmentEvent::Kind::block_freed: return TraceEntry::FREE_COMPLETED;
  }
  return TraceEntry::SEGMENT_MAP;  // unreachable: every kind is listed
}

// The ring's entries, oldest first.
std::vector<TraceEntry> in_order(const std::vector<TraceEntry>& entries, std::size_t next) {
  std::vector<TraceEntry> out;
  out.reserve(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i)
    out.push_back(entries[(next + i) % entries.size()]);
  return out;
}

}  // namespace

void MemoryHistory::record(bool enabled, CreateContextFn context_recorder, std::size_t max_entries,
                           RecordContext when, bool clear_history,
                           const std::vector<std::string>& skip_actions) {
  std::vector<bool> skipped(kActions, false);
  for (const std::string& name : skip_actions)  // throws on an unknown name: nothing changed
    skipped[action_index(c10::CachingDeviceAllocator::parseTraceEntryAction(name))] = true;
  std::lock_guard lock(mutex_);
  // What the allocators queued belongs to the history as it was: into it (and cleared
  // with it), before the settings change.
  if (recording_.load()) drain_all_segment_events(nullptr);
  skipped_ = std::move(skipped);
  max_entries_ = std::max<std::size_t>(1, max_entries);
  if (!enabled || clear_history) traces_.clear();
  if (!enabled) freeing_.clear();  // a history turned on again traces no older free
  // Oldest first again, so that a ring that grows appends after its newest entry, and
  // one that shrinks keeps its newest.
  for (auto& [device, ring] : traces_) {
    std::rotate(ring.entries.begin(), ring.entries.begin() + static_cast<std::ptrdiff_t>(ring.next),
                ring.entries.end());
    ring.next = 0;
    if (ring.entries.size() > max_entries_)
      ring.entries.erase(ring.entries.begin(),
                         ring.entries.end() - static_cast<std::ptrdiff_t>(max_entries_));
  }
  recorder_.store(enabled ? context_recorder : nullptr);
  when_.store(enabled ? when : RecordContext::NEVER);
  recording_.store(enabled);
  watching_frees_.store(enabled || !allocated_under_.empty());
  if (observing_segments_ != enabled) {
    observe_segment_events(enabled);
    observing_segments_ = enabled;
  }
}

MemoryHistory::~MemoryHistory() {
  if (observing_segments_) observe_segment_events(false);
}

std::shared_ptr<c10::GatheredContext> MemoryHistory::gather(RecordContext level) const {
  if (when_.load() < level) return nullptr;
  const CreateContextFn recorder = recorder_.load();
  return recorder != nullptr ? recorder() : nullptr;
}

void MemoryHistory::append(TraceEntry::Action action, int device, std::size_t addr,
                           std::size_t size, void* stream,
                           std::shared_ptr<c10::GatheredContext> context) {
  if (skipped_.size() == kActions && skipped_[action_index(action)]) return;
  TraceEntry entry(action, static_cast<c10::DeviceIndex>(device), addr, size, stream,
                   c10::cuda::MempoolId_t{0, 0}, 0,
                   when_.load() >= RecordContext::ALLOC ? std::move(context) : nullptr);
  entry.time_.t_ = now_us();
  Ring& ring = traces_[device];
  if (ring.entries.size() < max_entries_) {
    ring.entries.push_back(std::move(entry));
  } else {
    ring.entries[ring.next] = std::move(entry);
    ring.next = (ring.next + 1) % ring.entries.size();
  }
}

void MemoryHistory::drain_segment_events(int device,
                                         const std::shared_ptr<c10::GatheredContext>& stack) {
  CachingAllocator* allocator = existing_device_allocator(device);
  if (allocator == nullptr) return;
  const bool with_stack = stack != nullptr && when_.load() == RecordContext::ALL;
  const std::thread::id self = std::this_thread::get_id();
  for (const SegmentEvent& e : allocator->segment_events().take()) {
    if (e.kind == SegmentEvent::Kind::block_freed) {
      // The FREE_COMPLETED of a traced FREE_REQUESTED, with its stack; a free the history
      // did not see requested (tidepool's C ABI, or before recording began) has none.
      auto it = freeing_.find({device, e.address});
      if (it == freeing_.end()) continue;
      FreeRequested requested = std::move(it->second);
      freeing_.erase(it);
      append(TraceEntry::FREE_COMPLETED, device, e.address, e.size, requested.stream,
             std::move(requested.context));
      continue;
    }
    append(trace_action(e.kind), device, e.address, e.size, e.stream,
           with_stack && e.thread == self ? stack : nullptr);
  }
}

void MemoryHistory::drain_all_segment_events(const std::shared_ptr<c10::GatheredContext>& stack) {
  for (int device = 0; device < kMaxDevices; ++device) drain_segment_events(device, stack);
}

bool MemoryHistory::tracked(const void* ptr, int device) const {
  const CachingAllocator* allocator = existing_device_allocator(device);
  return allocator != nullptr && allocator->owns(ptr);
}

void MemoryHistory::on_alloc(void* ptr, std::size_t size, int device, void* stream) {
  if (!recording_.load(std::memory_order_relaxed) || !tracked(ptr, device)) return;
  std::shared_ptr<c10::GatheredContext> context = gather(RecordContext::STATE);
  std::lock_guard lock(mutex_);
  if (!recording_.load()) return;  // disabled meanwhile
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  if (context != nullptr) {
    allocated_under_[address] = context;
    watching_frees_.store(true);
  }
  drain_segment_events(device, context);  // the growth this allocation needed comes first
  // Every free of this address that completed is drained by now: an entry left is a free
  // that failed, and must not give a later free's event its stack.
  freeing_.erase({device, address});
  append(TraceEntry::ALLOC, device, address, size, stream, std::move(context));
}

void MemoryHistory::on_free(void* ptr, std::size_t size, int device, void* stream) {
  if (!watching_frees_.load(std::memory_order_relaxed)) return;
  const bool recording = recording_.load();
  if (recording && !tracked(ptr, device)) return;
  std::shared_ptr<c10::GatheredContext> context = recording ? gather(RecordContext::ALL) : nullptr;
  std::lock_guard lock(mutex_);
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  std::shared_ptr<c10::GatheredContext> allocated_under;
  if (auto it = allocated_under_.find(address); it != allocated_under_.end()) {
    allocated_under = std::move(it->second);
    allocated_under_.erase(it);
  }
  if (recording_.load()) {
    if (context == nullptr) context = std::move(allocated_under);
    drain_segment_events(device, nullptr);  // earlier changes: not this free's doing
    append(TraceEntry::FREE_REQUESTED, device, address, size, stream, context);
    freeing_[{device, address}] = {std::move(context), stream};  // FREE_COMPLETED: on_freed
  }
  watching_frees_.store(recording_.load() || !allocated_under_.empty());
}

void MemoryHistory::on_freed(int device) {
  if (!recording_.load(std::memory_order_relaxed)) return;
  std::lock_guard lock(mutex_);
  if (recording_.load()) drain_segment_events(device, nullptr);
}

void MemoryHistory::on_out_of_memory(int device, std::size_t size) {
  std::size_t total = 0, free = 0;
  if (const CachingAllocator* allocator = existing_device_allocator(device)) {
    try {
      const MemInfo info = allocator->backend().mem_info();
      free = info.free_bytes;
      // As c10 reports it: the process's share when a memory fraction caps it.
      total = std::min(info.total_bytes, allocator->backend().device_limit());
    } catch (...) {
      // No figures: the observers get zeros rather than no call.
    }
  }
  std::shared_ptr<c10::GatheredContext> context =
      recording_.load() ? gather(RecordContext::STATE) : nullptr;
  std::vector<OutOfMemoryObserver> observers;
  {
    std::lock_guard lock(mutex_);
    if (recording_.load()) {
      drain_segment_events(device, context);  // what the failed request released first
      append(TraceEntry::OOM, device, free, size, nullptr, std::move(context));
    }
    observers = oom_observers_;
  }
  for (const OutOfMemoryObserver& observer : observers) observer(device, size, total, free);
}

void MemoryHistory::on_empty_cache() {
  if (!recording_.load(std::memory_order_relaxed)) return;
  const std::shared_ptr<c10::GatheredContext> stack = gather(RecordContext::ALL);
  std::lock_guard lock(mutex_);
  if (recording_.load()) drain_all_segment_events(stack);
}

void MemoryHistory::attach_out_of_memory_observer(OutOfMemoryObserver observer) {
  std::lock_guard lock(mutex_);
  oom_observers_.push_back(std::move(observer));
}

SnapshotInfo MemoryHistory::snapshot(c10::cuda::MempoolId_t mempool, bool include_traces) {
  SnapshotInfo info;
  // Global mode has no memory pools (torch_cuda_allocator.h): a pool's snapshot is empty.
  const bool all_memory = mempool.first == 0 && mempool.second == 0;
  // The ranges are read under the history's lock (order: history, then allocator, as
  // nowhere the reverse), so a block's stack is the one its allocation recorded.
  std::lock_guard lock(mutex_);
  if (recording_.load()) drain_all_segment_events(nullptr);  // the trace up to this point
  std::vector<std::pair<int, std::vector<MemoryRange>>> devices;
  for (int device = 0; device < kMaxDevices; ++device)
    if (const CachingAllocator* allocator = existing_device_allocator(device))
      devices.emplace_back(device,
                           all_memory ? allocator->backed_ranges() : std::vector<MemoryRange>{});
  for (const auto& [device, ranges] : devices) {
    std::size_t active = 0;
    for (const MemoryRange& range : ranges) {
      c10::CachingDeviceAllocator::SegmentInfo segment;
      segment.device = static_cast<c10::DeviceIndex>(device);
      segment.address = range.address;
      segment.total_size = range.size;
      segment.stream = range.stream;
      segment.is_large = !range.small;
      segment.is_expandable = range.expandable;
      for (const MemoryRange::Piece& piece : range.pieces) {
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = piece.size;
        block.allocated = piece.state == MemoryRange::State::allocated;
        block.active = piece.state != MemoryRange::State::free;
        if (block.allocated) {
          block.requested_size = piece.requested;
          segment.allocated_size += piece.size;
          segment.requested_size += piece.requested;
          if (auto it = allocated_under_.find(piece.address); it != allocated_under_.end())
            block.context_when_allocated = it->second;
        }
        if (block.active) segment.active_size += piece.size;
        segment.blocks.push_back(std::move(block));
      }
      active += segment.active_size;
      info.segments.push_back(std::move(segment));
    }
    if (recording_.load()) append(TraceEntry::SNAPSHOT, device, 0, active, nullptr, nullptr);
  }
  if (include_traces) {
    // Indexed by device: as many as the highest device with memory or entries.
    int devices_seen = 0;
    for (const auto& [device, ranges] : devices) devices_seen = std::max(devices_seen, device + 1);
    for (const auto& [device, ring] : traces_) devices_seen = std::max(devices_seen, device + 1);
    info.device_traces.resize(static_cast<std::size_t>(devices_seen));
    for (const auto& [device, ring] : traces_)
      info.device_traces[static_cast<std::size_t>(device)] = in_order(ring.entries, ring.next);
  }
  auto& config = info.config_metadata;
  config.garbage_collection_threshold = 0.0;
  config.max_split_size = std::numeric_limits<std::size_t>::max();
  config.pinned_num_register_threads = 1;
  config.expandable_segments = true;  // tidepool backs each stream's range in 2 MiB granules
  config.release_lock_on_malloc = false;
  config.pinned_use_host_register = false;
  config.graph_capture_record_stream_reuse = false;
  config.last_allocator_settings = "backend:tidepool";
  return info;
}

}  // namespace tidepool::optim
