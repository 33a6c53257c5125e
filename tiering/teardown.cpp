// Teardown: best-effort release steps for destructors. See teardown.h.
#include "tiering/teardown.h"

#include <atomic>
#include <cstdio>
#include <string>
#include <utility>

namespace tidepool {

namespace {
std::atomic<std::uint64_t> g_teardown_errors{0};
}  // namespace

// A failure the same as a named one adds to its count; a new one is named while there is
// room. One whose text cannot be built (out of memory) is counted only: the line then says
// it among the unnamed rest.
void Teardown::record(const char* what, const char* message) noexcept {
  failures_++;
  g_teardown_errors.fetch_add(1, std::memory_order_relaxed);
  try {
    std::string text = std::string(what) + ": " + message;
    for (int i = 0; i < named_; ++i) {
      if (named_errors_[i] == text) {
        named_counts_[i]++;
        return;
      }
    }
    if (named_ == kNamedFailures) return;
    named_errors_[named_] = std::move(text);
    named_counts_[named_] = 1;
    named_++;
  } catch (...) {
    // Out of memory for the message: the count still says something failed.
  }
}

Teardown::~Teardown() {
  if (failures_ == 0) return;
  std::string named;
  const char* listed = nullptr;  // what is printed: named, or a fixed text without it
  int unnamed = failures_;
  try {
    for (int i = 0; i < named_; ++i) {
      if (i > 0) named += "; ";
      named += named_errors_[i];
      if (named_counts_[i] > 1) named += " (" + std::to_string(named_counts_[i]) + " times)";
      unnamed -= named_counts_[i];
    }
    if (unnamed > 0) {
      named += std::string(named_ > 0 ? "; and " : "") + std::to_string(unnamed) +
               (named_ > 0 ? " more" : " unnamed") + " failed step" + (unnamed == 1 ? "" : "s");
    }
    listed = named.c_str();
  } catch (...) {
    // A literal: assigning it to a std::string would need the heap that just ran out.
    listed = "(out of memory for the errors)";
  }
  // stdio, not iostreams: this may run during static destruction, after std::cerr's
  // own teardown order is no longer guaranteed.
  std::fprintf(stderr,
               "tidepool: %s destroyed with %d failed release step%s (the backend reported "
               "errors; what could be released was): %s\n",
               object_, failures_, failures_ == 1 ? "" : "s", listed);
}

std::uint64_t teardown_error_count() noexcept {
  return g_teardown_errors.load(std::memory_order_relaxed);
}

}  // namespace tidepool
