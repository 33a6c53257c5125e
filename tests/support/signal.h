// Signal: a one-shot flag that threads wait for. Tests use it to order threads and host
// functions without sleeping: one side waits until the other has set it, and it stays set.
// StreamGate (stream_gate.h) holds a stream on one; the stand-in libcudart's host-backend
// streams (tests/python/host_streams.cpp) record events as them.
#pragma once

#include <condition_variable>
#include <mutex>

namespace tidepool::test_support {

class Signal {
 public:
  void set() {
    {
      std::lock_guard lock(mutex_);
      set_ = true;
    }
    changed_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return set_; });
  }
  bool is_set() {
    std::lock_guard lock(mutex_);
    return set_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool set_ = false;
};

}  // namespace tidepool::test_support
