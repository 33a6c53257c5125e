// HeldAllocatorLock: a parent thread holds device 0's caching-allocator lock (in
// tidepool_empty_cache, which gives back a block freed on a stream a gate holds, and so
// waits for that stream under the lock) until the object goes. What the forked-child tests
// fork under (Note [Forked child] in allocator/fork_guard.h): a child must not wait for a
// lock no thread of its own will release.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "tests/support/stream_gate.h"

namespace tidepool::test_support {

class HeldAllocatorLock {
 public:
  HeldAllocatorLock() {
    backend_.launch_host_func(gated_, &StreamGate::wait, &gate_);
    tidepool_free(tidepool_malloc(1 << 20, 0, gated_.handle), 1 << 20, 0, gated_.handle);
    std::atomic<bool> started{false};
    emptying_ = std::thread([&started] {
      started = true;
      tidepool_empty_cache(0);  // waits for the gate, holding the allocator's lock
    });
    while (!started) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // inside the wait by now
  }
  ~HeldAllocatorLock() {
    gate_.open();
    emptying_.join();
    (void)tidepool_release_stream(0, gated_.handle);
    backend_.destroy_stream(gated_);
  }
  HeldAllocatorLock(const HeldAllocatorLock&) = delete;
  HeldAllocatorLock& operator=(const HeldAllocatorLock&) = delete;

 private:
  Backend& backend_ = device_allocator(0).backend();
  const Stream gated_ = backend_.create_stream();
  StreamGate gate_;
  std::thread emptying_;
};

}  // namespace tidepool::test_support
