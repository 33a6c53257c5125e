// TieredStore::acquire_to_overwrite (Note [Acquiring to overwrite] in
// tiering/tiered_store.cpp): a handle on the host is acquired without loading its old
// contents, in the order a load would have had; what the caller writes is the handle's
// contents from then on, written back at the eviction even after a clean release.
#include <cstddef>
#include <vector>

#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;
using tiering_test::StreamGate;

constexpr std::size_t kBytes = 100 << 10;

class AcquireToOverwriteTest : public tiering_test::TieringStreamTest {
 protected:
  TieredStoreOptions options(std::size_t budget) {
    return tiering_test::small_chunk_store_options(budget);
  }
  // `data` through the device pointer of an acquired handle, on `s`; waits for it.
  void write_device(void* dev, const std::vector<unsigned char>& data, Stream s) {
    backend().copy_async(dev, data.data(), data.size(), CopyKind::host_to_device, s);
    backend().stream_synchronize(s);
  }
  static bool holds(TieredStore& store, TieredStore::Handle h,
                    const std::vector<unsigned char>& data) {
    std::vector<unsigned char> seen(store.size(h));
    store.read(h, seen.data());
    return first_difference(seen.data(), data.data(), data.size()) == -1;
  }
};

TEST_P(AcquireToOverwriteTest, AHandleOnTheHostIsAcquiredWithoutLoadingIt) {
  TieredStore store(backend(), options(1 << 20));
  const TieredStore::Handle h = store.create(kBytes, kTagOptimizerState);
  store.write(h, random_bytes(kBytes, 1).data());  // the old contents, on the host
  const auto fresh = random_bytes(kBytes, 2);
  write_device(store.acquire_to_overwrite(h, stream_), fresh, stream_);
  TieredStoreStats s = store.stats();
  EXPECT_EQ(s.loads_skipped, 1u);
  EXPECT_EQ(s.copy.h2d.bytes, 0u) << "nothing crossed to the device";
  EXPECT_EQ(s.misses, 0u);
  EXPECT_EQ(s.acquires, 1u);
  // Released clean, the device copy is still the latest: the eviction writes it back.
  store.release(h, /*dirty=*/false);
  store.evict(h);
  EXPECT_TRUE(holds(store, h, fresh));
  s = store.stats();
  EXPECT_EQ(s.copy.d2h.bytes, kBytes);
  EXPECT_EQ(s.evictions_clean, 0u);
  store.destroy(h);
}

TEST_P(AcquireToOverwriteTest, AHandleOnTheDeviceIsAcquiredAsAcquireDoes) {
  TieredStore store(backend(), options(1 << 20));
  const TieredStore::Handle h = store.create(kBytes, kTagOptimizerState);
  write_device(store.acquire(h, stream_), random_bytes(kBytes, 3), stream_);
  store.release(h, /*dirty=*/true);
  const auto h2d_before = store.stats().copy.h2d.bytes;
  const auto fresh = random_bytes(kBytes, 4);
  write_device(store.acquire_to_overwrite(h, stream_), fresh, stream_);
  store.release(h, /*dirty=*/true);
  EXPECT_EQ(store.stats().loads_skipped, 0u);
  EXPECT_EQ(store.stats().copy.h2d.bytes, h2d_before);
  store.evict(h);
  EXPECT_TRUE(holds(store, h, fresh));
  store.destroy(h);
}

// Under a budget of one handle, the overwritten handle takes over the buffer of the one
// evicted for it while that one's write-back still waits (its use stream is held): the
// caller's writes on another stream must land after the write-back has read the buffer.
TEST_P(AcquireToOverwriteTest, WritesWaitForTheWriteBackOfTheBufferTheyTakeOver) {
  TieredStore store(backend(), options(kBytes));
  const TieredStore::Handle first = store.create(kBytes, kTagOptimizerState);
  const TieredStore::Handle second = store.create(kBytes, kTagOptimizerState);
  const auto first_data = random_bytes(kBytes, 5);
  write_device(store.acquire(first, stream_), first_data, stream_);
  store.release(first, /*dirty=*/true);
  StreamGate gate;
  StreamGate::OpenOnExit open_on_exit{gate};
  backend().launch_host_func(stream_, &StreamGate::wait, &gate);  // holds first's use

  const Stream other = backend().create_stream();
  const auto second_data = random_bytes(kBytes, 6);
  void* dev = store.acquire_to_overwrite(second, other);
  backend().copy_async(dev, second_data.data(), kBytes, CopyKind::host_to_device, other);
  gate.open();
  backend().stream_synchronize(other);
  store.release(second, /*dirty=*/false);
  store.evict(second);
  EXPECT_TRUE(holds(store, first, first_data)) << "the write-back read the buffer first";
  EXPECT_TRUE(holds(store, second, second_data));
  EXPECT_EQ(store.stats().loads_skipped, 1u);
  store.release_stream(other);
  backend().destroy_stream(other);
  store.destroy(first);
  store.destroy(second);
}

TEST_P(AcquireToOverwriteTest, BadInputIsAClearErrorAndChangesNothing) {
  TieredStore store(backend(), options(1 << 20));
  EXPECT_THROW(store.acquire_to_overwrite(TieredStore::Handle{12345}, stream_), TieringError);
  // No room: the budget's other half is held by an acquired handle.
  const TieredStore::Handle held = store.create(600 << 10, kTagOptimizerState);
  const TieredStore::Handle h = store.create(600 << 10, kTagOptimizerState);
  const auto data = random_bytes(600 << 10, 7);
  store.write(h, data.data());
  store.acquire(held, stream_);
  EXPECT_THROW(store.acquire_to_overwrite(h, stream_), TieringError) << "over the budget";
  store.release(held, /*dirty=*/false);
  EXPECT_FALSE(store.resident(h));
  EXPECT_TRUE(holds(store, h, data)) << "the contents were not given up";
  EXPECT_EQ(store.stats().loads_skipped, 0u);
  store.destroy(held);
  store.destroy(h);
}

INSTANTIATE_TEST_SUITE_P(Backends, AcquireToOverwriteTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
