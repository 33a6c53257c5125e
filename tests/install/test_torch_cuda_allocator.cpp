// tidepool as c10's CUDA allocator (optimizers/install/torch_cuda_allocator.h), without a
// GPU: the hooks the plain pluggable allocator raises for or drops answer from tidepool
// (here over the host backend), both on the allocator object and through c10's own entry
// points once it is installed; installing twice is harmless; Tensor::record_stream's path
// through c10 holds the memory until the named stream passes it; the installed allocator
// outlives the process's static destructors; a trace tracker (NCCL buffer registration) is
// refused. The same paths with CUDA memory and streams
// are in gpu_test_torch_install.cpp.
#include <gtest/gtest.h>

#if TIDEPOOL_HAVE_TORCH_CUDA
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/util/Exception.h>
#include <spawn.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "optimizers/install/torch_cuda_allocator.h"
#include "tests/support/child_process.h"
#include "tests/support/held_allocator_lock.h"
#include "tests/support/stream_gate.h"

extern char** environ;

namespace tidepool::optim {
namespace {

class TorchCudaAllocatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(tidepool_set_backend("host"), 0) << tidepool_last_error();
  }

  static tidepool_stats_v1 stats() {
    tidepool_stats_v1 s{};
    s.struct_size = sizeof s;
    EXPECT_EQ(tidepool_get_stats_v1(0, &s), 0) << tidepool_last_error();
    return s;
  }
  // A freed 8 MiB block: cached memory, and a peak above the current allocation.
  static void cache_a_block() {
    constexpr std::size_t kBlock = std::size_t{8} << 20;
    void* p = tidepool_malloc(kBlock, 0, nullptr);
    ASSERT_NE(p, nullptr) << tidepool_last_error();
    tidepool_free(p, kBlock, 0, nullptr);
  }
  static std::size_t tidepool_cache_info_of(int device) {
    std::size_t largest = 0;
    EXPECT_EQ(tidepool_cache_info(device, &largest), 0) << tidepool_last_error();
    return largest;
  }
};

TEST_F(TorchCudaAllocatorTest, CacheInfoAnswersWhatTidepoolAnswers) {
  cache_a_block();
  const auto allocator = make_torch_cuda_allocator();
  std::size_t largest = 0;
  allocator->cacheInfo(0, &largest);
  EXPECT_GE(largest, std::size_t{8} << 20);
  EXPECT_EQ(largest, tidepool_cache_info_of(0));
  // A device that does not exist is c10's error, with tidepool's message.
  ::testing::internal::CaptureStderr();
  try {
    allocator->cacheInfo(99, &largest);
    ADD_FAILURE() << "cacheInfo of device 99 did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("device 99 does not exist"), std::string::npos)
        << e.what();
  }
  ::testing::internal::GetCapturedStderr();
}

// NCCL's buffer registration (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK) would
// register tidepool's ranges and never hear of their unmapping: refused, saying what to do
// (the tracker was taken and never called).
TEST_F(TorchCudaAllocatorTest, ATraceTrackerIsRefusedWithWhatToDo) {
  const auto allocator = make_torch_cuda_allocator();
  bool called = false;
  try {
    allocator->attachAllocatorTraceTracker(
        [&](const c10::cuda::CUDACachingAllocator::TraceEntry&) { called = true; });
    ADD_FAILURE() << "the tracker was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Unset TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"),
              std::string::npos)
        << e.what();
  }
  cache_a_block();
  EXPECT_FALSE(called);
}

TEST_F(TorchCudaAllocatorTest, ResetPeakStatsAndEmptyCacheReachTidepool) {
  cache_a_block();
  const auto allocator = make_torch_cuda_allocator();
  ASSERT_GT(stats().allocated.peak, stats().allocated.current);
  allocator->resetPeakStats(0);
  EXPECT_EQ(stats().allocated.peak, stats().allocated.current);
  ASSERT_GT(stats().cached_bytes, 0u);
  allocator->emptyCache();
  EXPECT_EQ(stats().cached_bytes, 0u) << "c10's emptyCache gives tidepool's cache back";
}

