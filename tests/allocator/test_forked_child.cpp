// Note [Forked child] (allocator/fork_guard.h): a process forked after tidepool made an
// allocator frees nothing and refuses every other call but the tag calls before it takes
// a lock or waits for a stream (here: a stream the parent's gate holds, which no thread
// in the child will ever run); its parent is untouched; a process forked before tidepool
// was used starts afresh, unless another thread held the device registry's lock at the
// fork; a child that ends through exit() does not wait for the locks a parent thread held.
// Tags work in any child, also one forked while another thread looked a name up
// (Note [Tags across fork] in allocator/tags.cpp).
// Runs on the host backend, whose stream threads, like CUDA, do not survive a fork.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/fork_guard.h"
#include "tests/support/child_process.h"
#include "tests/support/held_allocator_lock.h"
#include "tests/support/stream_gate.h"

namespace {

using tidepool::test_support::StreamGate;
using tidepool::test_support::fork_test_backend_missing;
using tidepool::test_support::kForkTestBackend;
using tidepool::test_support::wait_for_child;

// The child's checks, each failure its own exit code (the parent reports which).
enum ChildResult : int {
  kChildPassed = 0,
  kFreeSetAnError = 10,
  kMallocServed,
  kMallocErrorUnclear,
  kReleaseStreamServed,
  kEmptyCacheServed,
  kStatsServed,
  kTagPushRefused,
  kPushedTagNotCurrent,
  kTagLookupRefused,
  kTagCreationRefused,
  kTagPopRefused,
  kCurrentTagNotRestored,
  kNotMarked,
  kCppAllocatorServed,
};

bool mentions(const char* message, const char* what) {
  return message != nullptr && std::strstr(message, what) != nullptr;
}

int child_checks(void* parents_block, void* gated_stream) {
  // The C ABI's answer too: the LD_PRELOAD shim asks it (tidepool_in_forked_child).
  if (!tidepool::in_forked_child() || tidepool_in_forked_child() != 1) return kNotMarked;
  tidepool_clear_error();
  tidepool_free(parents_block, 4096, 0, gated_stream);  // would wait for nothing, lock nothing
  if (*tidepool_last_error() != '\0') return kFreeSetAnError;
  tidepool_pytorch_free(parents_block, 4096, 0, gated_stream);
  if (*tidepool_last_error() != '\0') return kFreeSetAnError;
  if (tidepool_malloc(4096, 0, nullptr) != nullptr) return kMallocServed;
  const char* why = tidepool_last_error();
  if (!mentions(why, "forked") || !mentions(why, "spawn")) return kMallocErrorUnclear;
  // The parent's gate holds this stream and nothing in the child runs it: a call that
  // waited for it would never return (the parent then kills the child and fails).
  if (tidepool_release_stream(0, gated_stream) != -1) return kReleaseStreamServed;
  if (tidepool_empty_cache(0) != -1) return kEmptyCacheServed;
  tidepool_stats_v1 stats{};
  stats.struct_size = sizeof stats;
  if (tidepool_get_stats_v1(0, &stats) != -1) return kStatsServed;
  // Tags are the thread's and the table's, not the allocator's: they work.
  const int tag = tidepool_tag_current();
  if (tidepool_tag_push(TIDEPOOL_TAG_WORKSPACE) != 0) return kTagPushRefused;
  if (tidepool_tag_current() != TIDEPOOL_TAG_WORKSPACE) return kPushedTagNotCurrent;
  if (tidepool_tag_id("optimizer_state") != TIDEPOOL_TAG_OPTIMIZER_STATE) {
    return kTagLookupRefused;
  }
  if (tidepool_tag_id("made_in_a_forked_child") < TIDEPOOL_TAG_FIRST_USER) {
    return kTagCreationRefused;
  }
  if (tidepool_tag_pop() != 0) return kTagPopRefused;
  if (tidepool_tag_current() != tag) return kCurrentTagNotRestored;
  try {
    tidepool::device_allocator(0);
    return kCppAllocatorServed;
  } catch (const tidepool::ForkedChildError&) {
  }
  return kChildPassed;
}

TEST(ForkedChild, FreesNothingAndRefusesTheRestWithoutWaitingOrLocking) {
  if (fork_test_backend_missing()) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(tidepool_set_backend(kForkTestBackend), 0);
  void* block = tidepool_malloc(4096, 0, nullptr);
  ASSERT_NE(block, nullptr) << tidepool_last_error();
  tidepool::Backend& backend = tidepool::device_allocator(0).backend();
  const tidepool::Stream gated = backend.create_stream();
  StreamGate gate;
  {
    StreamGate::OpenOnExit open_on_exit{gate};
    backend.launch_host_func(gated, &StreamGate::wait, &gate);
    // Memory cached for the gated stream: releasing the stream waits for it.
    void* on_gated = tidepool_malloc(1 << 20, 0, gated.handle);
    ASSERT_NE(on_gated, nullptr) << tidepool_last_error();
    tidepool_free(on_gated, 1 << 20, 0, gated.handle);
    const tidepool_stats_v1 before = [] {
      tidepool_stats_v1 s{};
      s.struct_size = sizeof s;
      EXPECT_EQ(tidepool_get_stats_v1(0, &s), 0) << tidepool_last_error();
      return s;
    }();

    std::fflush(nullptr);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) _exit(child_checks(block, gated.handle));
    const int result = wait_for_child(pid);
    EXPECT_EQ(result, kChildPassed) << "-1: the child hung (killed after 30 s); else see "
                                       "ChildResult";

    // The parent: not marked, its block still allocated, its allocator serving.
    EXPECT_FALSE(tidepool::in_forked_child());
    EXPECT_EQ(tidepool_in_forked_child(), 0);
    tidepool_stats_v1 after{};
    after.struct_size = sizeof after;
    ASSERT_EQ(tidepool_get_stats_v1(0, &after), 0) << tidepool_last_error();
    EXPECT_EQ(after.allocated.current, before.allocated.current);
    EXPECT_EQ(after.alloc_count, before.alloc_count);
  }
  EXPECT_EQ(tidepool_release_stream(0, gated.handle), 0) << tidepool_last_error();
  tidepool_clear_error();
  tidepool_free(block, 4096, 0, nullptr);
  EXPECT_STREQ(tidepool_last_error(), "");
  backend.destroy_stream(gated);
}

