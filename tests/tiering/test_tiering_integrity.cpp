// Integrity of the tiering engine under random use: sequences of prefetch / acquire /
// write-through-the-device-pointer / release / evict / read over many handles and several
// streams, plus pointer-stable VMM ranges written and migrated both ways, with misuse mixed
// in (release of a handle not acquired; evict, read or destroy of an acquired one), which
// must be refused. Every byte is checked against a shadow copy and the device budget is
// checked after every operation.
// A concurrent variant runs the same operations from several threads (for TSan).
//
// Size: TIDEPOOL_TEST_SCALE x 100k operations (about 15 s on 2 busy cores), 20k under
// sanitizers, which slow every backend call by an order of magnitude.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

constexpr std::size_t kBudget = 1 << 20;
constexpr std::size_t kMaxHandleBytes = 96 << 10;
constexpr long kBaseOps = test_support::kSanitizedBuild ? 20000 : 100000;

class TieringIntegrityTest : public tiering_test::TieringTest {
 protected:
  // Room for the store's budget and the VMM ranges' device backing, nothing more: the
  // backend's own capacity check backs up the budget check.
  std::size_t capacity_bytes() const override { return kBudget + (std::size_t{32} << 20); }
};

struct ShadowHandle {
  TieredStore::Handle id = 0;
  std::vector<unsigned char> shadow;
  void* dev = nullptr;  // while acquired
  Stream stream;
  bool written = false;
};

struct ShadowRange {
  unsigned char* ptr = nullptr;
  std::vector<unsigned char> shadow;
};

