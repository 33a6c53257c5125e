// HostArena when the C++ heap runs out part-way through an allocation: a direct pinned
// mapping (its table entry, the backend's registration bookkeeping) and a pageable
// fallback (the recorded reason, the warning's text). This binary replaces operator new
// (tests/support/failing_operator_new.h) and sweeps the allocation that fails, once or
// from then on, until the allocation goes through. After a failure nothing is mapped,
// charged or counted: the budget is whole for the next allocation.
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/failing_operator_new.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/host_arena.h"

namespace tidepool {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kBytes = 8 * kMiB;  // above the direct threshold
constexpr long kMaxAllocations = 10000;

void expect_nothing_held(const HostArenaStats& s, const std::string& when) {
  EXPECT_EQ(s.pinned_in_use_bytes, 0u) << when;
  EXPECT_EQ(s.pinned_registered_bytes, 0u) << when << ": a charge or a mapping was kept";
  EXPECT_EQ(s.direct_count, 0u) << when;
  EXPECT_EQ(s.pageable_in_use_bytes, 0u) << when << ": a pageable block no one holds";
}

// Review findings: a std::bad_alloc inside the backend's host_register kept the direct
// mapping, its table entry and its charge for good (nothing could free them); one while
// recording the pageable fallback's reason or building its warning leaked the block, and
// pageable_in_use_bytes stayed up.
TEST(HostArenaAllocationFailures, AnAllocationThatRunsOutOfHeapLeavesNothingBehind) {
  for (const bool pageable : {false, true}) {
    for (const bool exhausted : {false, true}) {
      const std::string label = std::string(pageable ? "pageable" : "direct pinned") +
                                (exhausted ? ", heap stays exhausted" : ", one failure");
      long failures = 0;
      for (long n = 0; n < kMaxAllocations; ++n) {
        const std::string when = label + ", allocation " + std::to_string(n);
        auto backend = make_host_backend(0);
        // A budget below the request sends it to pageable memory.
        HostArena arena(*backend, tiering_test::test_host_options(pageable ? kMiB : 64 * kMiB));
        HostBlock block;
        bool done = false;
        ::testing::internal::CaptureStderr();  // the fallback's warning
        std::thread([&] {
          const auto allocate = [&] { block = arena.allocate(kBytes); };
          done = exhausted ? test_support::survives_exhaustion(n, allocate)
                           : test_support::survives(n, allocate);
        }).join();
        ::testing::internal::GetCapturedStderr();
        if (done) {
          EXPECT_EQ(block.tier, pageable ? HostTier::pageable : HostTier::pinned) << when;
          arena.deallocate(block);
          expect_nothing_held(arena.stats(), when + " (went through)");
          break;
        }
        ++failures;
        expect_nothing_held(arena.stats(), when + " failed");
        // The budget is whole: the same request is served as before.
        const HostBlock again = arena.allocate(kBytes);
        EXPECT_EQ(again.tier, pageable ? HostTier::pageable : HostTier::pinned) << when;
        arena.deallocate(again);
      }
      EXPECT_GT(failures, 0) << label << ": no allocation to fail: the sweep tested nothing";
    }
  }
}

// Review finding: freeing a direct block reserved room in the list of mappings kept after a
// failed unregistration, and that allocation could fail once the list held one: a free of
// a block the arena handed out threw (a tiered store's destroy then kept a handle whose
// dirty device copy it had dropped). The room is now made when a block is handed out.
TEST(HostArenaAllocationFailures, FreeingADirectBlockNeedsNoHeap) {
  auto backend = make_host_backend(0);
  tiering_test::FailingBackend failing(*backend);
  HostArena arena(failing, tiering_test::test_host_options(64 * kMiB));
  std::vector<HostBlock> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(arena.allocate(kBytes));
  for (const HostBlock& b : blocks) ASSERT_EQ(b.tier, HostTier::pinned);
  failing.fail_calls_to("host_unregister", 1);
  arena.deallocate(blocks[0]);  // kept, listed (Note [A registration that would not go])
  ASSERT_EQ(arena.stats().direct_release_failures, 1u);
  bool freed = false;
  std::thread([&] {
    freed = test_support::survives_exhaustion(0, [&] {
      for (std::size_t i = 1; i < blocks.size(); ++i) arena.deallocate(blocks[i]);
    });
  }).join();
  EXPECT_TRUE(freed) << "a free of a block the arena handed out needed the heap";
  EXPECT_EQ(arena.stats().direct_count, 0u);
  EXPECT_EQ(arena.release_empty_slabs(), kBytes);  // the kept one goes once it can
}

}  // namespace
}  // namespace tidepool
