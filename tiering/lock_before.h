// lock_before: takes a lock before a deadline or gives up, for the OOM reclaim path (Note
// [A busy registry in an OOM] in tiering_registry.cpp), which must not wait for ever on a
// registry or store whose holder may be waiting for the reclaiming thread.
//
// It polls try_lock instead of using a timed mutex: libstdc++'s try_lock_until on the
// steady clock calls pthread_mutex_clocklock, which GCC 12's ThreadSanitizer does not
// intercept, so TSan saw every such lock's unlock as an unlock of an unlocked mutex (and
// none of the ordering the lock gives). The path is rare (an allocation out of memory),
// so the polling costs nothing that matters.
#pragma once

#include <chrono>
#include <mutex>
#include <thread>

namespace tidepool::detail {

// Locks `lock` (which must not own its mutex) if that can be done before `deadline`; a
// deadline already past makes it one try_lock. Returns whether it owns the lock.
template <typename Mutex>
bool lock_before(std::unique_lock<Mutex>& lock, std::chrono::steady_clock::time_point deadline) {
  if (lock.try_lock()) return true;
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (lock.try_lock()) return true;
  }
  return false;
}

}  // namespace tidepool::detail