// torch.cuda.memory_stats() reads c10's DeviceStats: tidepool's figures, copied from its
// PyTorch view (Note [PyTorch's view of the stats]), with the accumulated reset.
TEST_F(TorchCudaAllocatorTest, DeviceStatsAreTidepoolsPyTorchView) {
  using c10::CachingAllocator::StatType;
  constexpr auto kAll = static_cast<std::size_t>(StatType::AGGREGATE);
  constexpr auto kLarge = static_cast<std::size_t>(StatType::LARGE_POOL);
  constexpr auto kSmall = static_cast<std::size_t>(StatType::SMALL_POOL);
  const auto allocator = make_torch_cuda_allocator();
  constexpr std::size_t kBlock = std::size_t{6} << 20;
  void* p = tidepool_malloc(kBlock, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  auto d = allocator->getDeviceStats(0);
  tidepool_stats_v1 s = stats();
  EXPECT_EQ(d.allocated_bytes[kAll].current, static_cast<int64_t>(s.allocated.current));
  EXPECT_EQ(d.allocated_bytes[kAll].peak, static_cast<int64_t>(s.allocated.peak));
  EXPECT_EQ(d.allocated_bytes[kLarge].current, d.allocated_bytes[kAll].current);
  EXPECT_EQ(d.allocated_bytes[kSmall].current, 0);
  EXPECT_EQ(d.reserved_bytes[kAll].current, static_cast<int64_t>(s.reserved.current));
  EXPECT_EQ(d.requested_bytes[kAll].current, static_cast<int64_t>(s.requested.current));
  EXPECT_EQ(d.allocation[kAll].current, static_cast<int64_t>(s.allocations.current));
  EXPECT_EQ(d.allocation[kAll].peak, static_cast<int64_t>(s.allocations.peak));
  EXPECT_EQ(d.segment[kAll].current, static_cast<int64_t>(s.segments.current));
  EXPECT_EQ(d.num_device_alloc, static_cast<int64_t>(s.segments_acquired));
  EXPECT_EQ(d.num_ooms, static_cast<int64_t>(s.oom_count));
  EXPECT_EQ(d.max_split_size, -1);
  EXPECT_GT(d.allocated_bytes[kAll].allocated, 0);

  allocator->resetAccumulatedStats(0);
  d = allocator->getDeviceStats(0);
  EXPECT_EQ(d.allocated_bytes[kAll].allocated, 0);
  EXPECT_EQ(d.allocation[kAll].allocated, 0);
  EXPECT_EQ(d.num_device_alloc, 0);
  EXPECT_EQ(d.allocated_bytes[kAll].current, static_cast<int64_t>(s.allocated.current));
  tidepool_free(p, kBlock, 0, nullptr);
  d = allocator->getDeviceStats(0);
  EXPECT_EQ(d.allocated_bytes[kAll].freed, static_cast<int64_t>(kBlock));
  EXPECT_EQ(stats().free_count, s.free_count + 1) << "tidepool's own totals go on";

  ::testing::internal::CaptureStderr();
  EXPECT_THROW(allocator->getDeviceStats(99), c10::Error);
  EXPECT_THROW(allocator->resetAccumulatedStats(99), c10::Error);
  ::testing::internal::GetCapturedStderr();
}

// The memory history (Note [memory history]): what torch.cuda.memory._record_memory_history
// and the memory visualizer's snapshot get, with a context recorder standing in for
// PyTorch's stack gatherer.
struct NumberedContext : c10::GatheredContext {
  explicit NumberedContext(int n) : number(n) {}
  int number;
};
int g_contexts_gathered = 0;
std::shared_ptr<c10::GatheredContext> numbered_context() {
  return std::make_shared<NumberedContext>(++g_contexts_gathered);
}
int number_of(const std::shared_ptr<c10::GatheredContext>& c) {
  const auto* numbered = dynamic_cast<const NumberedContext*>(c.get());
  return numbered != nullptr ? numbered->number : 0;
}

using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
using c10::cuda::CUDACachingAllocator::RecordContext;

std::vector<c10::CachingDeviceAllocator::TraceEntry> traces(
    c10::cuda::CUDACachingAllocator::CUDAAllocator& allocator) {
  auto info = allocator.snapshot({0, 0}, true);
  return info.device_traces.empty() ? std::vector<c10::CachingDeviceAllocator::TraceEntry>{}
                                    : info.device_traces[0];
}

TEST_F(TorchCudaAllocatorTest, TheMemoryHistoryRecordsAllocationsFreesAndTheirStacks) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  EXPECT_FALSE(allocator->isHistoryEnabled());
  cache_a_block();  // backing to reuse: no segment entries (the next test traces those)
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALL, true, {});
  EXPECT_TRUE(allocator->isHistoryEnabled());
  void* p = allocator->malloc(5 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const int allocated_under = g_contexts_gathered;

  // The snapshot: tidepool's backed ranges, the live block with its allocating stack.
  auto info = allocator->snapshot({0, 0}, true);
  const tidepool_stats_v1 s = stats();
  std::size_t total = 0, allocated = 0;
  const c10::CachingDeviceAllocator::BlockInfo* mine = nullptr;
  for (const auto& segment : info.segments) {
    EXPECT_EQ(segment.device, 0);
    total += segment.total_size;
    allocated += segment.allocated_size;
    std::size_t at = segment.address, tiled = 0;
    for (const auto& block : segment.blocks) {
      if (at == reinterpret_cast<std::uintptr_t>(p)) mine = &block;
      at += block.size;
      tiled += block.size;
    }
    EXPECT_EQ(tiled, segment.total_size);
  }
  EXPECT_EQ(total, s.reserved.current);
  EXPECT_EQ(allocated, s.allocated.current);
  ASSERT_NE(mine, nullptr) << "the live block is in a segment";
  EXPECT_TRUE(mine->allocated && mine->active);
  EXPECT_EQ(mine->requested_size, std::size_t{5} << 20);
  EXPECT_EQ(number_of(mine->context_when_allocated), allocated_under);

  allocator->raw_delete(p);
  const auto entries = traces(*allocator);
  // alloc, snapshot, free requested, free completed, and the snapshot traces() takes
  ASSERT_EQ(entries.size(), 5u);
  EXPECT_EQ(entries[4].action_, Action::SNAPSHOT);
  EXPECT_EQ(entries[0].action_, Action::ALLOC);
  EXPECT_EQ(entries[0].addr_, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(entries[0].size_, std::size_t{5} << 20);
  EXPECT_EQ(number_of(entries[0].context_), allocated_under);
  EXPECT_GT(entries[0].time_.t_, 0);
  EXPECT_EQ(entries[1].action_, Action::SNAPSHOT);
  EXPECT_EQ(entries[2].action_, Action::FREE_REQUESTED);
  EXPECT_EQ(entries[3].action_, Action::FREE_COMPLETED);
  EXPECT_EQ(entries[2].addr_, entries[0].addr_);
  EXPECT_GT(number_of(entries[2].context_), allocated_under) << "ALL: the free's own stack";

  // Cleared on request while recording goes on.
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALL, true, {});
  EXPECT_EQ(traces(*allocator).size(), 1u) << "the snapshot traces() itself takes";
  // Off: nothing is recorded any more, and what was is dropped, as c10 does.
  allocator->recordHistory(false, nullptr, 100, RecordContext::NEVER, false, {});
  EXPECT_FALSE(allocator->isHistoryEnabled());
  allocator->raw_delete(allocator->malloc(4096, 0, nullptr));
  EXPECT_TRUE(traces(*allocator).empty());
}

