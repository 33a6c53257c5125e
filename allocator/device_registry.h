// The process-wide caching allocator of each device, as the C ABI and the tiering layer
// use it. The backend is chosen once, before the first allocator is created: by
// set_backend(), else by the environment variable TIDEPOOL_BACKEND ("cuda", "host",
// "auto"; default auto = cuda when cuda_device_count() > 0, else host). The host
// backend's emulated capacity can be set with TIDEPOOL_HOST_CAPACITY_MB.
//
// The instances are created on first use and never destroyed: PyTorch and other static
// objects may free memory during process tear-down, after our statics would be gone.
//
// Tests that want an allocator of their own construct a CachingAllocator directly over a
// backend they made (make_host_backend), independent of this registry.
#pragma once

#include <optional>
#include <string_view>

#include "allocator/caching_allocator.h"
#include "allocator/export.h"

namespace tidepool {

// Throws AllocatorUsageError for a device index that does not exist on the chosen
// backend, BackendError when the backend cannot be created.
TIDEPOOL_API CachingAllocator& device_allocator(int device);
// The device's allocator if it already exists, else nullptr. Never creates one.
TIDEPOOL_API CachingAllocator* existing_device_allocator(int device) noexcept;
// Throws what device_allocator(device) throws for a device that does not exist, without
// creating an allocator (on CUDA, a context on that device).
TIDEPOOL_API void check_device(int device);
// Throws AllocatorUsageError for an index outside 0..kMaxDevices-1, whether or not such a
// device exists: for calls that take any of tidepool's indices.
TIDEPOOL_API void check_device_index(int device);
// The device's allocator if it exists; else nullptr, once check_device(device) found the
// device exists. For calls that need nothing from a device tidepool never allocated on
// (stats, resets, a stream's release). Never creates one.
TIDEPOOL_API CachingAllocator* checked_existing_allocator(int device);
// Device `peer` gets read/write access to the memory tidepool maps for `device` (its
// expandable segments and pointer-stable ranges; Backend::enable_peer_access), now and
// from now on. A device with no allocator yet gets no backend (on CUDA, no context) for
// this: the peer is remembered and granted when its backend is created. Throws
// BackendError for a device or peer that does not exist, the same device twice, or a
// peer that cannot reach the device (check_peer_access); nothing changes then.
TIDEPOOL_API void enable_peer_access(int device, int peer);
// Whether enable_peer_access(device, peer) was done: granted to the device's allocator,
// or remembered for it. Throws AllocatorUsageError for an index outside 0..kMaxDevices-1.
TIDEPOOL_API bool peer_access_enabled(int device, int peer);
// Observing the segment events (Note [Segment events], segment_events.h) of every
// device's allocator, existing and future, so that an observer misses no backing an
// allocator created after it started. Counted: events flow while more observers started
// than stopped (each started log begins empty; the last stop drops what is queued).
// Observers drain existing_device_allocator(d)->segment_events(); two at once would split
// the events between them.
TIDEPOOL_API void observe_segment_events(bool on);
// "cuda", "host" or "auto". Throws AllocatorUsageError for another name, and
// std::logic_error once any device allocator exists.
TIDEPOOL_API void set_backend(std::string_view name);
// The backend kind device allocators use (resolving "auto").
TIDEPOOL_API BackendKind selected_backend();
// The backend kind of the device allocators made so far; nullopt while there are none (the
// choice is still open), found without resolving "auto", so without asking CUDA anything.
TIDEPOOL_API std::optional<BackendKind> backend_in_use();

}  // namespace tidepool
