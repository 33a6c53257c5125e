// Marks a child forked after tidepool made an allocator, and the refusal its calls get
// (Note [Forked child] in fork_guard.h).
#include "allocator/fork_guard.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

namespace tidepool {
namespace {

std::atomic<bool> g_forked_child{false};
std::atomic<bool> g_allocator_in_use{false};
std::atomic<pid_t> g_parent{0};  // the process that forked this one, once marked

std::atomic<bool (*)()> g_registry_busy{nullptr};

// Runs in the child right after fork, on the one thread it has: async-signal-safe only
// (atomics, getppid, and the registry's probe: a try-lock).
void on_fork_child() {
  bool (*busy)() = g_registry_busy.load(std::memory_order_acquire);
  if (!g_allocator_in_use.load(std::memory_order_acquire) && (busy == nullptr || !busy())) {
    return;
  }
  g_parent.store(getppid(), std::memory_order_relaxed);
  g_forked_child.store(true, std::memory_order_release);
}

// Registered when libtidepool is loaded, so that it runs for a fork that comes while the
// first allocator is being made.
const bool g_registered = [] {
  pthread_atfork(nullptr, nullptr, &on_fork_child);
  return true;
}();

}  // namespace

bool in_forked_child() noexcept { return g_forked_child.load(std::memory_order_acquire); }

void refuse_in_forked_child() {
  if (!in_forked_child()) return;
  throw ForkedChildError(
      "tidepool: this process was forked from process " +
      std::to_string(g_parent.load(std::memory_order_relaxed)) +
      " after tidepool had allocated device memory there; a forked child cannot use CUDA "
      "or tidepool's allocator (its frees are ignored: the memory is the parent's). Start "
      "processes that use the GPU with the 'spawn' or 'forkserver' start method (e.g. "
      "torch.multiprocessing.set_start_method('spawn'), or DataLoader(..., "
      "multiprocessing_context='spawn'))");
}

void detail::note_allocator_in_use() noexcept {
  g_allocator_in_use.store(true, std::memory_order_release);
}

void detail::watch_registry_at_fork(bool (*busy)()) noexcept {
  g_registry_busy.store(busy, std::memory_order_release);
}

}  // namespace tidepool