TEST_F(TorchCudaAllocatorTest, TheHistoryKeepsTheNewestEntriesAndSkipsWhatItIsTold) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  // STATE: stacks for live blocks only, none on the entries.
  allocator->recordHistory(true, numbered_context, 3, RecordContext::STATE, true,
                           {"free_requested", "snapshot"});
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i)
    blocks.push_back(allocator->malloc(std::size_t(i + 1) << 20, 0, nullptr));
  auto entries = traces(*allocator);
  ASSERT_EQ(entries.size(), 3u) << "a ring of max_entries";
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(entries[i].addr_, reinterpret_cast<std::uintptr_t>(blocks[i + 1])) << "oldest first";
    EXPECT_EQ(entries[i].context_, nullptr);
  }
  allocator->raw_delete(blocks[0]);
  entries = traces(*allocator);
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[2].action_, Action::FREE_COMPLETED);
  EXPECT_EQ(entries[2].addr_, reinterpret_cast<std::uintptr_t>(blocks[0]));
  EXPECT_EQ(entries[1].action_, Action::ALLOC) << "free_requested and snapshot are skipped";

  // An unknown action name is c10's error, and the history stays as it was.
  ::testing::internal::CaptureStderr();
  EXPECT_THROW(allocator->recordHistory(true, numbered_context, 50, RecordContext::ALL, true,
                                        {"no_such_action"}),
               c10::Error);
  ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(allocator->isHistoryEnabled());
  EXPECT_EQ(traces(*allocator).size(), 3u) << "not cleared, still a ring of 3";

  // A ring that has wrapped and then grows keeps its order: the next entry is the newest.
  allocator->recordHistory(true, numbered_context, 10, RecordContext::STATE, false,
                           {"free_requested", "snapshot"});
  const auto before = traces(*allocator);
  ASSERT_EQ(before.size(), 3u);
  allocator->raw_delete(blocks[1]);
  const auto grown = traces(*allocator);
  ASSERT_EQ(grown.size(), 4u);
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(grown[i].action_, before[i].action_) << i;
    EXPECT_EQ(grown[i].addr_, before[i].addr_) << i;
  }
  EXPECT_EQ(grown[3].action_, Action::FREE_COMPLETED);
  EXPECT_EQ(grown[3].addr_, reinterpret_cast<std::uintptr_t>(blocks[1]));
  for (std::size_t i = 2; i < blocks.size(); ++i) allocator->raw_delete(blocks[i]);
  allocator->recordHistory(false, nullptr, 1, RecordContext::NEVER, true, {});
}

