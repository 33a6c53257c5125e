// CopyEngine: chunked transfers land intact in both directions, ordering by events,
// per-direction telemetry (rates of the bytes timed only), and a failing copy surfaces as
// an error.
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "allocator/forwarding_backend.h"
#include "tests/tiering/failing_backend.h"
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

// Note [Rates from timed bytes] (copy_engine.h): a transfer's bytes are counted when it is
// enqueued, its time when its batch is done and collected; a direction's rate is of the
// bytes whose time is collected. The transfers are held deterministically: each waits for
// an event recorded on a stream that a StreamGate holds.
class CopyEngineRateTest : public CopyEngineTest {
 protected:
  void SetUp() override {
    CopyEngineTest::SetUp();
    if (IsSkipped()) return;
    if (!on_host()) GTEST_SKIP() << "the gate needs host-backend streams";
    held_ = backend().create_stream();
    opened_ = backend().create_event();
    backend().launch_host_func(held_, &tiering_test::StreamGate::wait, &gate_);
    backend().record_event(opened_, held_);  // done once the gate opens
    dev_up_ = backend().device_alloc(kBytes);
    dev_down_ = backend().device_alloc(kBytes);
  }
  void TearDown() override {
    if (!held_.handle) return;
    gate_.open();
    backend().stream_synchronize(held_);
    backend().destroy_event(opened_);
    backend().destroy_stream(held_);
    backend().device_free(dev_up_, kBytes);
    backend().device_free(dev_down_, kBytes);
  }
  static constexpr std::size_t kBytes = std::size_t{8} << 20;
  // The bytes a direction's rate is of: its rate times its busy time.
  static double bytes_in_rate(const DirectionStats& d) { return d.gb_per_s() * d.busy_ms * 1e6; }

  tiering_test::StreamGate gate_;
  Stream held_;
  Event opened_;  // a transfer that waits for it is held until the gate opens
  void* dev_up_ = nullptr;
  void* dev_down_ = nullptr;
  std::vector<unsigned char> host_up_ = std::vector<unsigned char>(kBytes, 1);
  std::vector<unsigned char> host_down_ = std::vector<unsigned char>(kBytes, 2);
};

// A copy-back held on its own stream is counted as moved but leaves the rate as it was:
// its bytes enter the rate with its time, not before (they made it read twice as fast).
TEST_P(CopyEngineRateTest, ATransferInFlightLeavesTheRateAsItWas) {
  CopyEngine engine(backend());
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate_};  // before the engine goes
  engine.transfer(host_down_.data(), dev_down_, kBytes, Direction::device_to_host, {});
  engine.synchronize();
  const CopyEngineStats first = engine.stats();
  ASSERT_GT(first.d2h.busy_ms, 0.0);
  const Event after_gate[] = {opened_};
  engine.transfer(host_down_.data(), dev_down_, kBytes, Direction::device_to_host, {}, after_gate);
  const CopyEngineStats during = engine.stats();
  EXPECT_EQ(during.d2h.bytes, 2 * kBytes);
  EXPECT_DOUBLE_EQ(during.d2h.busy_ms, first.d2h.busy_ms);
  EXPECT_DOUBLE_EQ(during.d2h.gb_per_s(), first.d2h.gb_per_s())
      << "bytes still in flight were counted into the rate";
  gate_.open();
  engine.synchronize();
  const CopyEngineStats last = engine.stats();
  EXPECT_GT(last.d2h.busy_ms, first.d2h.busy_ms);
  EXPECT_NEAR(bytes_in_rate(last.d2h), 2.0 * kBytes, 1.0);
}

// A load held on the H2D stream does not hold back the timing of the copy-backs done
// after it on the D2H stream: their time is collected (the rate is of their bytes), and
// the held load's bytes are in no rate.
TEST_P(CopyEngineRateTest, AHeldLoadDoesNotHoldBackTheWriteBacksTiming) {
  CopyEngine engine(backend());
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate_};  // before the engine goes
  engine.transfer(host_down_.data(), dev_down_, kBytes, Direction::device_to_host, {});
  engine.synchronize();
  const CopyEngineStats first = engine.stats();
  const Event after_gate[] = {opened_};
  engine.transfer(dev_up_, host_up_.data(), kBytes, Direction::host_to_device, {}, after_gate);
  engine.transfer(host_down_.data(), dev_down_, kBytes, Direction::device_to_host, {});
  backend().stream_synchronize(engine.stream(Direction::device_to_host));
  const CopyEngineStats during = engine.stats();
  EXPECT_GT(during.d2h.busy_ms, first.d2h.busy_ms)
      << "the copy-back's time waited behind the held load's";
  EXPECT_NEAR(bytes_in_rate(during.d2h), 2.0 * kBytes, 1.0);
  EXPECT_EQ(during.h2d.bytes, kBytes);
  EXPECT_DOUBLE_EQ(during.h2d.gb_per_s(), 0.0);
  gate_.open();
  engine.synchronize();
  EXPECT_NEAR(bytes_in_rate(engine.stats().h2d), 1.0 * kBytes, 1.0);
}

// Opens the gate as a caller blocks on an event: the wait measured is one that blocked.
class OpensTheGateOnAWait : public ForwardingBackend {
 public:
  OpensTheGateOnAWait(Backend& inner, tiering_test::StreamGate& gate)
      : ForwardingBackend(inner), gate_(gate) {}

