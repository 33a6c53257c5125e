// Marks a child forked after tidepool made an allocator, and the refusal its calls get
// (Note [Forked child] in fork_guard.h).
#include "allocator/fork_guard.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace tidepool {
namespace {

std::atomic<bool> g_forked_child{false};
std::atomic<pid_t> g_parent{0};  // the process that forked this one, once marked

// Runs in the child right after fork, on the one thread it has: async-signal-safe only.
void on_fork_child() {
  g_parent.store(getppid(), std::memory_order_relaxed);
  g_forked_child.store(true, std::memory_order_release);
}

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
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, &on_fork_child); });
}

}  // namespace tidepool
