// Exceptions the caching allocator throws. Following RMM: OutOfMemoryError derives from
// std::bad_alloc and is thrown only when the backend really has no memory left after
// the whole OOM policy ran; misuse (double free, a foreign pointer, a wrong size) is an
// AllocatorUsageError, a std::invalid_argument, because retrying cannot fix it.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "allocator/export.h"

namespace tidepool {

class TIDEPOOL_API OutOfMemoryError : public std::bad_alloc {
 public:
  explicit OutOfMemoryError(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class TIDEPOOL_API AllocatorUsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace tidepool