// The backing tidepool maps for an allocation is traced before its ALLOC, the unmapping
// that gives it back after the FREE_COMPLETED of the block that held it, with c10's fields
// and, under ALL, the stack of the call that caused it; skip_actions drops them. The
// device's allocator uses expandable ranges: SEGMENT_MAP / SEGMENT_UNMAP.
TEST_F(TorchCudaAllocatorTest, TheHistoryTracesSegmentsAroundTheirAllocations) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  constexpr std::size_t kBlock = std::size_t{5} << 20;
  allocator->emptyCache();  // nothing backed but live blocks: the allocation must map
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALL, true, {});
  void* p = allocator->malloc(kBlock, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const int allocated_under = g_contexts_gathered;
  allocator->raw_delete(p);
  allocator->emptyCache();
  const int emptied_under = g_contexts_gathered;
  const auto entries = traces(*allocator);
  std::vector<Action> actions;
  for (const auto& e : entries) actions.push_back(e.action_);
  // SEGMENT_MAP..., ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_UNMAP..., SNAPSHOT
  std::size_t alloc = 0;
  while (alloc < entries.size() && entries[alloc].action_ == Action::SEGMENT_MAP) ++alloc;
  ASSERT_GE(alloc, 1u) << "the allocation's backing comes first";
  ASSERT_GE(entries.size(), alloc + 5u);
  EXPECT_EQ(entries[alloc].action_, Action::ALLOC);
  EXPECT_EQ(entries[alloc + 1].action_, Action::FREE_REQUESTED);
  EXPECT_EQ(entries[alloc + 2].action_, Action::FREE_COMPLETED);
  EXPECT_EQ(entries.back().action_, Action::SNAPSHOT);
  std::map<std::size_t, std::size_t> mapped;  // address -> size
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  bool covered = false;
  for (std::size_t i = 0; i < alloc; ++i) {
    const auto& e = entries[i];
    EXPECT_EQ(e.device_, 0);
    EXPECT_EQ(e.stream_, nullptr);
    EXPECT_GT(e.time_.t_, 0);
    EXPECT_EQ(number_of(e.context_), allocated_under) << "ALL: the allocation's stack";
    mapped[e.addr_] = e.size_;
    covered = covered || (e.addr_ <= address && address + kBlock <= e.addr_ + e.size_);
  }
  EXPECT_TRUE(covered) << "a mapped run holds the block";
  const std::size_t unmaps = entries.size() - 1 - (alloc + 3);
  EXPECT_EQ(unmaps, alloc) << "emptyCache unmaps what the allocation mapped";
  for (std::size_t i = alloc + 3; i + 1 < entries.size(); ++i) {
    const auto& e = entries[i];
    EXPECT_EQ(e.action_, Action::SEGMENT_UNMAP);
    EXPECT_EQ(e.device_, 0);
    EXPECT_EQ(number_of(e.context_), emptied_under) << "ALL: emptyCache's stack";
    ASSERT_EQ(mapped.count(e.addr_), 1u);
    EXPECT_EQ(mapped[e.addr_], e.size_);
  }

  // ALLOC: stacks on allocations only (c10 puts the allocation's on its segment entries;
  // here the segment entries get one only under ALL).
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALLOC, true, {});
  p = allocator->malloc(kBlock, 0, nullptr);
  allocator->raw_delete(p);
  allocator->emptyCache();
  for (const auto& e : traces(*allocator)) {
    if (e.action_ == Action::SEGMENT_MAP || e.action_ == Action::SEGMENT_UNMAP) {
      EXPECT_EQ(e.context_, nullptr);
    }
  }

  // Skipped like any other action.
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALL, true,
                           {"segment_map", "segment_unmap"});
  p = allocator->malloc(kBlock, 0, nullptr);
  allocator->raw_delete(p);
  allocator->emptyCache();
  const auto skipped = traces(*allocator);
  ASSERT_EQ(skipped.size(), 4u) << "alloc, free requested, free completed, snapshot";
  EXPECT_EQ(skipped[0].action_, Action::ALLOC);
  allocator->recordHistory(false, nullptr, 1, RecordContext::NEVER, true, {});
}

// A stream of device 0's backend held behind a gate until pass(), named to c10 by its
// handle (as torch.cuda.ExternalStream names one, so no CUDA call is needed): what
// record_stream names, with no timing in the tests. Released and destroyed at the end.
struct HeldSideStream {
  Backend& backend = device_allocator(0).backend();
  const Stream stream = backend.create_stream();
  test_support::StreamGate gate;
  const test_support::StreamGate::OpenOnExit open_on_exit{gate};
  const c10::cuda::CUDAStream in_c10 =
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream.handle), 0);

  HeldSideStream() { backend.launch_host_func(stream, &test_support::StreamGate::wait, &gate); }
  ~HeldSideStream() {
    pass();
    EXPECT_EQ(tidepool_release_stream(0, stream.handle), 0) << tidepool_last_error();
    backend.destroy_stream(stream);
  }
  HeldSideStream(const HeldSideStream&) = delete;
  HeldSideStream& operator=(const HeldSideStream&) = delete;
  // Lets the stream run, and waits until it has.
  void pass() {
    gate.open();
    backend.stream_synchronize(stream);
  }
};

