// Peer access to mapped ranges (Note [Peer access to mapped ranges] in backend.h) on the
// host backend, which records who was granted access to each mapping as the cuda backend
// tells the driver: ranges mapped before a peer is enabled get it, ranges mapped after
// it (a migration's new backing at the same address included) get it too, an unmapped
// range forgets it, a failed grant leaves nothing half-done, and bad peers are clear
// errors that change nothing. (Two real GPUs: gpu_test_peer_access.cpp; the C ABI:
// test_c_api.cpp.)
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allocator/backend.h"
#include "tests/support/backend_errors.h"

namespace tidepool {
namespace {

class PeerAccess : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = make_host_backend(0);
  const std::size_t g_ = backend_->granularity();

  std::byte* reserve(std::size_t granules) {
    auto* va = static_cast<std::byte*>(backend_->reserve_address(granules * g_));
    reserved_.push_back({va, granules * g_});
    return va;
  }
  PhysicalHandle physical(MemoryLocation where) {
    const PhysicalHandle h = backend_->create_physical(g_, where);
    EXPECT_TRUE(h);
    physicals_.push_back(h);
    return h;
  }
  // Everything still mapped is unmapped by the caller; handles and reservations go here.
  void TearDown() override {
    for (const PhysicalHandle h : physicals_) backend_->release_physical(h, g_);
    for (const auto& [va, bytes] : reserved_) backend_->release_address(va, bytes);
  }

