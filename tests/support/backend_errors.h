// Helpers for tests that check how calls fail: the message an error carries (a
// BackendError probed for, or any error a call must throw), and waiting until a destroyed
// stream's handle is refused (its queued work may still run, as after cudaStreamDestroy).
// Shared by the allocator and tiering test layers.
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <source_location>
#include <string>
#include <thread>

#include "allocator/backend.h"

namespace tidepool::test_support {

// The message of the `Error` that `fn` throws; nothing if it throws none.
template <typename Error, typename Fn>
std::optional<std::string> message_of_thrown(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

// The message of the BackendError `fn` throws ("" if it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  return message_of_thrown<BackendError>(fn).value_or("");
}

// The message of the `Error` that `fn` must throw, for the test to check what it says.
// When `fn` throws none: a test failure at the caller's line, and "". An exception of
// another type propagates, failing the test as well.
template <typename Error, typename Fn>
std::string expect_error(Fn&& fn, std::source_location caller = std::source_location::current()) {
  std::optional<std::string> message = message_of_thrown<Error>(fn);
  if (!message) {
    ADD_FAILURE_AT(caller.file_name(), static_cast<int>(caller.line()))
        << "expected an exception of the type asked for; the call returned";
  }
  return message.value_or("");
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
