// libtidepool_pluggable.so: the two functions PyTorch's CUDAPluggableAllocator calls
// when tidepool is installed from Python (torch.cuda.memory.CUDAPluggableAllocator(path,
// "tidepool_pluggable_malloc", "tidepool_pluggable_free")), routing by allocation tag.
//
// Why a router here: allocations tagged optimizer_state must be pointer-stable and
// migratable (PyTorch keeps raw pointers to them across steps, and tiering moves them
// to host memory between steps), so they go to the tiering layer's VMM ranges
// (tidepool_vmm_malloc); everything else goes to the caching allocator
// (tidepool_malloc). The allocator layer cannot call tiering (layers point down), so the
// choice is made one layer above both, in this file.
//
// The free side must find out which of the two a pointer came from. A count of live
// VMM ranges lets the common case (no optimizer state yet, or a workspace pointer while
// state exists) skip the lookup only while no range is live; otherwise
// tidepool_vmm_owns answers (one map lookup in the tiering layer).
//
// Note [OOM into PyTorch]: PyTorch's CUDAPluggableAllocator does not check the pointer
// its malloc returns, so a NULL would become a tensor over address 0 (seen on the H200:
// torch.empty of 1 PiB "succeeded"). These entry points are called only by PyTorch's
// C++ code, never through a C caller, so a failed allocation throws a C++ exception
// with tidepool's message instead; PyTorch turns it into a Python RuntimeError and the
// process lives on. C callers keep using tidepool_malloc, which returns NULL.
#include <atomic>
#include <stdexcept>
#include <string>

#include "allocator/c_api.h"
#include "allocator/export.h"
#include "tiering/c_api_tiering.h"

namespace {

std::atomic<long> g_live_vmm_ranges{0};

bool is_tierable(int tag) { return tag == TIDEPOOL_TAG_OPTIMIZER_STATE; }

}  // namespace

extern "C" {

TIDEPOOL_API void* tidepool_pluggable_malloc(ssize_t size, int device, void* stream) {
  const int tag = tidepool_tag_current();
  if (size > 0 && is_tierable(tag)) {
    if (void* p = tidepool_vmm_malloc(static_cast<size_t>(size), device, tag, stream)) {
      g_live_vmm_ranges.fetch_add(1, std::memory_order_relaxed);
      // Migration waits for the allocating stream's work (PyTorch gives the pluggable
      // allocator no record_stream for other streams).
      tidepool_vmm_record_stream(p, device, stream);
      return p;
    }
    // No device memory for a fresh range: the caching allocator's OOM policy (reuse,
    // free cached blocks, evict cold state) may still find room; the block then is not
    // migratable, which costs memory later, not correctness.
  }
  void* p = tidepool_malloc(size, device, stream);
  if (p == nullptr && size > 0) {  // Note [OOM into PyTorch]
    const char* why = tidepool_last_error();
    throw std::runtime_error(why != nullptr && why[0] != '\0'
                                 ? std::string(why)
                                 : "tidepool: allocation of " + std::to_string(size) +
                                       " bytes failed on device " + std::to_string(device));
  }
  return p;
}

TIDEPOOL_API void tidepool_pluggable_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr != nullptr && g_live_vmm_ranges.load(std::memory_order_relaxed) > 0 &&
      tidepool_vmm_owns(ptr, device) == 1) {
    if (tidepool_vmm_free(ptr, device) == 0) g_live_vmm_ranges.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  tidepool_free(ptr, size, device, stream);
}

}  // extern "C"