// A block freed while another stream still uses it (record_stream) is free, in c10's
// history, only once that stream has passed it: FREE_REQUESTED at the free, FREE_COMPLETED
// when tidepool gives it back to its pool (Note [memory history]). The stream is held by a
// gate, so the test needs no timing.
TEST_F(TorchCudaAllocatorTest, AFreeAnotherStreamHoldsCompletesWhenTheStreamHasPassedIt) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  HeldSideStream side;
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALL, true, {});
  constexpr std::size_t kBytes = std::size_t{6} << 20;
  void* p = allocator->malloc(kBytes, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  allocator->recordStream(c10::DataPtr(p, c10::Device(c10::kCUDA, 0)), side.in_c10);
  allocator->raw_delete(p);
  const int freed_under = g_contexts_gathered;
  // The frees of `p` traced so far, by action.
  auto count = [&](Action action) {
    int n = 0;
    for (const auto& e : traces(*allocator)) n += e.action_ == action && e.addr_ == address;
    return n;
  };
  EXPECT_EQ(count(Action::FREE_REQUESTED), 1);
  EXPECT_EQ(count(Action::FREE_COMPLETED), 0) << "the side stream has not passed the block";
  allocator->emptyCache();  // looks at the held blocks: still held
  EXPECT_EQ(count(Action::FREE_COMPLETED), 0);

  side.pass();
  allocator->emptyCache();  // the held block goes back to its pool
  const auto entries = traces(*allocator);
  std::size_t requested = entries.size(), completed = entries.size();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].addr_ != address) continue;
    if (entries[i].action_ == Action::FREE_REQUESTED) requested = i;
    if (entries[i].action_ == Action::FREE_COMPLETED) completed = i;
  }
  ASSERT_LT(completed, entries.size()) << "no FREE_COMPLETED once the stream passed the block";
  EXPECT_LT(requested, completed);
  EXPECT_EQ(entries[completed].size_, kBytes);
  EXPECT_EQ(number_of(entries[completed].context_), freed_under) << "ALL: the free's stack";
  // Only one, and a plain free still completes at once.
  EXPECT_EQ(count(Action::FREE_COMPLETED), 1);
  void* q = allocator->malloc(4096, 0, nullptr);
  allocator->raw_delete(q);
  const auto q_address = reinterpret_cast<std::uintptr_t>(q);
  int q_completed = 0;
  for (const auto& e : traces(*allocator))
    q_completed += e.action_ == Action::FREE_COMPLETED && e.addr_ == q_address;
  EXPECT_EQ(q_completed, 1);
  allocator->recordHistory(false, nullptr, 1, RecordContext::NEVER, true, {});
}

TEST_F(TorchCudaAllocatorTest, OutOfMemoryCallsTheObserversAndIsRecorded) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  allocator->recordHistory(true, numbered_context, 10, RecordContext::ALLOC, true, {});
  std::vector<std::tuple<int64_t, std::size_t, std::size_t, std::size_t>> seen;
  allocator->attachOutOfMemoryObserver(
      [&](int64_t device, std::size_t size, std::size_t total, std::size_t free) {
        seen.emplace_back(device, size, total, free);
      });
  constexpr std::size_t kTooMuch = std::size_t{64} << 30;  // the host backend has 8 GiB
  EXPECT_THROW(allocator->malloc(kTooMuch, 0, nullptr), c10::OutOfMemoryError);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(std::get<0>(seen[0]), 0);
  EXPECT_EQ(std::get<1>(seen[0]), kTooMuch);
  EXPECT_GT(std::get<2>(seen[0]), 0u);
  EXPECT_LE(std::get<3>(seen[0]), std::get<2>(seen[0]));
  const auto entries = traces(*allocator);
  ASSERT_FALSE(entries.empty());
  EXPECT_EQ(entries.front().action_, Action::OOM);
  EXPECT_EQ(entries.front().size_, kTooMuch);
  EXPECT_EQ(entries.front().addr_, std::get<3>(seen[0])) << "OOM entries carry the free bytes";
  ::testing::internal::CaptureStderr();
  EXPECT_THROW(allocator->malloc(std::size_t{1} << 60, 0, nullptr), c10::Error);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(seen.size(), 1u) << "a bad request is not out of memory";
  allocator->recordHistory(false, nullptr, 1, RecordContext::NEVER, true, {});
}

// torch.profiler(profile_memory=True) installs a reporter in the thread's debug info; c10's
// allocator reports to it, and so must tidepool's (a stand-in reporter here).
struct ProfilerStandIn : c10::MemoryReportingInfoBase {
  struct Event {
    void* ptr;
    int64_t size;
    std::size_t allocated, reserved;
    c10::Device device;
  };
  std::vector<Event> events;
  std::vector<int64_t> out_of_memory;
  bool memoryProfilingEnabled() const override { return true; }
  void reportMemoryUsage(void* ptr, int64_t size, std::size_t allocated, std::size_t reserved,
                         c10::Device device) override {
    events.push_back({ptr, size, allocated, reserved, device});
  }
  void reportOutOfMemory(int64_t size, std::size_t, std::size_t, c10::Device) override {
    out_of_memory.push_back(size);
  }
};

TEST_F(TorchCudaAllocatorTest, AllocationsAndFreesReachTheProfiler) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  void* unseen = allocator->malloc(4096, 0, nullptr);  // no profiler yet: nothing reported
  auto profiler = std::make_shared<ProfilerStandIn>();
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, profiler);
    void* p = allocator->malloc((std::size_t{3} << 20) - 100, 0, nullptr);
    const tidepool_stats_v1 after_alloc = stats();
    allocator->raw_delete(p);  // PyTorch frees with the size it asked for
    EXPECT_THROW(allocator->malloc(std::size_t{64} << 30, 0, nullptr), c10::OutOfMemoryError);
    ASSERT_EQ(profiler->events.size(), 2u);
    EXPECT_EQ(profiler->events[0].ptr, p);
    EXPECT_EQ(profiler->events[0].size, int64_t{3} << 20) << "the block's size, as c10 reports";
    EXPECT_EQ(profiler->events[0].allocated, after_alloc.allocated.current);
    EXPECT_EQ(profiler->events[0].reserved, after_alloc.reserved.current);
    EXPECT_EQ(profiler->events[0].device, c10::Device(c10::DeviceType::CUDA, 0));
    EXPECT_EQ(profiler->events[1].ptr, p);
    EXPECT_EQ(profiler->events[1].size, -(int64_t{3} << 20)) << "a free is a negative size";
    EXPECT_EQ(profiler->events[1].allocated,
              after_alloc.allocated.current - (std::size_t{3} << 20));
    EXPECT_EQ(profiler->out_of_memory, std::vector<int64_t>{int64_t{64} << 30});
  }
  allocator->raw_delete(unseen);  // the profiler's scope has ended
  EXPECT_EQ(profiler->events.size(), 2u);
}

