// StreamGate: a host function that holds a stream until the test opens it. Enqueue
// launch_host_func(s, &StreamGate::wait, &gate); work enqueued on `s` after it runs only
// once open() is called, so ordering tests (allocator backend battery, tiered store
// write-backs) can hold one stream and check that what must wait for it has not run.
// Shared by the allocator and tiering test layers.
#pragma once

#include <condition_variable>
#include <mutex>

namespace tidepool::test_support {

struct StreamGate {
  std::mutex mutex;
  std::condition_variable opened_cv;
  bool opened = false;

  static void wait(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    std::unique_lock lock(gate->mutex);
    gate->opened_cv.wait(lock, [gate] { return gate->opened; });
  }
  void open() {
    {
      std::lock_guard lock(mutex);
      opened = true;
    }
    opened_cv.notify_all();
  }

  // Opens the gate when the scope ends, so a failed ASSERT does not leave a stream held.
  struct OpenOnExit {
    StreamGate& gate;
    ~OpenOnExit() { gate.open(); }
  };
};

}  // namespace tidepool::test_support
