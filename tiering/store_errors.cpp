// The wording of TieredStore's errors (store_errors.h): what an operation that failed
// underneath reports to its caller.
//
// Note [One error type]
// Every public operation of the store reports a failure as TieringError (tiered_store.h),
// whatever layer it came from: the backend (BackendError), the memory source (the caching
// allocator's BackendError or AllocatorUsageError), the host arena, or the store's own
// checks. Its callers (the optimizer placements, the C ABI's tag calls, a user) then need
// one catch, and the message says what failed: the operation, the handle and its bytes,
// then the underlying error's message, which is also nested (std::rethrow_if_nested) for
// a caller that wants the original exception. std::bad_alloc (OutOfMemoryError among
// them) is the one exception passed through unchanged: the C ABIs report it as out of
// memory (allocator/c_api_guard.h), which a wrapper would hide, and wrapping it needs the
// memory that ran out. The store's own "no room" and "device out of memory" are
// TieringErrors, as create's doc has always said: a store's DeviceMemorySource returns
// nullptr rather than throw when out of memory. Preconditions (an unknown handle, one
// still acquired) are checked before an operation starts and throw TieringError as they
// are. release_stream keeps its documented BackendError for a failed wait.
#include "tiering/store_errors.h"

#include <exception>
#include <new>
#include <string_view>

namespace tidepool::detail {

void rethrow_as_tiering_error(const std::string& operation) {
  static constexpr std::string_view kPrefix = "tiered store: ";
  try {
    throw;
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& cause) {
    std::string_view why = cause.what();
    if (why.starts_with(kPrefix)) why.remove_prefix(kPrefix.size());  // said once, below
    std::throw_with_nested(
        TieringError(std::string(kPrefix) + operation + " failed: " + std::string(why)));
  } catch (...) {
    std::throw_with_nested(
        TieringError(std::string(kPrefix) + operation + " failed: unknown error"));
  }
}

std::string of_handle(const char* op, TieredStore::Handle h, std::size_t bytes) {
  return std::string(op) + " of handle " + std::to_string(h) + " (" + std::to_string(bytes) +
         " bytes)";
}

}  // namespace tidepool::detail
