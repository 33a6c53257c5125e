// The LD_PRELOAD shim's record of memory freed in the legacy stream's order, which a
// cudaMalloc must not hand out before that stream has passed the free.
//
// Note [cudaMalloc after stream-ordered frees]
// cudaMalloc allocates from tidepool's NULL-stream pools, and a cudaFreeAsync on the legacy
// stream (0 or cudaStreamLegacy) of a block allocated there (or on a stream the program
// has destroyed, whose blocks tidepool no longer ties to it) frees it into the same pools,
// where tidepool hands it to the next allocation at once (Note [Stream contract] in
// allocator/caching_allocator.h): legacy-stream work queued before the free may still use
// it. That is right for cudaMallocAsync on the legacy stream, and on the per-thread and
// other blocking streams, whose later work waits for the legacy stream's. It is wrong for
// cudaMalloc: its memory is usable at once by any stream, non-blocking ones included
// (they do not wait for the legacy stream), and by copies from the host, and in CUDA it
// never comes from memory a stream-ordered free has not passed.
//
// So the shim remembers, per device, the address ranges it freed in the legacy stream's
// order (noted before tidepool_free, so no other thread can get the block first), and a
// cudaMalloc whose block overlaps one not known passed waits for the legacy stream
// (cudaStreamSynchronize) before returning it. Every free queued before the wait began
// is then passed, so the wait clears their ranges; so does cudaFree's device
// synchronisation. A range is also known passed once a fence has completed: an event the
// shim records on the legacy stream when kFenceAfter ranges are pending, queried at later
// such frees and before a wait. So the list holds about as many frees as the GPU is
// behind, and a cudaMalloc of memory freed long ago does not wait. If the wait fails,
// the cudaMalloc fails with the runtime's error and gives the block back.
//
// The cost stays off the fast path: a cudaMalloc with no such free pending, or whose block
// overlaps none (the common case: memory freed by cudaFree, or by cudaFreeAsync on another
// stream, which tidepool holds back itself until that stream has passed the free), takes a
// lock and a scan. Ways not taken: waiting in every cudaMalloc while such frees are
// pending (programs that mix the calls would wait in most cudaMallocs); freeing
// legacy-ordered frees through the shim's ordering stream, as for the per-thread stream
// (cudaMallocAsync(..., 0) loops would lose in-order reuse and pay an event per free);
// a pool of cudaMalloc's own under a stream handle of the shim's, which freed memory would
// enter through tidepool's cross-stream fence (it splits the NULL stream's memory in two,
// costs a fence on every move between the halves, and needs a real stream per device in
// every program, for a mix of calls that is rare).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "preload/shim.h"

namespace tidepool_preload {

namespace {

// Pending ranges at which a free records a fence (when none is in flight).
constexpr size_t kFenceAfter = 64;

struct FreedRange {
  uintptr_t begin;
  uintptr_t end;
  uint64_t seq;  // ascending in `pending`
};

// One device's legacy-ordered frees not known passed.
struct DeviceFrees {
  std::vector<FreedRange> pending;
  uint64_t next_seq = 0;
  cudaEvent_t fence = nullptr;
  bool fence_in_flight = false;
  uint64_t fence_seq = 0;  // the fence in flight covers ranges with seq < fence_seq
};

struct LegacyFrees {
  std::mutex mutex;  // guards `devices`; held across the fence's event calls, which do not block
  std::unordered_map<int, DeviceFrees> devices;
};

LegacyFrees& legacy_frees() {
  static LegacyFrees* frees = new LegacyFrees;  // never destroyed, as the Shim
  return *frees;
}

void forget_before(DeviceFrees& d, uint64_t seq) {
  std::erase_if(d.pending, [seq](const FreedRange& r) { return r.seq < seq; });
}

bool overlaps_pending(const DeviceFrees& d, uintptr_t begin, uintptr_t end) {
  return std::any_of(d.pending.begin(), d.pending.end(),
                     [&](const FreedRange& r) { return r.begin < end && begin < r.end; });
}

// Forgets what a completed fence covers, and records a new fence over what is pending
// when none is in flight. The device must be current. A failed event call changes
// nothing: the ranges stay, and a cudaMalloc that meets them waits.
void refresh_fence(DeviceFrees& d) {
  const RealCudart& cuda = shim().cuda;
  if (d.fence_in_flight && cuda.event_query(d.fence) == cudaSuccess) {
    forget_before(d, d.fence_seq);
    d.fence_in_flight = false;
  }
  if (d.fence_in_flight || d.pending.empty()) return;
  if (d.fence == nullptr &&
      cuda.event_create_with_flags(&d.fence, cudaEventDisableTiming) != cudaSuccess) {
    d.fence = nullptr;
    return;
  }
  if (cuda.event_record(d.fence, cudaStreamLegacy) != cudaSuccess) return;
  d.fence_seq = d.next_seq;
  d.fence_in_flight = true;
}

}  // namespace

void note_legacy_ordered_free(void* ptr, size_t size, int device) {
  LegacyFrees& frees = legacy_frees();
  std::lock_guard lock(frees.mutex);
  DeviceFrees& d = frees.devices[device];
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  d.pending.push_back(FreedRange{begin, begin + size, d.next_seq++});
  if (d.pending.size() >= kFenceAfter) refresh_fence(d);
}

std::mutex& legacy_frees_mutex() { return legacy_frees().mutex; }

uint64_t legacy_frees_mark(int device) {
  LegacyFrees& frees = legacy_frees();
  std::lock_guard lock(frees.mutex);
  const auto it = frees.devices.find(device);
  return it == frees.devices.end() ? 0 : it->second.next_seq;
}

void legacy_frees_passed(int device, uint64_t mark) {
  LegacyFrees& frees = legacy_frees();
  std::lock_guard lock(frees.mutex);
  if (const auto it = frees.devices.find(device); it != frees.devices.end()) {
    forget_before(it->second, mark);
  }
}

cudaError_t order_after_legacy_frees(void* ptr, size_t size, int device) {
  LegacyFrees& frees = legacy_frees();
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  uint64_t mark = 0;
  {
    std::lock_guard lock(frees.mutex);
    const auto it = frees.devices.find(device);
    if (it == frees.devices.end()) return cudaSuccess;
    DeviceFrees& d = it->second;
    if (!overlaps_pending(d, begin, begin + size)) return cudaSuccess;
    refresh_fence(d);  // the fence may have seen the frees pass already
    if (!overlaps_pending(d, begin, begin + size)) return cudaSuccess;
    mark = d.next_seq;
  }
  // Unlocked: the wait may be long, and other threads' frees must not wait for it.
  const cudaError_t waited = shim().cuda.stream_synchronize(cudaStreamLegacy);
  if (waited == cudaSuccess) legacy_frees_passed(device, mark);
  return waited;
}

}  // namespace tidepool_preload
