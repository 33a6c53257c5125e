// Helpers for tests that check how the backend seam fails: the message a BackendError
// carries, and waiting until a destroyed stream's handle is refused (its queued work may
// still run, as after cudaStreamDestroy). Shared by the allocator and tiering test layers.
#pragma once

#include <string>
#include <thread>

#include "allocator/backend.h"

namespace tidepool::test_support {

// The message of the BackendError `fn` throws ("" if it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const BackendError& e) {
    return e.what();
  }
  return "";
}

// Returns once `backend` refuses to record an event on `stream`: a stream being destroyed
// on another thread has a dead handle from then on.
inline void wait_until_stream_handle_is_dead(Backend& backend, Stream stream) {
  const Event probe = backend.create_event();
  while (error_of([&] { backend.record_event(probe, stream); }).empty()) {
    std::this_thread::yield();
  }
  backend.destroy_event(probe);
}

}  // namespace tidepool::test_support
