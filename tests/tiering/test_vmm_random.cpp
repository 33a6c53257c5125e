// VmmPool under random use: ranges of random sizes under two tags come and go, are
// written through their pointers, and move by pointer, by tag and by lists of pointers
// (bases, interior pointers, pointers of freed ranges, pointers no range holds) under a
// device budget of a few granules. After every operation:
//   - every range's bytes are what was written (checked on a random range each time, on
//     every range at the end), at the address it was given;
//   - each range's backing is all there: its device and host bytes add up to its size;
//   - a move towards the device never takes the pool past its budget (or further past
//     it: allocations may pass it, Note [VMM device budget]), and a move to the host
//     leaves nothing of the ranges it named on the device;
//   - device_backed_ranges lists exactly the ranges of the tag with device bytes that
//     hold none of the pointers excepted, oldest first;
//   - range ids stay with their ranges and are never given again.
// Under a budget of the pool's own and under tidepool.state_budget (the shared ledger).
// Size: TIDEPOOL_TEST_SCALE x 1,500 operations (400 under sanitizers); TIDEPOOL_TEST_SEED
// draws other ones.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "allocator/config.h"
#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/device_budget_ledger.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

// Every move maps and unmaps pages: about 4 ms per operation on the host backend.
constexpr long kBaseOps = test_support::kSanitizedBuild ? 400 : 1500;

class VmmRandomTest : public tiering_test::TieringStreamTest {
 protected:
  void TearDown() override {
    apply_config(Config{});
    TieringStreamTest::TearDown();
  }
  // The random sequence on `pool`, whose device budget is `budget` bytes.
  void run(VmmPool& pool, std::size_t budget, std::uint64_t fixed_seed);
};

struct ShadowRange {
  unsigned char* ptr = nullptr;
  int tag = 0;
  std::uint64_t id = 0;
  std::uint64_t order = 0;  // allocation order
  std::vector<unsigned char> bytes;
};

