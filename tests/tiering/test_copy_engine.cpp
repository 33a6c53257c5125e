// CopyEngine: chunked transfers land intact in both directions, ordering by events,
// per-direction telemetry, and a failing copy surfaces as an error.
#include <cstring>

#include "tests/tiering/tiering_test_util.h"
#include "tiering/copy_engine.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

class CopyEngineTest : public tiering_test::TieringTest {};

TEST_P(CopyEngineTest, ChunkedRoundTripIsExactAndCounted) {
  CopyEngineOptions o;
  o.chunk_bytes = 1 << 20;
  CopyEngine engine(backend(), o);
  const std::size_t n = (3 << 20) + 12345;  // 4 chunks, the last one partial
  const auto src = random_bytes(n, 42);
  std::vector<unsigned char> back(n, 0);
  void* dev = backend().device_alloc(n);
  Event up = backend().create_event();
  Event down = backend().create_event();
  engine.transfer(dev, src.data(), n, Direction::host_to_device, up);
  // The D2H stream orders itself after the H2D stream through `up` only.
  const Event after_up[] = {up};
  engine.transfer(back.data(), dev, n, Direction::device_to_host, down, after_up);
  backend().event_synchronize(down);
  EXPECT_EQ(first_difference(src.data(), back.data(), n), -1);
  engine.synchronize();
  const CopyEngineStats s = engine.stats();
  EXPECT_EQ(s.h2d.bytes, n);
  EXPECT_EQ(s.d2h.bytes, n);
  EXPECT_EQ(s.h2d.chunks, 4u);
  EXPECT_EQ(s.d2h.transfers, 1u);
  EXPECT_GE(s.h2d.busy_ms, 0.0);
  backend().destroy_event(up);
  backend().destroy_event(down);
  backend().device_free(dev, n);
}

TEST_P(CopyEngineTest, SmallTransfersAreTimedInBatches) {
  CopyEngineOptions o;
  o.timing_batch_bytes = 1 << 20;
  CopyEngine engine(backend(), o);
  const std::size_t n = 64 << 10;
  const auto src = random_bytes(n, 5);
  void* dev = backend().device_alloc(32 * n);
  for (int i = 0; i < 32; ++i) {  // 2 MiB in 64 KiB pieces: two timing batches
    engine.transfer(static_cast<char*>(dev) + i * n, src.data(), n, Direction::host_to_device, {});
  }
  engine.synchronize();
  const CopyEngineStats s = engine.stats();
  EXPECT_EQ(s.h2d.transfers, 32u);
  EXPECT_EQ(s.h2d.bytes, 32 * n);
  EXPECT_GT(s.h2d.busy_ms, 0.0);
  EXPECT_GT(s.h2d.gb_per_s(), 0.0);
  const auto back = read_device(static_cast<char*>(dev) + 31 * n, n, Stream{});
  EXPECT_EQ(first_difference(back.data(), src.data(), n), -1);
  backend().device_free(dev, 32 * n);
}

TEST_P(CopyEngineTest, DirectionsUseTheirOwnStreams) {
  CopyEngine engine(backend());
  EXPECT_FALSE(engine.stream(Direction::host_to_device) ==
               engine.stream(Direction::device_to_host));
  EXPECT_FALSE(engine.stream(Direction::host_to_device) == Stream{});
}

TEST_P(CopyEngineTest, ExposedWaitIsMeasured) {
  CopyEngine engine(backend());
  const std::size_t n = 16 << 20;
  std::vector<unsigned char> host(n, 3);
  void* dev = backend().device_alloc(n);
  Event done = backend().create_event();
  engine.transfer(dev, host.data(), n, Direction::host_to_device, done);
  engine.wait_exposed(done);
  EXPECT_TRUE(backend().event_query(done));
  const CopyEngineStats s = engine.stats();
  EXPECT_LE(s.exposed_waits, 1u);
  EXPECT_GE(s.exposed_wait_ms, 0.0);
  backend().destroy_event(done);
  backend().device_free(dev, n);
}

TEST_P(CopyEngineTest, AFailingCopyThrowsAndRecordsNoCompletion) {
  if (!on_host()) GTEST_SKIP() << "fault injection is a host-backend feature";
  CopyEngine engine(backend());
  std::vector<unsigned char> host(4096, 1);
  void* dev = backend().device_alloc(4096);
  Event done = backend().create_event();
  backend().inject_fault(FaultPoint::copy, 1);
  EXPECT_THROW(engine.transfer(dev, host.data(), 4096, Direction::host_to_device, done),
               BackendError);
  EXPECT_EQ(engine.stats().h2d.bytes, 0u);
  engine.transfer(dev, host.data(), 4096, Direction::host_to_device, done);  // works again
  backend().event_synchronize(done);
  backend().destroy_event(done);
  backend().device_free(dev, 4096);
}

TEST_P(CopyEngineTest, ZeroChunkSizeIsRejected) {
  CopyEngineOptions o;
  o.chunk_bytes = 0;
  EXPECT_THROW(CopyEngine(backend(), o), BackendError);
}

INSTANTIATE_TEST_SUITE_P(Backends, CopyEngineTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