TEST_P(TieringIntegrityTest, RandomOperationsLoseNoByteAndKeepTheBudget) {
  const long ops = test_support::scaled(kBaseOps);
  Backend& b = backend();
  TieredStoreOptions o = tiering_test::test_store_options(kBudget);
  o.copy.chunk_bytes = 32 << 10;  // several chunks per handle
  TieredStore store(b, o);
  VmmPool vmm(b);
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(12345));
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };

  std::vector<Stream> streams;
  for (int i = 0; i < 3; ++i) streams.push_back(b.create_stream());
  // Constant source buffers for writes: they outlive every copy, so no wait is needed.
  std::vector<std::vector<unsigned char>> patterns;
  for (int i = 0; i < 8; ++i) patterns.push_back(random_bytes(kMaxHandleBytes, 1000 + i));

  const std::size_t common_sizes[] = {4 << 10, 32 << 10, 64 << 10};
  std::vector<ShadowHandle> handles(48);
  for (auto& h : handles) {
    const std::size_t n = pick(2) == 0 ? common_sizes[pick(3)] : 1 + pick(kMaxHandleBytes);
    h.id = store.create(n, kTagOptimizerState, pick(4) == 0 ? Tier::device : Tier::host);
    h.shadow.assign(n, 0);
  }
  // One stream per range: writes to a range from two streams would race with each other.
  std::vector<ShadowRange> ranges(3);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const std::size_t n = i * b.granularity() + 12345 * (i + 1);
    ranges[i].ptr = static_cast<unsigned char*>(vmm.allocate(n, kTagOptimizerState));
    ASSERT_NE(ranges[i].ptr, nullptr);
    ranges[i].shadow.assign(n, 0);
    b.memset_async(ranges[i].ptr, 0, n, streams[i]);
    vmm.record_use(ranges[i].ptr, streams[i]);
  }

  std::size_t verified_bytes = 0;
  auto verify_device = [&](const void* dev, const std::vector<unsigned char>& shadow, Stream s,
                           const char* what) {
    const auto seen = read_device(dev, shadow.size(), s);
    verified_bytes += shadow.size();
    const long d = first_difference(seen.data(), shadow.data(), shadow.size());
    ASSERT_EQ(d, -1) << what << ": byte " << d << " differs";
  };
  auto verify_read = [&](ShadowHandle& h) {
    std::vector<unsigned char> seen(h.shadow.size());
    store.read(h.id, seen.data());
    verified_bytes += seen.size();
    const long d = first_difference(seen.data(), h.shadow.data(), seen.size());
    ASSERT_EQ(d, -1) << "read of handle " << h.id << ": byte " << d << " differs";
  };
  auto write_some = [&](unsigned char* dev, std::vector<unsigned char>& shadow, Stream s) {
    const std::size_t off = pick(shadow.size());
    const std::size_t len = 1 + pick(std::min(shadow.size() - off, kMaxHandleBytes));
    const auto& src = patterns[pick(patterns.size())];
    const std::size_t src_off = pick(kMaxHandleBytes - len + 1);
    b.copy_async(dev + off, src.data() + src_off, len, CopyKind::host_to_device, s);
    std::memcpy(shadow.data() + off, src.data() + src_off, len);
  };

  // Misuse mixed into the sequence: a clear TieringError, and the handle, its bytes and
  // the budget as they were (the checks after each operation and the final reads).
  long misuses = 0;
  auto expect_misuse = [&](auto&& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << "misuse accepted: " << what;
    } catch (const TieringError&) {
      misuses++;
    }
  };
  bool in_step = false;
  long refused_acquires = 0;
  for (long op = 0; op < ops; ++op) {
    ShadowHandle& h = handles[pick(handles.size())];
    const std::size_t kind = pick(100);
    if (kind < 25) {  // acquire (and maybe verify) or write through the device pointer
      if (h.dev == nullptr) {
        h.stream = streams[pick(streams.size())];
        try {
          h.dev = store.acquire(h.id, h.stream);
        } catch (const TieringError& e) {
          // Only legitimate when the acquired handles leave no room for this one.
          std::size_t acquired = 0;
          for (auto& other : handles) acquired += other.dev != nullptr ? other.shadow.size() : 0;
          ASSERT_GT(acquired + h.shadow.size(), kBudget) << e.what();
          refused_acquires++;
        }
        if (h.dev != nullptr && pick(8) == 0)
          verify_device(h.dev, h.shadow, h.stream, "acquired handle");
      } else {
        write_some(static_cast<unsigned char*>(h.dev), h.shadow, h.stream);
        h.written = true;
      }
    } else if (kind < 50) {
      if (h.dev != nullptr) {
        store.release(h.id, h.written);
        h.dev = nullptr;
        h.written = false;
      } else if (pick(4) == 0) {  // misuse: refused, and nothing changes (the checks below)
        expect_misuse([&] { store.release(h.id, pick(2) == 0); }, "release, not acquired");
      }
    } else if (kind < 62) {
      store.prefetch(h.id, streams[pick(streams.size())]);
    } else if (kind < 77) {
      if (h.dev == nullptr) {
        store.evict(h.id);
      } else if (pick(4) == 0) {
        expect_misuse([&] { store.evict(h.id); }, "evict, acquired");
      }
    } else if (kind < 82) {
      if (h.dev == nullptr) {
        verify_read(h);
      } else if (pick(4) == 0) {
        std::vector<unsigned char> out(h.shadow.size());
        expect_misuse([&] { store.read(h.id, out.data()); }, "read, acquired");
        expect_misuse([&] { store.destroy(h.id); }, "destroy, acquired");
      }
    } else if (kind < 86) {  // a replayable step: the same order every time
      if (!in_step) store.begin_step(); else store.end_step();
      in_step = !in_step;
    } else if (kind < 95) {  // write a VMM range through its pointer
      const std::size_t i = pick(ranges.size());
      write_some(ranges[i].ptr, ranges[i].shadow, streams[i]);
      vmm.record_use(ranges[i].ptr, streams[i]);
    } else if (kind < 96) {  // migrate it (each move maps fresh pages: kept rare)
      const std::size_t i = pick(ranges.size());
      vmm.migrate(ranges[i].ptr, pick(2) ? MemoryLocation::host : MemoryLocation::device);
      ASSERT_EQ(vmm.base_of(ranges[i].ptr), ranges[i].ptr);
      if (pick(4) == 0)
        verify_device(ranges[i].ptr, ranges[i].shadow, streams[i], "migrated range");
    } else {
      store.reclaim(kBudget / 4);
    }
    if (HasFatalFailure()) return;  // a failed check inside a helper lambda
    ASSERT_LE(store.device_bytes(), kBudget) << "budget exceeded at op " << op;
    if (op % 64 == 0) {
      const auto acquired = std::count_if(handles.begin(), handles.end(),
                                          [](const ShadowHandle& x) { return x.dev != nullptr; });
      ASSERT_EQ(store.stats().acquired_handles, static_cast<std::size_t>(acquired));
    }
    if (on_host()) {  // on a GPU others (the context, other processes) use memory too
      const MemInfo mem = b.mem_info();
      ASSERT_LE(mem.total_bytes - mem.free_bytes,
                store.device_bytes() + vmm.stats().device_backed_bytes)
          << "the backend holds more device memory than the store accounts for, op " << op;
    }
  }
  if (in_step) store.end_step();
  for (auto& h : handles) {
    if (h.dev != nullptr) store.release(h.id, h.written);
    h.dev = nullptr;
    verify_read(h);
    if (HasFatalFailure()) return;
  }
  for (auto& r : ranges) {
    vmm.migrate(r.ptr, MemoryLocation::host);
    verify_device(r.ptr, r.shadow, streams[0], "final range");
    if (HasFatalFailure()) return;
    vmm.deallocate(r.ptr);
  }
  const TieredStoreStats s = store.stats();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.copy.d2h.bytes, 0u);
  EXPECT_LE(s.device_peak_bytes, kBudget);
  EXPECT_GT(vmm.stats().bytes_to_host, 0u);
  EXPECT_GT(verified_bytes, 0u);
  EXPECT_LT(refused_acquires, ops / 10) << "the test mostly exercised refusals";
  EXPECT_GT(misuses, 0);
  for (auto& h : handles) store.destroy(h.id);
  for (Stream st : streams) b.destroy_stream(st);
}