TEST_F(TorchCudaAllocatorTest, TheMemoryFractionReachesTidepool) {
  const auto allocator = make_torch_cuda_allocator();
  allocator->setMemoryFraction(0.25, 0);
  EXPECT_EQ(tidepool_get_memory_fraction(0), 0.25);
  EXPECT_EQ(allocator->getMemoryFraction(0), 0.25);
  ::testing::internal::CaptureStderr();
  EXPECT_THROW(allocator->setMemoryFraction(2.0, 0), c10::Error);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(allocator->getMemoryFraction(0), 0.25) << "a refused fraction changes nothing";
  allocator->setMemoryFraction(1.0, 0);
  EXPECT_EQ(allocator->getMemoryFraction(0), 1.0);
}

// Through the allocator's own malloc (what LibTorch calls for every CUDA tensor; here over
// the host backend, 8 GiB): running out is c10's OutOfMemoryError, as with PyTorch's own
// allocator; a bad request is a plain c10::Error.
TEST_F(TorchCudaAllocatorTest, OutOfMemoryIsC10sOutOfMemoryError) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  ASSERT_NE(allocator, nullptr);
  void* p = allocator->malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  allocator->raw_delete(p);
  try {
    allocator->malloc(std::size_t{64} << 30, 0, nullptr);
    ADD_FAILURE() << "64 GiB on an 8 GiB device did not throw";
  } catch (const c10::OutOfMemoryError& e) {
    // c10's opening, which training tools match to tell an OOM (pytorch_out_of_memory_message).
    EXPECT_EQ(std::string(e.what_without_backtrace())
                  .rfind("CUDA out of memory. Tried to allocate 64.00 GiB. ", 0),
              0u)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("tidepool: out of memory"), std::string::npos) << e.what();
  }
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(allocator->raw_delete(nullptr));
  EXPECT_NO_THROW(allocator->raw_delete(nullptr));  // (the plain class threw the second time)
  try {
    allocator->malloc(std::size_t{1} << 60, 0, nullptr);
    ADD_FAILURE() << "an absurd size did not throw";
  } catch (const c10::OutOfMemoryError& e) {
    ADD_FAILURE() << "an absurd size is a bad request, not out of memory: " << e.what();
  } catch (const c10::Error& e) {
    EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 0);
  }
  ::testing::internal::GetCapturedStderr();
}

// Note [Forked child]: in a child forked while a parent thread held the allocator's lock
// (here empty_cache, waiting under it for a stream the gate holds, whose freed block it
// gives back), a tensor's deleter frees nothing and takes no lock; with the history on,
// its bookkeeping took the allocator's lock and the child hung (review finding).
TEST_F(TorchCudaAllocatorTest, AFreeInAForkedChildTakesNoLockOfTheParents) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  allocator->recordHistory(true, numbered_context, 100, RecordContext::ALL, true, {});
  void* block = allocator->malloc(4096, 0, nullptr);
  ASSERT_NE(block, nullptr);
  {
    const test_support::HeldAllocatorLock held;
    std::fflush(nullptr);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      allocator->raw_delete(block);
      std::_Exit(0);
    }
    EXPECT_EQ(test_support::wait_for_child(pid, std::chrono::seconds(20)), 0)
        << "-1: the child hung freeing the block (killed after 20 s)";
  }
  allocator->raw_delete(block);
  allocator->recordHistory(false, nullptr, 100, RecordContext::NEVER, false, {});
}

// A call tidepool refuses in global mode: c10's error, naming the way out and what it is
// about.
void expect_refused(const std::function<void()>& call, const std::string& about) {
  try {
    call();
    ADD_FAILURE() << "not refused: " << about;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tidepool.mode:pool"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(about), std::string::npos) << e.what();
  }
}

// CUDA graph capture and torch.cuda.MemPool need memory pools, which global mode lacks:
// a clear error that names the way out, not memory reused under a captured graph.
TEST_F(TorchCudaAllocatorTest, MemoryPoolsAreRefusedNamingPoolMode) {
  const auto allocator = make_torch_cuda_allocator();
  expect_refused([&] { allocator->createOrIncrefPool(0, {1, 0}, nullptr); }, "CUDA graph");
  expect_refused(
      [&] { allocator->beginAllocateToPool(0, {1, 0}, [](cudaStream_t) { return true; }); },
      "CUDA graph");
}

