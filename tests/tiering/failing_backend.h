// FailingBackend: a test backend that forwards every call to a real backend (the host
// backend; ForwardingBackend) until it is told to die; from then on every call throws
// BackendError, as the cuda backend does once its context is destroyed at process exit.
//
// fail_after(n) lets n more calls through, then fails all of them, so a test can sweep n
// and make a teardown fail at each of its steps in turn. The seam's own fault injection
// (Backend::inject_fault) fails one kind of operation a counted number of times; this
// one fails everything, for good. fail_calls_to(op, count, skip) fails chosen calls of
// one operation, of any kind (release_physical, unmap: those inject_fault cannot reach),
// so a test can fail each call an operation makes in turn. live_physicals() counts the
// physical handles created and not released, so a test sees one leaked or released twice.
// calls_to(op) counts the calls made to one operation, so a test sees one that should
// not have been made (a release_stream that waits for a stream nothing used).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "allocator/backend.h"
#include "allocator/forwarding_backend.h"

namespace tidepool::tiering_test {

class FailingBackend final : public ForwardingBackend {
 public:
  explicit FailingBackend(Backend& inner) : ForwardingBackend(inner) {}

  // After `calls` more calls, every call throws. Negative: never fail (the default).
  void fail_after(long calls) { remaining_.store(calls); }
  // Calls that failed so far.
  long failed_calls() const { return failed_.load(); }
  // Of the next calls to `op` (the Backend method's name: "release_physical"), lets `skip`
  // through, then fails `count`. Replaces what was set for `op` before; count 0 clears it.
  void fail_calls_to(const std::string& op, int count, int skip = 0) {
    std::lock_guard lock(mutex_);
    if (count <= 0) {
      chosen_.erase(op);
    } else {
      chosen_[op] = ChosenFailures{skip, count};
    }
  }
  // Calls to `op` (the Backend method's name) so far, failed ones included.
  long calls_to(const std::string& op) const {
    std::lock_guard lock(mutex_);
    auto it = calls_.find(op);
    return it == calls_.end() ? 0 : it->second;
  }
  // Physical handles created through this backend and not released yet.
  std::size_t live_physicals() const {
    std::lock_guard lock(mutex_);
    return live_.size();
  }

 private:
  struct ChosenFailures {
    int skip;
    int count;
  };

  // Consumes a failure chosen for `op` by fail_calls_to, if one is due.
  bool chosen_failure(const char* op) {
    std::lock_guard lock(mutex_);
    auto it = chosen_.find(op);
    if (it == chosen_.end()) return false;
    if (it->second.skip > 0) {
      it->second.skip--;
      return false;
    }
    if (--it->second.count == 0) chosen_.erase(it);
    return true;
  }

  void gate(const char* op) {
    {
      std::lock_guard lock(mutex_);
      ++calls_[op];
    }
    if (chosen_failure(op)) {
      failed_.fetch_add(1);
      throw BackendError(std::string("failing backend: ") + op + ": a chosen failure");
    }
    if (remaining_.load() < 0) return;
    if (remaining_.fetch_sub(1) > 0) return;
    remaining_.store(0);
    failed_.fetch_add(1);
    throw BackendError(std::string("failing backend: ") + op + ": the backend is gone");
  }

  void on_call(Call call) override { gate(call_name(call)); }
  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    const PhysicalHandle h = ForwardingBackend::do_create_physical(b, w);
    std::lock_guard lock(mutex_);
    if (h) live_.insert(h.value);
    return h;
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    ForwardingBackend::do_release_physical(h, b);
    std::lock_guard lock(mutex_);
    live_.erase(h.value);
  }

  std::atomic<long> remaining_{-1};
  std::atomic<long> failed_{0};
  mutable std::mutex mutex_;  // chosen_, calls_, live_
  std::map<std::string, ChosenFailures, std::less<>> chosen_;
  std::map<std::string, long, std::less<>> calls_;
  std::set<std::uint64_t> live_;
};

}  // namespace tidepool::tiering_test
