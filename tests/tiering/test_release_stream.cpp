// release_stream in the tiering layer waits only for a stream that something there used
// (Note [Releasing a stream no range used] in vmm_migration.cpp, Note [Use streams] in
// tiered_store.h): a stream no range or handle names costs no backend call, one that was
// used is waited for once and forgotten, and a failed wait forgets nothing. Checked on
// VmmPool and TieredStore directly, and through tidepool_release_stream, whose tier route
// reaches the device's pool and stores. Host backend, under a wrapper that counts the
// stream_synchronize calls the tiering objects make (failing_backend.h).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/c_api_tiering.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::FailingBackend;

void set_flag(void* flag) { static_cast<std::atomic<bool>*>(flag)->store(true); }

// The parameter names the tiering object under test; use() makes a stream one of its
// users the way its callers do (record_use on a range, acquire of a handle).
class ReleaseStreamTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "vmm_pool") {
      pool_.emplace(backend_);
      range_ = pool_->allocate(backend_.granularity(), kTagOptimizerState);
      ASSERT_NE(range_, nullptr);
    } else {
      store_.emplace(backend_, tiering_test::test_store_options(1 << 20));
    }
  }
  void TearDown() override {
    if (pool_ && range_ != nullptr) pool_->deallocate(range_);
    for (const TieredStore::Handle h : handles_) store_->destroy(h);
  }

  void use(Stream s) {
    if (pool_) {
      pool_->record_use(range_, s);
    } else {
      const TieredStore::Handle h = store_->create(4096, kTagOptimizerState);
      handles_.push_back(h);
      store_->acquire(h, s);
      store_->release(h, /*dirty=*/false);
    }
  }
  bool release(Stream s) { return pool_ ? pool_->release_stream(s) : store_->release_stream(s); }
  long syncs() const { return backend_.calls_to("stream_synchronize"); }

  std::unique_ptr<Backend> inner_ = make_host_backend(0);
  FailingBackend backend_{*inner_};
  std::optional<VmmPool> pool_;
  void* range_ = nullptr;
  std::optional<TieredStore> store_;
  std::vector<TieredStore::Handle> handles_;
};

TEST_P(ReleaseStreamTest, AStreamNothingUsedIsReleasedWithoutABackendCall) {
  const Stream user = backend_.create_stream();
  use(user);  // the object has a user: just not the stream released below
  const Stream unused = backend_.create_stream();
  const long before = syncs();
  EXPECT_FALSE(release(unused));
  EXPECT_EQ(syncs(), before) << "waited for a stream nothing here used";
  // As for the allocator: one already destroyed has nothing here to lose either.
  backend_.destroy_stream(unused);
  EXPECT_FALSE(release(unused));
  EXPECT_EQ(syncs(), before);
  EXPECT_TRUE(release(user));
  backend_.destroy_stream(user);
}

TEST_P(ReleaseStreamTest, AUsedStreamIsWaitedForOnceAndThenForgotten) {
  const Stream user = backend_.create_stream();
  use(user);
  std::atomic<bool> queued_work_done{false};
  backend_.launch_host_func(user, &set_flag, &queued_work_done);
  const long before = syncs();
  EXPECT_TRUE(release(user));
  EXPECT_TRUE(queued_work_done.load()) << "returned before the stream's work was done";
  EXPECT_EQ(syncs(), before + 1);
  // Forgotten: a second release names nothing, so it waits for nothing.
  EXPECT_FALSE(release(user));
  EXPECT_EQ(syncs(), before + 1);
  backend_.destroy_stream(user);
}

TEST_P(ReleaseStreamTest, AFailedWaitThrowsAndForgetsNothing) {
  const Stream user = backend_.create_stream();
  use(user);
  backend_.fail_calls_to("stream_synchronize", 1);
  EXPECT_THROW(release(user), BackendError);
  EXPECT_TRUE(release(user)) << "the failed release forgot the stream";
  backend_.destroy_stream(user);
}

INSTANTIATE_TEST_SUITE_P(Objects, ReleaseStreamTest,
                         ::testing::Values(std::string("vmm_pool"), std::string("tiered_store")),
                         [](const auto& param_info) { return param_info.param; });

// tidepool_release_stream on a device with a pool and a store. The tiering registry of
// the device runs on a counting wrapper of the allocator's backend, so the streams are
// shared and only the tiering layer's synchronizes are counted.
constexpr int kRouteDevice = 6;  // a device index no other suite of this binary uses

class RouteReleaseStreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tidepool_set_backend("host");  // fails if already chosen; SetUp checks which one
    if (std::strcmp(tidepool_backend_name(kRouteDevice), "host") != 0) return;
    // Lives for the process, as the registry borrows it.
    tiering_ = new FailingBackend(device_allocator(kRouteDevice).backend());
    set_tiering_backend(kRouteDevice, tiering_);
  }
  void SetUp() override {
    if (tiering_ == nullptr) GTEST_SKIP() << "the process's backend is not host";
    range_ = tidepool_vmm_malloc(2 << 20, kRouteDevice, kTagOptimizerState, nullptr);
    ASSERT_NE(range_, nullptr) << tidepool_last_error();
    store_.emplace(*tiering_, tiering_test::test_store_options(1 << 20));
  }
  void TearDown() override {
    for (const TieredStore::Handle h : handles_) store_->destroy(h);
    store_.reset();
    if (range_ != nullptr) {
      EXPECT_EQ(tidepool_vmm_free(range_, kRouteDevice), 0) << tidepool_last_error();
    }
  }

  void use_handle(Stream s) {
    const TieredStore::Handle h = store_->create(4096, kTagOptimizerState);
    handles_.push_back(h);
    store_->acquire(h, s);
    store_->release(h, /*dirty=*/false);
  }
  static long syncs() { return tiering_->calls_to("stream_synchronize"); }

  static FailingBackend* tiering_;
  void* range_ = nullptr;
  std::optional<TieredStore> store_;
  std::vector<TieredStore::Handle> handles_;
};
FailingBackend* RouteReleaseStreamTest::tiering_ = nullptr;

TEST_F(RouteReleaseStreamTest, AStreamNoRangeOrHandleUsedIsNotWaitedFor) {
  const Stream user = tiering_->create_stream();
  ASSERT_EQ(tidepool_record_stream(range_, kRouteDevice, user.handle), 0) << tidepool_last_error();
  use_handle(user);
  const Stream unused = tiering_->create_stream();
  const long before = syncs();
  EXPECT_EQ(tidepool_release_stream(kRouteDevice, unused.handle), 0) << tidepool_last_error();
  EXPECT_EQ(syncs(), before) << "waited for a stream no range or handle used";
  tiering_->destroy_stream(unused);
  EXPECT_EQ(tidepool_release_stream(kRouteDevice, unused.handle), 0) << tidepool_last_error();
  EXPECT_EQ(syncs(), before);
  ASSERT_EQ(tidepool_release_stream(kRouteDevice, user.handle), 0) << tidepool_last_error();
  tiering_->destroy_stream(user);
}

// One wait per release, by whichever object names the stream (the pool, or a store when
// only a handle used it), and none once the stream is forgotten.
TEST_F(RouteReleaseStreamTest, AStreamARangeOrAHandleUsedIsWaitedForOnce) {
  const Stream range_and_handle_user = tiering_->create_stream();
  ASSERT_EQ(tidepool_record_stream(range_, kRouteDevice, range_and_handle_user.handle), 0)
      << tidepool_last_error();
  use_handle(range_and_handle_user);
  const Stream handle_user = tiering_->create_stream();
  use_handle(handle_user);
  for (const Stream s : {range_and_handle_user, handle_user}) {
    std::atomic<bool> queued_work_done{false};
    tiering_->launch_host_func(s, &set_flag, &queued_work_done);
    const long before = syncs();
    ASSERT_EQ(tidepool_release_stream(kRouteDevice, s.handle), 0) << tidepool_last_error();
    EXPECT_TRUE(queued_work_done.load()) << "returned before the stream's work was done";
    EXPECT_EQ(syncs(), before + 1);
    ASSERT_EQ(tidepool_release_stream(kRouteDevice, s.handle), 0) << tidepool_last_error();
    EXPECT_EQ(syncs(), before + 1) << "a released stream is still named somewhere";
    tiering_->destroy_stream(s);
  }
  // Nothing waits on the destroyed handles any more.
  for (const TieredStore::Handle h : handles_) EXPECT_NO_THROW(store_->evict(h));
  EXPECT_EQ(tidepool_evict_ptr(kRouteDevice, range_), 0) << tidepool_last_error();
}

}  // namespace
}  // namespace tidepool
