// Counts of the optimizer steps in flight on each device, over all threads and on this
// one (steps_in_flight.h).
//
// Note [Steps of other threads]
// When the device runs out of memory, the allocator's OOM policy moves optimizer state in
// pointer-stable ranges to the host (Note [State pushed out under pressure] in
// tiering_registry.cpp). Each move waits for the streams that used the range up to that
// moment, then copies, unmaps and maps again. That is safe for the thread that ran out:
// it is inside the allocation, enqueueing nothing. Another thread whose optimizer step is
// in flight on the device goes on enqueueing kernels on that state meanwhile (two models
// trained in two threads, which the Python hooks support: Note [steps in flight] in
// python/src/tidepool/_in_flight.py): writes landing in the old backing after the copy
// would be lost, and a kernel between the unmap and the map would fault (review finding).
// So the Python hooks report each step's begin and end here, and while a thread other
// than the one that ran out has a step in flight on the device, the OOM policy moves no
// state there: the allocation fails as it would without tiering, the state intact, and
// the hooks' own eviction after the steps moves it as usual. The thread's own steps do
// not hold it back (a step that runs out of memory in its foreach temporaries still
// pushes state out and goes on). A step whose closure runs is counted out meanwhile (the
// hooks end it before the closure and begin it again after): it enqueues nothing on its
// state then, and the closure's backward runs on PyTorch's autograd threads, whose
// out-of-memory would otherwise take it for another thread's step. The ranges are asked
// about before each one moves, as a step may begin while earlier ones move.
#include "tiering/steps_in_flight.h"

#include <atomic>
#include <string>

#include "allocator/backend.h"
#include "tiering/tiered_store.h"

namespace tidepool {

namespace {
std::atomic<int> g_steps[kMaxDevices];

// This thread's steps; what a thread that ends with steps still counted (an unguarded
// step that raised, its scope never closed) leaves is taken out of the totals, or every
// later out-of-memory on the device would take it for a step in flight.
struct ThreadSteps {
  int n[kMaxDevices] = {};
  ~ThreadSteps() {
    for (int d = 0; d < kMaxDevices; ++d) {
      if (n[d] > 0) g_steps[d].fetch_sub(n[d], std::memory_order_acq_rel);
    }
  }
};
thread_local ThreadSteps t_steps;

void check_device_index(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw TieringError("tiering: a step on device " + std::to_string(device) +
                       ", outside 0.." + std::to_string(kMaxDevices - 1));
  }
}
}  // namespace

void note_step_begin(int device) {
  check_device_index(device);
  ++t_steps.n[device];
  g_steps[device].fetch_add(1, std::memory_order_acq_rel);
}

void note_step_end(int device) {
  check_device_index(device);
  if (t_steps.n[device] == 0) return;
  --t_steps.n[device];
  g_steps[device].fetch_sub(1, std::memory_order_acq_rel);
}

int steps_in_flight(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return 0;
  return g_steps[device].load(std::memory_order_acquire);
}

bool steps_of_other_threads(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return false;
  return g_steps[device].load(std::memory_order_acquire) > t_steps.n[device];
}

}  // namespace tidepool