// CUDA IPC (torch.multiprocessing with CUDA tensors): tidepool's error with the way out,
// not the plain class's "please file an issue".
TEST_F(TorchCudaAllocatorTest, CudaIpcIsRefusedNamingPoolMode) {
  const auto allocator = make_torch_cuda_allocator();
  void* p = tidepool_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  expect_refused([&] { allocator->shareIpcHandle(p); }, "torch.multiprocessing");
  expect_refused([&] { allocator->getIpcDevPtr("handle"); }, "torch.multiprocessing");
  tidepool_free(p, 4096, 0, nullptr);
}

TEST_F(TorchCudaAllocatorTest, InstalledItIsWhatC10Calls) {
  ASSERT_EQ(tidepool_torch_install_cuda_allocator(), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_torch_install_cuda_allocator(), 0) << "a second call changes nothing";
  cache_a_block();
  std::size_t largest = 0;
  c10::cuda::CUDACachingAllocator::cacheInfo(0, &largest);  // what cuDNN's autotuner calls
  EXPECT_EQ(largest, tidepool_cache_info_of(0));
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  EXPECT_EQ(stats().allocated.peak, stats().allocated.current);
  c10::cuda::CUDACachingAllocator::emptyCache();
  EXPECT_EQ(stats().cached_bytes, 0u);
  void* held = tidepool_malloc(4096, 0, nullptr);
  ASSERT_NE(held, nullptr) << tidepool_last_error();
  EXPECT_FALSE(c10::cuda::CUDACachingAllocator::snapshot().segments.empty());  // memory_snapshot()
  tidepool_free(held, 4096, 0, nullptr);
  EXPECT_FALSE(c10::cuda::CUDACachingAllocator::isHistoryEnabled());
  const auto d = c10::cuda::CUDACachingAllocator::getDeviceStats(0);  // torch.cuda.memory_stats
  EXPECT_EQ(d.reserved_bytes[0].current, static_cast<int64_t>(stats().reserved.current));
  c10::cuda::CUDACachingAllocator::resetAccumulatedStats(0);
  EXPECT_EQ(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocation[0].allocated, 0);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(0.5, 0);  // set_per_process_memory_fraction
  EXPECT_EQ(c10::cuda::CUDACachingAllocator::getMemoryFraction(0), 0.5);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, 0);
  // c10's registry by device type too (torch.accelerator's memory functions).
  EXPECT_EQ(c10::GetAllocator(c10::DeviceType::CUDA), c10::cuda::CUDACachingAllocator::get());
  EXPECT_EQ(
      c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(0).reserved_bytes[0].current,
      static_cast<int64_t>(stats().reserved.current));
}

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

Pluggable& installed_allocator() {
  EXPECT_EQ(tidepool_torch_install_cuda_allocator(), 0) << tidepool_last_error();
  auto* installed = dynamic_cast<Pluggable*>(c10::cuda::CUDACachingAllocator::get());
  if (installed == nullptr) throw std::runtime_error("tidepool is not c10's CUDA allocator");
  return *installed;
}

// Tensor::record_stream as LibTorch makes it (at::native::record_stream_cuda): c10's
// recordStream with the storage's DataPtr and the stream, through the installed
// allocator to tidepool. The block freed on its allocating stream is not handed out again
// while the recorded stream has not passed the call (here it is held by a gate, so the
// test needs no timing), and is once it has. Without the record-stream function set on the
// allocator the plain class drops the call and the second request gets the same block.
TEST_F(TorchCudaAllocatorTest, RecordStreamThroughC10HoldsTheMemoryUntilTheStreamPassesIt) {
  Pluggable& allocator = installed_allocator();
  HeldSideStream side;
  ASSERT_EQ(side.in_c10.stream(), static_cast<cudaStream_t>(side.stream.handle));

  constexpr std::size_t kBytes = std::size_t{32} << 20;
  void* p = allocator.malloc(kBytes, 0, nullptr);  // on the default stream, as a tensor
  ASSERT_NE(p, nullptr);
  c10::cuda::CUDACachingAllocator::recordStream(c10::DataPtr(p, c10::Device(c10::kCUDA, 0)),
                                                side.in_c10);
  allocator.raw_delete(p);  // the tensor's deleter: freed on its allocating stream
  void* q = allocator.malloc(kBytes, 0, nullptr);
  EXPECT_NE(q, p) << "handed out again while the recorded stream had not passed the call";
  side.pass();
  allocator.raw_delete(q);
  void* r = allocator.malloc(kBytes, 0, nullptr);
  EXPECT_TRUE(r == p || r == q) << "the held block is free again once the stream passed";
  allocator.raw_delete(r);
}

// Note [the installed allocator is never destroyed] (torch_cuda_allocator.cpp): a stand-in
// for PyTorch's Python stacks, which must not be released once Python is gone.
std::atomic<bool> g_python_gone{false};
struct PythonStackStandIn : c10::GatheredContext {
  ~PythonStackStandIn() override {
    if (!g_python_gone.load()) return;
    std::fputs("a Python stack was released after Python had ended\n", stderr);
    std::_Exit(3);
  }
};
std::shared_ptr<c10::GatheredContext> python_stack() {
  return std::make_shared<PythonStackStandIn>();
}

