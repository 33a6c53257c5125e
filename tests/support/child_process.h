// What the forked-child tests (Note [Forked child] in allocator/fork_guard.h) share: the
// backend their parent allocates on, and waiting for a child without hanging the test
// when the child hangs (they check that it does not wait for what its parent's threads
// held at the fork).
#pragma once

#include <csignal>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <string_view>
#include <thread>

#include "allocator/backend.h"

namespace tidepool::test_support {

// The backend a forked-child test's parent allocates on: host, or cuda in the gpu_test_
// twins (which define TIDEPOOL_FORK_TEST_BACKEND), where the parent's CUDA context makes
// the child's refusals matter most. fork_test_backend_missing(): cuda without a GPU.
#ifndef TIDEPOOL_FORK_TEST_BACKEND
#define TIDEPOOL_FORK_TEST_BACKEND "host"
#endif
inline constexpr const char* kForkTestBackend = TIDEPOOL_FORK_TEST_BACKEND;
inline bool fork_test_backend_missing() {
  return std::string_view(kForkTestBackend) == "cuda" && cuda_device_count() == 0;
}

// The child's exit code, or -1 when it did not exit by itself within `limit` (it is
// killed then) or was killed by a signal.
inline int wait_for_child(pid_t pid, std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

}  // namespace tidepool::test_support
