// Waiting for a forked child in a test, without hanging the test when the child hangs:
// the forked-child tests (Note [Forked child] in allocator/fork_guard.h) check that a
// child does not wait for what its parent's threads held at the fork.
#pragma once

#include <csignal>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

namespace tidepool::test_support {

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
