// StreamGate: a host function that holds a stream until the test opens it. Enqueue
// launch_host_func(s, &StreamGate::wait, &gate); work enqueued on `s` after it runs only
// once open() is called, so ordering tests (allocator backend battery, tiered store
// write-backs) can hold one stream and check that what must wait for it has not run.
// Shared by the allocator and tiering test layers.
#pragma once

#include "tests/support/signal.h"

namespace tidepool::test_support {

struct StreamGate {
  Signal opened;

  static void wait(void* self) { static_cast<StreamGate*>(self)->opened.wait(); }
  void open() { opened.set(); }

  // Opens the gate when the scope ends, so a failed ASSERT does not leave a stream held.
  struct OpenOnExit {
    StreamGate& gate;
    ~OpenOnExit() { gate.open(); }
  };
};

}  // namespace tidepool::test_support