 protected:
  void on_call(Call call) override {
    if (call == Call::event_synchronize) gate_.open();
  }

 private:
  tiering_test::StreamGate& gate_;
};

// A wait for a transfer still held behind the gate is counted, with its time; a wait for
// one already complete, or for no event, is not. The gate opens only once the engine
// waits, so the wait truly blocked, with no timing in the test.
TEST_P(CopyEngineRateTest, ExposedWaitIsMeasured) {
  OpensTheGateOnAWait opener(backend(), gate_);
  CopyEngine engine(opener);
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate_};  // before the engine goes
  const Event done = backend().create_event();
  const Event after_gate[] = {opened_};
  engine.transfer(dev_up_, host_up_.data(), kBytes, Direction::host_to_device, done, after_gate);
  EXPECT_FALSE(backend().event_query(done)) << "the gate did not hold the transfer";
  engine.wait_exposed(done);
  EXPECT_TRUE(backend().event_query(done));
  EXPECT_EQ(engine.stats().exposed_waits, 1u);
  EXPECT_GT(engine.stats().exposed_wait_ms, 0.0);
  engine.wait_exposed(done);     // complete already: nothing counted
  engine.wait_exposed(Event{});  // no event: nothing counted
  EXPECT_EQ(engine.stats().exposed_waits, 1u);
  backend().destroy_event(done);
}

INSTANTIATE_TEST_SUITE_P(Backends, CopyEngineRateTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

// Note [A transfer's bytes and time in one batch] (copy_engine.cpp): a stats() call on
// another thread while a transfer is being enqueued does not split the transfer's bytes
// from its time. The transfer is held inside its copy_async; stats() is called then.
// Before, it closed the batch without the held copy's bytes, which were then never timed.
class HoldsTheNextCopy : public ForwardingBackend {
 public:
  explicit HoldsTheNextCopy(Backend& inner) : ForwardingBackend(inner) {}
  std::atomic<bool> hold{false};     // the next copy_async waits for `released`
  std::atomic<bool> holding{false};  // a copy_async is waiting
  std::atomic<bool> released{false};

 protected:
  void on_call(Call call) override {
    if (call != Call::copy_async || !hold.exchange(false)) return;
    holding = true;
    while (!released) std::this_thread::yield();
  }
};

TEST_P(CopyEngineTest, AStatsCallDuringATransferKeepsItsBytesWithItsTime) {
  HoldsTheNextCopy holder(backend());
  CopyEngineOptions o;
  o.timing_batch_bytes = std::size_t{1} << 30;  // the batch stays open after the transfer
  CopyEngine engine(holder, o);
  const std::size_t n = 1 << 20;
  const auto src = random_bytes(n, 9);
  void* dev = backend().device_alloc(n);
  holder.hold = true;
  std::thread transfer([&] { engine.transfer(dev, src.data(), n, Direction::host_to_device, {}); });
  while (!holder.holding) std::this_thread::yield();
  auto during = std::async(std::launch::async, [&] { return engine.stats(); });
  // Fixed, stats() waits for the transfer; broken, it returned at once and closed the batch
  // (a slow machine only makes this test weaker, never wrong).
  during.wait_for(std::chrono::milliseconds(100));
  holder.released = true;
  transfer.join();
  during.get();
  engine.synchronize();
  const CopyEngineStats s = engine.stats();
  EXPECT_EQ(s.h2d.bytes, n);
  EXPECT_EQ(s.h2d.timed_bytes, n) << "the transfer's bytes were split from its time";
  backend().device_free(dev, n);
}

// Review finding: a timing batch that could not be closed after the copy was enqueued and
// `done` recorded made transfer() throw, against its contract (a throw means `done` is not
// recorded): a caller took the copy for failed. The batch stays open and closes later.
TEST_P(CopyEngineTest, ATimingThatCannotCloseDoesNotFailTheTransfer) {
  tiering_test::FailingBackend failing(backend());
  CopyEngineOptions o;
  o.timing_batch_bytes = 1;  // every transfer closes its batch
  const std::size_t n = 64 << 10;
  const auto src = random_bytes(n, 9);
  void* dev = backend().device_alloc(2 * n);
  Event done = backend().create_event();
  {
    CopyEngine engine(failing, o);
    // Records: the batch's start, `done`, then the batch's end, which fails.
    failing.fail_calls_to("record_event", 1, 2);
    ASSERT_NO_THROW(engine.transfer(dev, src.data(), n, Direction::host_to_device, done));
    EXPECT_EQ(failing.failed_calls(), 1);
    backend().event_synchronize(done);
    std::vector<unsigned char> back(n, 0);
    backend().copy_async(back.data(), dev, n, CopyKind::device_to_host, Stream{});
    backend().stream_synchronize(Stream{});
    EXPECT_EQ(first_difference(src.data(), back.data(), n), -1);
    // The open batch is closed by the next transfer, with both transfers' bytes.
    engine.transfer(static_cast<char*>(dev) + n, src.data(), n, Direction::host_to_device, {});
    engine.synchronize();
    const CopyEngineStats s = engine.stats();
    EXPECT_EQ(s.h2d.bytes, 2 * n);
    EXPECT_EQ(s.h2d.timed_bytes, 2 * n);
  }
  backend().destroy_event(done);
  backend().device_free(dev, 2 * n);
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