TEST_P(TieringIntegrityTest, ConcurrentThreadsKeepTheirDataAndTheBudget) {
  Backend& b = backend();
  TieredStoreOptions o = tiering_test::test_store_options(512 << 10);
  o.copy.chunk_bytes = 16 << 10;
  TieredStore store(b, o);
  VmmPool vmm(b);
  SCOPED_TRACE(test_support::seed_note());
  constexpr int kThreads = 4;
  const auto iterations = test_support::scaled(1500);
  std::atomic<bool> stop{false};
  std::atomic<bool> budget_ok{true};
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads + 1);
  // Iterations each thread completed: the refusal tolerated below must stay rare, or the
  // test would check nothing (shadows of zeros match a store that refused every acquire).
  std::vector<long> completed(kThreads, 0);

  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<std::mt19937::result_type>(
          test_support::seeded(static_cast<std::uint64_t>(t))));
      const Stream s = b.create_stream();
      std::vector<TieredStore::Handle> ids;
      std::vector<std::vector<unsigned char>> shadows;
      for (int i = 0; i < 6; ++i) {
        const std::size_t n = 1000 + rng() % (48 << 10);
        ids.push_back(store.create(n, kTagOptimizerState));
        shadows.emplace_back(n, 0);
      }
      const auto src = random_bytes(48 << 10, 77 + t);
      // A VMM range per thread, migrated back and forth while others work.
      auto* range = static_cast<unsigned char*>(vmm.allocate(b.granularity(), kTagOptimizerState));
      for (int it = 0; it < iterations && failures[t].empty(); ++it) {
        const std::size_t i = rng() % ids.size();
        try {
          auto* dev = static_cast<unsigned char*>(store.acquire(ids[i], s));
          const std::size_t off = rng() % shadows[i].size();
          const std::size_t len = 1 + rng() % (shadows[i].size() - off);
          b.copy_async(dev + off, src.data(), std::min(len, src.size()),
                       CopyKind::host_to_device, s);
          std::memcpy(shadows[i].data() + off, src.data(), std::min(len, src.size()));
          store.release(ids[i], true);
          switch (rng() % 4) {
            case 0: store.evict(ids[i]); break;
            case 1: store.prefetch(ids[rng() % ids.size()], s); break;
            case 2: {
              std::vector<unsigned char> seen(shadows[i].size());
              store.read(ids[i], seen.data());
              if (first_difference(seen.data(), shadows[i].data(), seen.size()) != -1) {
                failures[t] = "thread " + std::to_string(t) + ": read mismatch";
              }
              break;
            }
            default:
              vmm.migrate(range, rng() % 2 ? MemoryLocation::host : MemoryLocation::device);
          }
          if (store.device_bytes() > o.device_budget_bytes) budget_ok = false;
          ++completed[t];
        } catch (const TieringError& e) {
          // Other threads may hold the whole budget for a moment: that is the only
          // acceptable error here.
          if (std::string(e.what()).find("acquired handles") == std::string::npos) {
            failures[t] = e.what();
          }
        }
      }
      for (std::size_t i = 0; i < ids.size(); ++i) {
        std::vector<unsigned char> seen(shadows[i].size());
        store.read(ids[i], seen.data());
        if (first_difference(seen.data(), shadows[i].data(), seen.size()) != -1) {
          failures[t] =
              "thread " + std::to_string(t) + ": final mismatch in handle " + std::to_string(i);
        }
        store.destroy(ids[i]);
      }
      vmm.deallocate(range);
      b.destroy_stream(s);
    });
  }
  // A bystander: stats, tag evictions and reclaims, as a Python hook or an OOM would.
  threads.emplace_back([&] {
    while (!stop) {
      (void)store.stats();
      store.evict_tag(kTagOptimizerState);
      store.reclaim(64 << 10);
      (void)vmm.stats();
      std::this_thread::yield();
    }
  });
  for (int t = 0; t < kThreads; ++t) threads[t].join();
  stop = true;
  threads.back().join();
  for (const auto& f : failures) EXPECT_TRUE(f.empty()) << f;
  for (int t = 0; t < kThreads; ++t) {
    if (!failures[t].empty()) continue;  // stopped early: said above
    EXPECT_GE(completed[t], iterations * 9 / 10) << "thread " << t << " was refused that often";
  }
  EXPECT_TRUE(budget_ok.load());
  EXPECT_LE(store.stats().device_peak_bytes, o.device_budget_bytes);
}

INSTANTIATE_TEST_SUITE_P(Backends, TieringIntegrityTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
