// A replacement of the global operator new that can be told to throw std::bad_alloc at the
// n-th allocation of the calling thread, for the tests of what an operation leaves behind
// when the C++ heap runs out part-way through it: sweep n = 0, 1, 2, ... with survives()
// until the operation goes through, checking the state after each failure.
//
// It defines the replaceable allocation functions, which a program may define once: include
// this header in exactly one translation unit of a test executable (each test_*.cpp is its
// own executable).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <utility>

namespace tidepool::test_support {

// -1: allocations succeed; n ≥ 0: the n-th allocation from now on this thread throws.
inline thread_local long allocations_until_failure = -1;
// Whether every allocation after that one throws too (a heap that stays exhausted, as a
// real one does until something is freed), or only that one.
inline thread_local bool failures_persist = false;

inline void* allocate_or_fail(std::size_t bytes) {
  if (allocations_until_failure == 0) {
    if (!failures_persist) allocations_until_failure = -1;
    throw std::bad_alloc();
  }
  if (allocations_until_failure > 0) --allocations_until_failure;
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}

// Runs `operation` on this thread with its n-th allocation failing; true when it went
// through, false when it threw (whatever it threw).
template <typename Operation>
bool survives(long n, Operation&& operation) {
  allocations_until_failure = n;
  try {
    operation();
  } catch (...) {
    allocations_until_failure = -1;
    return false;
  }
  allocations_until_failure = -1;
  return true;
}

// survives() with every allocation from the n-th on failing: what the operation does on
// its way out of a failure (putting things back) must not need the heap either.
template <typename Operation>
bool survives_exhaustion(long n, Operation&& operation) {
  failures_persist = true;
  const bool done = survives(n, std::forward<Operation>(operation));
  failures_persist = false;
  return done;
}

}  // namespace tidepool::test_support

void* operator new(std::size_t bytes) { return tidepool::test_support::allocate_or_fail(bytes); }
void* operator new[](std::size_t bytes) {
  return tidepool::test_support::allocate_or_fail(bytes);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
