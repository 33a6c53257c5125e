// What libtidepool's two C ABIs (allocator/c_api.cpp, tiering/c_api_tiering.cpp) share
// at their boundary: turning an exception into a failure value plus a message in the
// calling thread's tidepool_last_error() slot, and handing a string to a C caller.
// Internal (not installed); both users are compiled into libtidepool.so, where the two
// functions below are defined (allocator/c_api.cpp, next to set_last_error).
#pragma once

#include <string>

namespace tidepool::detail {

// How one C ABI words and shows the errors that reach it.
struct CErrorStyle {
  // Non-null: messages read "<prefix>: <what>" (the tiering ABI names the entry point).
  const char* prefix = nullptr;
  // Also print every error but out-of-memory on stderr (the allocator ABI: a caller of
  // tidepool_free, which returns void, sees no status).
  bool print = false;
};

// Records the exception being handled as the thread's last error: out-of-memory with its
// own message, std::bad_alloc as "out of host memory for bookkeeping", another
// std::exception with its what(), anything else as "unknown error". Call only inside a
// catch block.
void record_current_exception(const CErrorStyle& style) noexcept;

// Runs fn; when it throws, records the exception (record_current_exception) and returns
// `failed`, so that no C++ exception unwinds into a C caller or PyTorch.
template <class R, class Fn>
R guarded(const CErrorStyle& style, R failed, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (...) {
    record_current_exception(style);
  }
  return failed;
}

// A malloc'd, NUL-terminated copy of s, which the C caller frees with
// tidepool_string_free (free). Throws std::bad_alloc when malloc fails.
char* malloc_c_string(const std::string& s);

}  // namespace tidepool::detail
