// The optimizer steps in flight on each device, per thread, as the Python hooks report
// them (tidepool_step_begin / tidepool_step_end): what lets an out-of-memory on one thread
// leave alone the optimizer state another thread's step is using (Note [Steps of other
// threads] in steps_in_flight.cpp).
//
// Thread-safety: every function may be called from any thread; a step's end is reported
// on the thread that reported its begin.
#pragma once

#include "allocator/export.h"

namespace tidepool {

// A step begins / ends on `device` on the calling thread. Throws TieringError for a
// device outside 0..kMaxDevices-1. An end without a begin on this thread changes nothing.
TIDEPOOL_API void note_step_begin(int device);
TIDEPOOL_API void note_step_end(int device);
// Steps in flight on `device`, over all threads (0 for a device outside the range).
TIDEPOOL_API int steps_in_flight(int device) noexcept;
// Whether a thread other than the calling one has a step in flight on `device`.
TIDEPOOL_API bool steps_of_other_threads(int device) noexcept;

}  // namespace tidepool
