// Teardown: best-effort release steps for destructors. See teardown.h.
#include "tiering/teardown.h"

#include <atomic>
#include <cstdio>

namespace tidepool {

namespace {
std::atomic<std::uint64_t> g_teardown_errors{0};
}  // namespace

void Teardown::record(const char* what, const char* message) noexcept {
  failures_++;
  g_teardown_errors.fetch_add(1, std::memory_order_relaxed);
  if (failures_ == 1) {
    try {
      first_error_ = std::string(what) + ": " + message;
    } catch (...) {
      // Out of memory for the message: the count still says something failed.
    }
  }
}

Teardown::~Teardown() {
  if (failures_ == 0) return;
  // stdio, not iostreams: this may run during static destruction, after std::cerr's
  // own teardown order is no longer guaranteed.
  std::fprintf(stderr,
               "tidepool: %s destroyed with %d failed release step%s (the backend reported "
               "errors; what could be released was); first: %s\n",
               object_, failures_, failures_ == 1 ? "" : "s", first_error_.c_str());
}

std::uint64_t teardown_error_count() noexcept {
  return g_teardown_errors.load(std::memory_order_relaxed);
}

}  // namespace tidepool