// A child that leaves through exit() (a forked Python process ending normally) runs its
// thread's destructors, the thread cache list's among them: it must not wait for the locks
// a parent thread held at the fork (here empty_cache, waiting under the allocator's lock for
// the stream the gate holds, whose freed block it gives back), which no thread in the child
// will release. (A release of the stream no longer waits under the lock.)
TEST(ForkedChild, AChildThatExitsNormallyDoesNotWaitForTheParentsLocks) {
  if (fork_test_backend_missing()) GTEST_SKIP() << "no CUDA device";
  tidepool_set_backend(kForkTestBackend);  // refused once an earlier test made the allocator
  void* small = tidepool_malloc(512, 0, nullptr);  // this thread's cache exists
  ASSERT_NE(small, nullptr) << tidepool_last_error();
  tidepool_free(small, 512, 0, nullptr);
  const tidepool::test_support::HeldAllocatorLock held;
  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) std::exit(0);
  EXPECT_EQ(wait_for_child(pid, std::chrono::seconds(20)), 0)
      << "-1: the child hung in exit() (killed after 20 s)";
}

TEST(ForkedChild, AProcessForkedBeforeTidepoolWasUsedStartsAfresh) {
  // A fresh process (the death test re-runs this binary for this test alone), where no
  // allocator exists yet when it forks.
  // On the host backend in both builds: asking whether a GPU exists would initialise CUDA
  // in the process that forks, which is what this test must not have done.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (tidepool::existing_device_allocator(0) != nullptr) _exit(3);
        std::fflush(nullptr);
        const pid_t pid = fork();
        if (pid == 0) {
          if (tidepool::in_forked_child() || tidepool_in_forked_child() != 0) _exit(4);
          if (tidepool_set_backend("host") != 0) _exit(5);
          void* p = tidepool_malloc(4096, 0, nullptr);
          if (p == nullptr) _exit(6);
          tidepool_free(p, 4096, 0, nullptr);
          _exit(*tidepool_last_error() == '\0' ? 0 : 7);
        }
        _exit(pid < 0 ? 8 : wait_for_child(pid) == 0 ? 0 : 9);
      },
      ::testing::ExitedWithCode(0), "");
}

// A child forked while another thread holds the device registry's lock (here a thread
// checks the device without pause, before any allocator exists) is marked and refuses,
// rather than waiting for that lock, which no thread of it would release; one forked
// while the lock is free starts afresh and allocates.
TEST(ForkedChild, AChildForkedWhileTheRegistryIsLockedIsMarkedNotHung) {
#if defined(__SANITIZE_THREAD__)
  // A child that starts afresh starts the host backend's threads, which TSan refuses
  // after a fork of a process with threads.
  GTEST_SKIP() << "TSan does not support threads started in a child of a threaded fork";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (tidepool::existing_device_allocator(0) != nullptr) _exit(3);
        if (tidepool_set_backend("host") != 0) _exit(4);
        std::atomic<bool> stop{false};
        std::thread checker([&] {
          while (!stop.load()) tidepool::check_device(0);
        });
        int marked = 0;
        int outcome = 0;
        for (int i = 0; i < 200 && outcome == 0; ++i) {
          std::fflush(nullptr);
          const pid_t pid = fork();
          if (pid == 0) {
            if (void* p = tidepool_malloc(4096, 0, nullptr)) {
              tidepool_free(p, 4096, 0, nullptr);
              _exit(10);  // afresh
            }
            _exit(tidepool_in_forked_child() == 1 ? 11 : 12);
          }
          const int r = pid < 0 ? -2 : wait_for_child(pid, std::chrono::seconds(10));
          if (r == 11) {
            marked++;
          } else if (r != 10) {
            outcome = r == -1 ? 20 : 21;  // 20: a child hung
          }
        }
        stop = true;
        checker.join();
        // Some forks came while the lock was held (else the test showed nothing).
        _exit(outcome != 0 ? outcome : marked > 0 ? 0 : 22);
      },
      ::testing::ExitedWithCode(0), "");
}

// Note [Tags across fork]: a child forked while another thread looks tag names up
// (each lookup holds the table's lock) finds the lock free and looks up and makes names,
// rather than waiting for a lock no thread of it would release.
TEST(ForkedChild, AChildForkedWhileTagsAreLookedUpUsesTagsNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::atomic<bool> stop{false};
        std::thread looker([&] {
          while (!stop.load()) tidepool_tag_id("looked_up_without_pause");
        });
        int outcome = 0;
        for (int i = 0; i < 200 && outcome == 0; ++i) {
          std::fflush(nullptr);
          const pid_t pid = fork();
          if (pid == 0) {
            const int made = tidepool_tag_id("made_in_the_child");
            const int found = tidepool_tag_id("looked_up_without_pause");
            _exit(made >= TIDEPOOL_TAG_FIRST_USER && found >= TIDEPOOL_TAG_FIRST_USER ? 0 : 10);
          }
          const int r = pid < 0 ? -2 : wait_for_child(pid, std::chrono::seconds(10));
          if (r != 0) outcome = r == -1 ? 20 : 21;  // 20: a child hung
        }
        stop = true;
        looker.join();
        _exit(outcome);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
