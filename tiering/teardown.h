// Destructors that never throw and never abort, even when the backend is gone.
//
// A tiering object (TieredStore, CopyEngine, VmmPool, HostArena) releases backend
// resources in its destructor: it synchronises streams, destroys events, unmaps ranges.
// When the backend fails there (a CUDA context already destroyed at process exit, a
// device that hit a sticky error), an exception escaping a destructor would terminate
// the process. So each release step runs through Teardown::attempt: a failure is
// counted and the next step still runs, so everything that can be released is. When the
// object's teardown ends with failures, it writes one line to stderr naming the object,
// the number of failed steps and each distinct failure (the step and its error, with how
// often it happened) up to kNamedFailures of them, then how many more failed, and adds
// them to a process-wide count (teardown_error_count, for tests and diagnostics). Every
// failure is named, not only the first: when several ranges or buffers fail, the first
// error alone hides whether the rest failed the same way or for another reason.
//
// Thread-safety: a Teardown is used by one destructor on one thread; the process-wide
// count is atomic.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include "allocator/export.h"

namespace tidepool {

class TIDEPOOL_API Teardown {
 public:
  // `object` names what is being destroyed in the stderr line ("tiered store").
  explicit Teardown(const char* object) noexcept : object_(object) {}
  // Writes the stderr line if any step failed.
  ~Teardown();
  Teardown(const Teardown&) = delete;
  Teardown& operator=(const Teardown&) = delete;

  // Runs `step`; an exception it throws is recorded under `what`, never propagated.
  // Returns true when the step succeeded.
  template <typename Step>
  bool attempt(const char* what, Step&& step) noexcept {
    try {
      step();
      return true;
    } catch (const std::exception& e) {
      record(what, e.what());
    } catch (...) {
      record(what, "unknown exception");
    }
    return false;
  }

  int failures() const { return failures_; }

  // Distinct failures the stderr line names; more are counted, not named, so a teardown
  // of thousands of ranges still writes one readable line.
  static constexpr int kNamedFailures = 4;

 private:
  void record(const char* what, const char* message) noexcept;

  const char* object_;
  int failures_ = 0;
  int named_ = 0;  // entries used in named_errors_
  std::string named_errors_[kNamedFailures];  // "step: error", distinct, in order of failure
  int named_counts_[kNamedFailures] = {};     // how often each happened
};

// Failed teardown steps in this process so far (all objects together).
TIDEPOOL_API std::uint64_t teardown_error_count() noexcept;

}  // namespace tidepool
