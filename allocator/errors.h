// Exceptions the caching allocator throws. Following RMM: OutOfMemoryError derives from
// std::bad_alloc and is thrown only when the backend really has no memory left after
// the whole OOM policy ran; misuse (double free, a foreign pointer, a wrong size) is an
// AllocatorUsageError, a std::invalid_argument, because retrying cannot fix it.
#pragma once

#include <cstddef>
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

// An out-of-memory message as PyTorch hands it to Python: c10's own opening ("CUDA out of
// memory. Tried to allocate 2.00 GiB. "), then tidepool's message. Training tools decide
// by that text whether an error is an OOM (Lightning's batch-size finder, accelerate's
// find_executable_batch_size), so without it they would stop a run they would retry.
TIDEPOOL_API std::string pytorch_out_of_memory_message(std::size_t bytes,
                                                       const std::string& tidepool_message);

}  // namespace tidepool