  struct Reservation {
    std::byte* va;
    std::size_t bytes;
  };
  std::vector<Reservation> reserved_;
  std::vector<PhysicalHandle> physicals_;
};

using test_support::error_of;

TEST_F(PeerAccess, RangesMappedBeforeTheCallGetThePeer) {
  std::byte* va = reserve(2);
  backend_->map(va, g_, physical(MemoryLocation::device));
  backend_->map(va + g_, g_, physical(MemoryLocation::host));  // host-NUMA backing too
  EXPECT_TRUE(backend_->peer_has_access(va, 0)) << "the own device always has access";
  EXPECT_FALSE(backend_->peer_has_access(va, 1)) << "a new mapping is the own device's only";

  backend_->enable_peer_access(1);
  EXPECT_TRUE(backend_->peer_has_access(va, 1));
  EXPECT_TRUE(backend_->peer_has_access(va + g_ + 4096, 1));
  EXPECT_FALSE(backend_->peer_has_access(va, 2)) << "only the peer asked for";
  EXPECT_EQ(backend_->peers(), std::vector<int>{1});
  backend_->unmap(va, 2 * g_);
}

TEST_F(PeerAccess, RangesMappedLaterGetEveryPeerAndEnablingTwiceChangesNothing) {
  backend_->enable_peer_access(3);
  backend_->enable_peer_access(1);
  backend_->enable_peer_access(3);
  EXPECT_EQ(backend_->peers(), (std::vector<int>{1, 3}));
  std::byte* va = reserve(1);
  backend_->map(va, g_, physical(MemoryLocation::device));
  EXPECT_TRUE(backend_->peer_has_access(va, 1));
  EXPECT_TRUE(backend_->peer_has_access(va, 3));
  EXPECT_FALSE(backend_->peer_has_access(va, 2));
  backend_->unmap(va, g_);
}

// The tiering layer's migration (vmm_migration.cpp): new backing is mapped at a scratch
// address, filled, then mapped at the range's own address after the old one is unmapped.
TEST_F(PeerAccess, AMigratedRangeKeepsThePeersAccess) {
  std::byte* va = reserve(1);
  std::byte* scratch = reserve(1);
  const PhysicalHandle on_device = physical(MemoryLocation::device);
  backend_->map(va, g_, on_device);
  backend_->enable_peer_access(2);

  const PhysicalHandle on_host = physical(MemoryLocation::host);
  backend_->map(scratch, g_, on_host);
  backend_->copy_async(scratch, va, g_, CopyKind::device_to_host, {});
  backend_->stream_synchronize({});
  backend_->unmap(scratch, g_);
  backend_->unmap(va, g_);
  EXPECT_NE(error_of([&] { backend_->peer_has_access(va, 2); }).find("not in a mapped range"),
            std::string::npos)
      << "an unmapped range is forgotten with its access";
  backend_->map(va, g_, on_host);
  EXPECT_TRUE(backend_->peer_has_access(va, 2)) << "the host backing at the same address";

  backend_->unmap(va, g_);  // and back to device backing
  backend_->map(va, g_, on_device);
  EXPECT_TRUE(backend_->peer_has_access(va, 2));
  backend_->unmap(va, g_);
}

TEST_F(PeerAccess, BadPeersAreClearErrorsAndChangeNothing) {
  std::byte* va = reserve(1);
  backend_->map(va, g_, physical(MemoryLocation::device));
  EXPECT_NE(error_of([&] { backend_->enable_peer_access(-1); })
                .find("peer device -1 does not exist (the host backend has devices 0..15)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { backend_->enable_peer_access(kMaxDevices); })
                .find("peer device " + std::to_string(kMaxDevices) + " does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] { backend_->enable_peer_access(0); })
                .find("device 0 cannot be its own peer"),
            std::string::npos);
  EXPECT_TRUE(backend_->peers().empty());
  for (int d = 1; d < kMaxDevices; ++d) EXPECT_FALSE(backend_->peer_has_access(va, d)) << d;

  EXPECT_NE(error_of([&] { backend_->peer_has_access(nullptr, 1); }).find("null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { backend_->peer_has_access(va, kMaxDevices); }).find("not a device"),
            std::string::npos);
  EXPECT_NE(error_of([&] { backend_->peer_has_access(va + g_ + 1, 1); }).find("not in a mapped"),
            std::string::npos)
      << "past the mapping";
  // The same checks without a backend, as the device registry makes them.
  EXPECT_NE(error_of([] { check_peer_access(BackendKind::host, kMaxDevices, 0); })
                .find("device " + std::to_string(kMaxDevices) + " does not exist"),
            std::string::npos);
  if (cuda_device_count() == 0) {
    EXPECT_NE(error_of([] { check_peer_access(BackendKind::cuda, 0, 1); })
                  .find("device 0 does not exist (the cuda backend has no devices)"),
              std::string::npos);
  }
  backend_->unmap(va, g_);
}

TEST_F(PeerAccess, AGrantThatFailsInMapFailsTheMapAndLeavesTheRangeUnmapped) {
  backend_->enable_peer_access(1);
  std::byte* va = reserve(1);
  const PhysicalHandle h = physical(MemoryLocation::device);
  backend_->inject_fault(FaultPoint::peer_access);
  EXPECT_NE(error_of([&] { backend_->map(va, g_, h); }).find("injected fault"), std::string::npos);
  EXPECT_NE(error_of([&] { backend_->peer_has_access(va, 1); }).find("not in a mapped range"),
            std::string::npos);
  backend_->map(va, g_, h);  // nothing was left mapped: it maps again
  EXPECT_TRUE(backend_->peer_has_access(va, 1));
  backend_->unmap(va, g_);
}

TEST_F(PeerAccess, AGrantThatFailsInEnableLeavesThePeerUnrecordedAndARetryGrantsAll) {
  std::byte* va = reserve(2);
  backend_->map(va, g_, physical(MemoryLocation::device));
  backend_->map(va + g_, g_, physical(MemoryLocation::device));
  backend_->inject_fault(FaultPoint::peer_access);
  EXPECT_NE(error_of([&] { backend_->enable_peer_access(4); }).find("injected fault"),
            std::string::npos);
  EXPECT_TRUE(backend_->peers().empty());
  backend_->enable_peer_access(4);
  EXPECT_TRUE(backend_->peer_has_access(va, 4));
  EXPECT_TRUE(backend_->peer_has_access(va + g_, 4));
  backend_->unmap(va, 2 * g_);
}

// A range mapped while another thread enables peers is granted each of them, by the map
// or by the enable (the seam serialises the two on its peer mutex).
TEST_F(PeerAccess, MappingsRacingEnablesEndUpWithEveryPeer) {
  constexpr int kRanges = 24;
  std::byte* va = reserve(kRanges);
  std::vector<PhysicalHandle> handles;
  for (int i = 0; i < kRanges; ++i) handles.push_back(physical(MemoryLocation::device));
  std::atomic<bool> go{false};
  std::thread mapper([&] {
    while (!go.load()) std::this_thread::yield();
    for (int i = 0; i < kRanges; ++i) backend_->map(va + i * g_, g_, handles[i]);
  });
  go.store(true);
  for (int peer = 1; peer < kMaxDevices; ++peer) backend_->enable_peer_access(peer);
  mapper.join();
  for (int i = 0; i < kRanges; ++i)
    for (int peer = 1; peer < kMaxDevices; ++peer)
      EXPECT_TRUE(backend_->peer_has_access(va + i * g_, peer))
          << "range " << i << " peer " << peer;
  backend_->unmap(va, kRanges * g_);
}

}  // namespace
}  // namespace tidepool
