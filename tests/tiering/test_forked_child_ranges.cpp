// Note [Forked child] (allocator/fork_guard.h) for the tiering layer: a process forked
// after tidepool made an allocator frees a pointer-stable range (through tidepool_free
// and tidepool_vmm_free) at once, without waiting for the streams that used it (here one
// its parent's gate holds: no thread in the child will ever run it), and refuses to
// move ranges; the parent's ranges are untouched. Host backend.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tests/support/child_process.h"
#include "tests/support/stream_gate.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/c_api_tiering.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using test_support::StreamGate;
using test_support::fork_test_backend_missing;
using test_support::kForkTestBackend;
using test_support::wait_for_child;
using tiering_test::kMiB;

enum ChildResult : int {
  kChildPassed = 0,
  kFreeSetAnError = 10,
  kVmmFreeFailed,
  kEvictServed,
  kPrefetchServed,
  kVmmMallocServed,
};

int child_checks(void* routed, void* from_vmm_malloc) {
  tidepool_clear_error();
  tidepool_free(routed, 2 * kMiB, 0, nullptr);  // a range its gated stream used
  if (*tidepool_last_error() != '\0') return kFreeSetAnError;
  if (tidepool_vmm_free(from_vmm_malloc, 0) != 0) return kVmmFreeFailed;
  if (tidepool_evict_ptr(0, routed) != -1) return kEvictServed;
  if (tidepool_prefetch_tag(0, kTagOptimizerState, nullptr) != -1) return kPrefetchServed;
  if (tidepool_vmm_malloc(2 * kMiB, 0, kTagOptimizerState, nullptr) != nullptr) {
    return kVmmMallocServed;
  }
  return kChildPassed;
}

TEST(ForkedChildRanges, AreFreedAtOnceWithoutWaitingForTheirStreams) {
  if (fork_test_backend_missing()) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(tidepool_set_backend(kForkTestBackend), 0);
  Backend& backend = device_allocator(0).backend();
  const Stream gated = backend.create_stream();
  StreamGate gate;
  void* routed = nullptr;
  void* from_vmm_malloc = nullptr;
  {
    StreamGate::OpenOnExit open_on_exit{gate};
    backend.launch_host_func(gated, &StreamGate::wait, &gate);
    ASSERT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
    routed = tidepool_malloc(2 * kMiB, 0, gated.handle);
    ASSERT_EQ(tidepool_tag_pop(), 0);
    from_vmm_malloc = tidepool_vmm_malloc(2 * kMiB, 0, kTagOptimizerState, gated.handle);
    ASSERT_TRUE(routed && from_vmm_malloc) << tidepool_last_error();
    ASSERT_EQ(tidepool_vmm_owns(routed, 0), 1) << "not a pointer-stable range";
    ASSERT_EQ(tidepool_vmm_record_stream(from_vmm_malloc, 0, gated.handle), 0)
        << tidepool_last_error();
    // Written through the seam: on cuda the range is device memory.
    const std::vector<unsigned char> pattern(2 * kMiB, 0x3c);
    const Stream writer = backend.create_stream();
    backend.copy_async(routed, pattern.data(), pattern.size(), CopyKind::host_to_device, writer);
    backend.stream_synchronize(writer);
    backend.destroy_stream(writer);

    std::fflush(nullptr);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) _exit(child_checks(routed, from_vmm_malloc));
    EXPECT_EQ(wait_for_child(pid), kChildPassed)
        << "-1: the child hung (killed after 30 s); else see ChildResult";

    // The parent's ranges: still owned, their contents as written.
    EXPECT_EQ(tidepool_vmm_owns(routed, 0), 1);
    EXPECT_EQ(tidepool_vmm_owns(from_vmm_malloc, 0), 1);
    std::vector<unsigned char> read_back(2 * kMiB);
    const Stream reader = backend.create_stream();
    backend.copy_async(read_back.data(), routed, read_back.size(), CopyKind::device_to_host,
                       reader);
    backend.stream_synchronize(reader);
    backend.destroy_stream(reader);
    EXPECT_EQ(read_back, pattern);
  }
  ::testing::internal::CaptureStderr();
  tidepool_free(routed, 2 * kMiB, 0, nullptr);
  EXPECT_EQ(tidepool_vmm_free(from_vmm_malloc, 0), 0) << tidepool_last_error();
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(tidepool_release_stream(0, gated.handle), 0) << tidepool_last_error();
  backend.destroy_stream(gated);
}

}  // namespace
}  // namespace tidepool