constexpr const char* kExitChildVariable = "TIDEPOOL_TEST_EXIT_CHILD";

// The child of TheInstalledAllocatorOutlivesTheStaticDestructors (skipped otherwise): the
// memory visualizer's state as a Python program leaves it at exit (history on, a trace of
// allocations and frees with their stacks, a live block with its allocation stack, an
// out-of-memory observer holding Python state), then an exit handler registered after
// LibTorch was loaded marks Python as gone, as Py_Finalize and libtorch_python's static
// destructors come before libtorch_cuda's, which holds the installed allocator.
TEST_F(TorchCudaAllocatorTest, ExitChildOfTheOutlivesTest) {
  if (std::getenv(kExitChildVariable) == nullptr)
    GTEST_SKIP() << "run by TheInstalledAllocatorOutlivesTheStaticDestructors";
  Pluggable& allocator = installed_allocator();
  c10::cuda::CUDACachingAllocator::recordHistory(true, python_stack, 100, RecordContext::ALL,
                                                 true, {});
  void* freed = allocator.malloc(8192, 0, nullptr);
  allocator.raw_delete(freed);
  void* live = allocator.malloc(4096, 0, nullptr);  // still allocated at exit
  ASSERT_NE(live, nullptr);
  c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
      [held = python_stack()](int64_t, std::size_t, std::size_t, std::size_t) {});
  ASSERT_EQ(std::atexit([] { g_python_gone.store(true); }), 0);
}

// Runs this binary afresh on the one test `test` (a TorchCudaAllocatorTest), with
// `variables` ("NAME=value") ahead of the environment; the child's exit code. Exec, not a
// bare fork: a fork of a process that has used tidepool is refused tidepool's calls (Note
// [Forked child]), and c10 reads PYTORCH_CUDA_ALLOC_CONF once per process.
int run_this_binary(const std::string& test, std::vector<std::string> variables) {
  std::vector<std::string> args = {"/proc/self/exe",
                                   "--gtest_filter=TorchCudaAllocatorTest." + test};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (char** e = environ; *e != nullptr; ++e) variables.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : variables) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) != 0) return -1;
  return test_support::wait_for_child(pid, std::chrono::seconds(120));
}

TEST_F(TorchCudaAllocatorTest, TheInstalledAllocatorOutlivesTheStaticDestructors) {
  if (std::getenv(kExitChildVariable) != nullptr) GTEST_SKIP() << "in the child";
  EXPECT_EQ(run_this_binary("ExitChildOfTheOutlivesTest", {std::string(kExitChildVariable) + "=1"}),
            0)
      << "the child (its output is above) released a Python stack during its static "
         "destructors, or failed otherwise";
}

// Note [per_process_memory_fraction in global mode]: the child runs with
// PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:0.25, which c10 parses; run alone,
// it skips.
constexpr const char* kFractionChildVariable = "TIDEPOOL_TEST_FRACTION_CHILD";

TEST_F(TorchCudaAllocatorTest, FractionChildOfTheConfiguredFractionTest) {
  if (std::getenv(kFractionChildVariable) == nullptr)
    GTEST_SKIP() << "run by PytorchsConfiguredFractionCapsEachDeviceAtItsFirstAllocation";
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  // The program's own, before the devices' first use: they win, 1.0 (no cap) included.
  allocator->setMemoryFraction(0.5, 1);
  allocator->setMemoryFraction(1.0, 2);
  // Asked before a device's first allocation: the fraction it will have (review finding:
  // 1.0 until then), and asking makes nothing there.
  EXPECT_EQ(allocator->getMemoryFraction(0), 0.25);
  EXPECT_EQ(allocator->getMemoryFraction(1), 0.5);
  EXPECT_EQ(allocator->getMemoryFraction(2), 1.0);
  EXPECT_EQ(allocator->getMemoryFraction(3), 0.25);
  for (const int device : {0, 1, 2}) {
    allocator->raw_delete(allocator->malloc(4096, device, nullptr));
  }
  EXPECT_EQ(tidepool_get_memory_fraction(0), 0.25);
  EXPECT_EQ(tidepool_get_memory_fraction(1), 0.5);
  EXPECT_EQ(tidepool_get_memory_fraction(2), 1.0);
  EXPECT_EQ(tidepool::existing_device_allocator(3), nullptr);  // nothing made ahead
}

TEST_F(TorchCudaAllocatorTest, PytorchsConfiguredFractionCapsEachDeviceAtItsFirstAllocation) {
  if (std::getenv(kFractionChildVariable) != nullptr) GTEST_SKIP() << "in the child";
  EXPECT_EQ(run_this_binary("FractionChildOfTheConfiguredFractionTest",
                            {std::string(kFractionChildVariable) + "=1",
                             "PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:0.25"}),
            0)
      << "the child's output is above";
}

}  // namespace
}  // namespace tidepool::optim

#else

TEST(TorchCudaAllocatorTest, NeedsACudaBuild) {
  GTEST_SKIP() << "tidepool_torch_cuda is built only with CUDA";
}

#endif
