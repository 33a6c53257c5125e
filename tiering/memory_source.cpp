// Where a tiered store's device buffers come from (DeviceMemorySource in tiered_store.h):
// the caching allocator's source, and the check that a caller's source is whole before
// the store is built on it (Note [A whole memory source]).
#include <new>
#include <string>

#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "allocator/tags.h"
#include "tiering/tiered_store.h"

namespace tidepool {

DeviceMemorySource caching_allocator_source(CachingAllocator& allocator, int tag) {
  DeviceMemorySource source;
  source.allocate = [&allocator, tag](std::size_t n, Stream s) -> void* {
    TagScope scope(tag);
    try {
      return allocator.allocate(n, s);
    } catch (const OutOfMemoryError&) {
      // Device memory, not the C++ heap: a plain std::bad_alloc from the allocator's
      // bookkeeping passes through (tiered_store.h), instead of making the store evict all
      // it has released and then report a full device.
      return nullptr;  // the store evicts its own released state and retries
    }
  };
  // No reclaim hooks, no release of the allocator's cache, no OOM counted: those would make
  // other stores evict (and wait) for a hint (CachingAllocator::try_allocate).
  source.try_allocate = [&allocator, tag](std::size_t n, Stream s) -> void* {
    TagScope scope(tag);
    return allocator.try_allocate(n, s);
  };
  source.deallocate = [&allocator](void* p, std::size_t n, Stream s) {
    allocator.deallocate(p, n, s);
  };
  source.release_stream = [&allocator](Stream s) { allocator.release_stream(s); };
  source.stream_ordered = true;
  return source;
}

// Note [A whole memory source]
// A source is the backend's (nothing set) or the caller's (allocate and deallocate both
// set), never a mix: buffers from one side handed back to the other are freed by a heap
// that never gave them out, and a backend's device_free called in stream order
// (stream_ordered) frees a buffer whose write-back is still reading it. So a source with
// some of its fields set but not both allocate and deallocate is refused, naming what is
// missing, rather than completed with the backend's. Checked before the store creates
// anything (device_ comes before host_ and copies_).
DeviceMemorySource TieredStore::whole_memory_source(Backend& backend,
                                                    DeviceMemorySource source) {
  const bool allocates = static_cast<bool>(source.allocate);
  const bool deallocates = static_cast<bool>(source.deallocate);
  if (allocates && deallocates) return source;
  const bool anything_set = allocates || deallocates || source.try_allocate ||
                            source.release_stream || source.stream_ordered;
  if (anything_set) {
    const char* missing = allocates     ? "deallocate"
                          : deallocates ? "allocate"
                                        : "allocate and deallocate";
    throw TieringError(std::string("tiered store: the device memory source has no ") + missing +
                       ": set allocate and deallocate both (try_allocate, release_stream and "
                       "stream_ordered only go with them), or nothing, for the backend's "
                       "device memory");
  }
  source.allocate = [&backend](std::size_t n, Stream) { return backend.device_alloc(n); };
  source.deallocate = [&backend](void* p, std::size_t n, Stream) { backend.device_free(p, n); };
  return source;
}

}  // namespace tidepool
