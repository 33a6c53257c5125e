// What libtidepool's C ABIs (allocator/c_api.cpp, allocator/pytorch_stats.cpp,
// tiering/c_api_tiering.cpp) share at their boundary: turning an exception into a failure
// value plus a message in the calling thread's tidepool_last_error() slot, handing a string
// to a C caller, and filling a caller's versioned stats struct.
// Internal (not installed); every user is compiled into libtidepool.so, where the two
// functions below are defined (allocator/c_api.cpp, next to set_last_error).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "allocator/c_api.h"
#include "allocator/fork_guard.h"
#include "allocator/stats.h"

namespace tidepool::detail {

// How one C ABI words and shows the errors that reach it.
struct CErrorStyle {
  // Non-null: messages read "<prefix>: <what>" (the tiering ABI names the entry point).
  const char* prefix = nullptr;
  // Also print every error but out-of-memory on stderr (the allocator ABI: a caller of
  // tidepool_free, which returns void, sees no status).
  bool print = false;
  // Whether a forked child's call fails before it runs (Note [Forked child] in
  // fork_guard.h); the tag calls run there (Note [Tags across fork] in tags.cpp).
  bool forked_child_refused = true;
};

// Records the exception being handled as the thread's last error: out-of-memory with its
// own message, std::bad_alloc as "out of host memory for bookkeeping", another
// std::exception with its what(), anything else as "unknown error". Call only inside a
// catch block.
void record_current_exception(const CErrorStyle& style) noexcept;

// Runs fn; when it throws, records the exception (record_current_exception) and returns
// `failed`, so that no C++ exception unwinds into a C caller or PyTorch. In a forked
// child fn does not run, unless the style says otherwise: the call fails (Note [Forked
// child] in fork_guard.h).
template <class R, class Fn>
R guarded(const CErrorStyle& style, R failed, Fn&& fn) noexcept {
  try {
    if (style.forked_child_refused) refuse_in_forked_child();
    return fn();
  } catch (...) {
    record_current_exception(style);
  }
  return failed;
}

// The allocator ABI's way: plain messages, misuse printed on stderr too.
inline constexpr CErrorStyle kAllocatorErrorStyle{nullptr, true};

// Note [Versioned structs]: a C stats struct (tidepool_stats_v1, ...) starts with
// `uint32_t struct_size`, which the caller sets to the size it was built with. Fields are
// only ever appended, so tidepool fills the prefix that size covers, and a caller built
// against an older, shorter version keeps working. Throws std::invalid_argument naming
// `type` when `out` is NULL or its struct_size is below `min_size` (the first version's).
template <class T>
void check_versioned_struct(const T* out, std::uint32_t min_size, const char* type) {
  if (out == nullptr) throw std::invalid_argument(std::string(type) + " pointer is NULL");
  if (out->struct_size < min_size)
    throw std::invalid_argument(std::string(type) + ".struct_size is less than " +
                                std::to_string(min_size) + " (it is " +
                                std::to_string(out->struct_size) + "); set it to sizeof(" + type +
                                ") = " + std::to_string(sizeof(T)));
}
// Copies the prefix of `full` that out->struct_size covers into `out` (checked first).
template <class T>
void copy_versioned_struct(T* out, T full) {
  const auto n = std::min<std::uint32_t>(out->struct_size, static_cast<std::uint32_t>(sizeof(T)));
  full.struct_size = n;
  std::memcpy(out, &full, n);
}

inline tidepool_stat_v1 to_c_stat(const Stat& s) {
  return {s.current, s.peak, s.allocated, s.freed};
}

// A malloc'd, NUL-terminated copy of s, which the C caller frees with
// tidepool_string_free (free). Throws std::bad_alloc when malloc fails.
char* malloc_c_string(const std::string& s);

}  // namespace tidepool::detail