void VmmRandomTest::run(VmmPool& pool, std::size_t budget, std::uint64_t fixed_seed) {
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(fixed_seed));
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  Backend& b = backend();
  const std::size_t granule = b.granularity();
  const int tags[2] = {kTagOptimizerState, tag_id("vmm-random")};
  std::vector<ShadowRange> ranges;
  std::set<std::uint64_t> ids_given;
  std::uint64_t allocations = 0;
  std::uint64_t seed = 1;

  auto allocate = [&] {
    ShadowRange r;
    const std::size_t n = pick(3) * granule + 1 + pick(granule + granule / 2);
    r.tag = tags[pick(2)];
    r.ptr = static_cast<unsigned char*>(
        pool.allocate(n, r.tag, pick(2) == 0 ? MemoryLocation::device : MemoryLocation::host));
    ASSERT_NE(r.ptr, nullptr);
    r.bytes = random_bytes(n, seed++);
    b.copy_async(r.ptr, r.bytes.data(), n, CopyKind::host_to_device, stream_);
    b.stream_synchronize(stream_);  // the shadow it reads from is written again later
    pool.record_use(r.ptr, stream_);
    r.id = pool.range_id(r.ptr);
    ASSERT_TRUE(ids_given.insert(r.id).second) << "range id " << r.id << " given twice";
    r.order = allocations++;
    ranges.push_back(std::move(r));
  };
  auto check_bytes = [&](const ShadowRange& r, const char* when) {
    const auto seen = read_device(r.ptr, r.bytes.size(), stream_);
    ASSERT_EQ(first_difference(seen.data(), r.bytes.data(), r.bytes.size()), -1) << when;
  };
  // A pointer for a move list: a base, an interior pointer, one no range holds.
  int outside = 0;
  auto some_pointer = [&]() -> const void* {
    if (ranges.empty() || pick(6) == 0) return pick(2) == 0 ? nullptr : &outside;
    const ShadowRange& r = ranges[pick(ranges.size())];
    return pick(2) == 0 ? r.ptr : r.ptr + pick(r.bytes.size());
  };
  // The ranges a pointer list names (each once).
  auto named = [&](const std::vector<const void*>& ptrs) {
    std::vector<const ShadowRange*> out;
    for (const ShadowRange& r : ranges) {
      for (const void* p : ptrs) {
        const auto* c = static_cast<const unsigned char*>(p);
        if (c >= r.ptr && c < r.ptr + r.bytes.size()) {
          out.push_back(&r);
          break;
        }
      }
    }
    return out;
  };
  auto device_bytes = [&] { return pool.stats().device_backed_bytes; };
  // With the configured budget the pool's device bytes are charged to the device's shared
  // ledger, of which it is the only participant here: the two must agree after every
  // operation (drift there would show only as another store refused room).
  const std::shared_ptr<DeviceBudgetLedger> ledger =
      pool.stats().budget_shared ? DeviceBudgetLedger::existing(b.device()) : nullptr;

  for (int i = 0; i < 4; ++i) allocate();
  const long ops = test_support::scaled(kBaseOps);
  for (long op = 0; op < ops && !HasFailure(); ++op) {
    const std::size_t kind = pick(100);
    const std::size_t before = device_bytes();
    bool towards_device = false;
    if (kind < 12 || ranges.empty()) {
      if (ranges.size() < 10) allocate();
    } else if (kind < 20) {
      const std::size_t i = pick(ranges.size());
      pool.deallocate(ranges[i].ptr);
      ranges.erase(ranges.begin() + static_cast<long>(i));
    } else if (kind < 40) {  // write part of a range through its pointer
      ShadowRange& r = ranges[pick(ranges.size())];
      const std::size_t at = pick(r.bytes.size());
      const std::size_t n = 1 + pick(r.bytes.size() - at);
      const auto data = random_bytes(n, seed++);
      std::copy(data.begin(), data.end(), r.bytes.begin() + static_cast<long>(at));
      b.copy_async(r.ptr + at, data.data(), n, CopyKind::host_to_device, stream_);
      b.stream_synchronize(stream_);  // the source dies here
      pool.record_use(r.ptr, stream_);
    } else if (kind < 55) {
      const ShadowRange& r = ranges[pick(ranges.size())];
      towards_device = pick(2) == 0;
      pool.migrate(r.ptr + pick(r.bytes.size()),
                   towards_device ? MemoryLocation::device : MemoryLocation::host);
      if (!towards_device) {
        ASSERT_EQ(pool.bytes_in(r.ptr, MemoryLocation::device), 0u) << "op " << op;
      }
    } else if (kind < 65) {
      towards_device = pick(2) == 0;
      const int tag = tags[pick(2)];
      pool.migrate_tag(tag, towards_device ? MemoryLocation::device : MemoryLocation::host);
      if (!towards_device) {
        for (const ShadowRange& r : ranges) {
          if (r.tag == tag) {
            ASSERT_EQ(pool.bytes_in(r.ptr, MemoryLocation::device), 0u) << "op " << op;
          }
        }
      }
    } else if (kind < 85) {
      std::vector<const void*> ptrs;
      for (std::size_t n = pick(6); n > 0; --n) ptrs.push_back(some_pointer());
      towards_device = pick(2) == 0;
      pool.migrate_ranges_holding(ptrs,
                                  towards_device ? MemoryLocation::device : MemoryLocation::host);
      if (!towards_device) {
        for (const ShadowRange* r : named(ptrs)) {
          ASSERT_EQ(pool.bytes_in(r->ptr, MemoryLocation::device), 0u) << "op " << op;
        }
      }
    } else if (kind < 95) {  // what is on the device beyond the ranges named
      std::vector<const void*> except;
      for (std::size_t n = pick(4); n > 0; --n) except.push_back(some_pointer());
      const int tag = tags[pick(2)];
      std::vector<const ShadowRange*> expected;
      const auto excepted = named(except);
      for (const ShadowRange& r : ranges) {
        if (r.tag == tag && pool.bytes_in(r.ptr, MemoryLocation::device) > 0 &&
            std::find(excepted.begin(), excepted.end(), &r) == excepted.end()) {
          expected.push_back(&r);
        }
      }
      std::sort(expected.begin(), expected.end(),
                [](const ShadowRange* x, const ShadowRange* y) { return x->order < y->order; });
      std::vector<void*> expected_bases;
      for (const ShadowRange* r : expected) expected_bases.push_back(r->ptr);
      ASSERT_EQ(pool.device_backed_ranges(tag, except), expected_bases) << "op " << op;
    } else {
      const ShadowRange& r = ranges[pick(ranges.size())];
      ASSERT_NO_FATAL_FAILURE(check_bytes(r, "a range read back"));
    }
    if (towards_device) {
      ASSERT_LE(device_bytes(), std::max(before, budget))
          << "a move towards the device took the pool past its budget, op " << op;
    }
    std::size_t device_total = 0;
    for (const ShadowRange& r : ranges) {
      const std::size_t on_device = pool.bytes_in(r.ptr, MemoryLocation::device);
      const std::size_t on_host = pool.bytes_in(r.ptr, MemoryLocation::host);
      ASSERT_EQ(on_device + on_host, pool.size_of(r.ptr)) << "op " << op;
      ASSERT_GE(pool.size_of(r.ptr), r.bytes.size());
      ASSERT_EQ(pool.base_of(r.ptr + r.bytes.size() - 1), r.ptr);
      ASSERT_EQ(pool.range_id(r.ptr), r.id) << "op " << op;
      device_total += on_device;
    }
    ASSERT_EQ(device_total, device_bytes()) << "op " << op;
    if (ledger) {
      ASSERT_EQ(ledger->charged_bytes(), device_total) << "op " << op;
    }
  }
  for (const ShadowRange& r : ranges) {
    ASSERT_NO_FATAL_FAILURE(check_bytes(r, "at the end"));
    pool.deallocate(r.ptr);
  }
  EXPECT_GT(pool.stats().bytes_to_host, 0u);
  EXPECT_GT(pool.stats().bytes_to_device, 0u);
}

TEST_P(VmmRandomTest, RangesKeepBytesBackingAndBudgetThroughRandomMoves) {
  const std::size_t budget = (2 + test_support::seeded(5) % 5) * backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{budget});
  run(pool, budget, 20261206);
}

// The same with the budget from tidepool.state_budget: the pool's device bytes are then
// charged to the device's shared ledger (Note [Shared state budget]).
TEST_P(VmmRandomTest, UnderTheConfiguredStateBudgetToo) {
  const std::size_t budget = 3 * backend().granularity();
  apply_config(claim_config("tidepool.state_budget:" + std::to_string(budget)).config);
  VmmPool pool(backend());
  ASSERT_EQ(pool.device_budget_bytes(), std::optional<std::size_t>(budget));
  ASSERT_TRUE(pool.stats().budget_shared);  // run() checks the ledger after every operation
  run(pool, budget, 20261207);
}

INSTANTIATE_TEST_SUITE_P(Backends, VmmRandomTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
