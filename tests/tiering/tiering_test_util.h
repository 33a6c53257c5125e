// Shared pieces of the tiering tests: the backend parameter, scale, byte patterns, and the
// set-ups several files repeat (store options, a handle used by a stream of its own).
//
// Each test_*.cpp instantiates its suites on the host backend. The gpu_test_*.cpp files
// define TIDEPOOL_TIERING_BACKENDS as the cuda backend and include the same test file,
// so the identical battery runs on a GPU where one exists (and skips itself otherwise).
// Device memory is only ever touched through the seam (copies, memsets), never by host
// loads and stores, so the tests are valid on both backends.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/config.h"
#include "tiering/host_arena.h"
#include "tiering/tiered_store.h"
#include "tests/support/stream_gate.h"
#include "tests/support/test_backend.h"
#include "tests/support/test_scale.h"
#include "tests/support/test_seed.h"

#ifndef TIDEPOOL_TIERING_BACKENDS
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::host)
#endif

namespace tidepool::tiering_test {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// A configuration applied for one scope, as the start-up hook would apply it (tiering
// reads tidepool.state_budget and the other keys from there); no configuration after.
class ConfigScope {
 public:
  explicit ConfigScope(const char* conf) { apply_config(claim_config(conf).config); }
  ~ConfigScope() { apply_config(Config{}); }
  ConfigScope(const ConfigScope&) = delete;
  ConfigScope& operator=(const ConfigScope&) = delete;
};


// The fixture of a suite that runs only where the process's backend is the host
// backend, on device `Device`: it asks for the host backend before the suite's first
// test (a request that fails when the binary chose a backend already) and skips each
// test where the backend is another. A fixture with more set-up calls this SetUp first
// and returns when IsSkipped().
template <int Device>
class HostBackendTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tidepool_set_backend("host"); }
  void SetUp() override {
    if (std::strcmp(tidepool_backend_name(Device), "host") != 0)
      GTEST_SKIP() << "the process's backend is not host";
  }
};

inline std::string backend_name(const ::testing::TestParamInfo<BackendKind>& info) {
  return info.param == BackendKind::host ? "host" : "cuda";
}

// Host arena options for tests: an explicit pinned budget, not capped by this machine's
// RLIMIT_MEMLOCK (the host backend records registrations without locking pages).
inline HostArenaOptions test_host_options(std::size_t pinned_budget = std::size_t{512} << 20) {
  HostArenaOptions o;
  o.pinned_budget_bytes = pinned_budget;
  o.respect_memlock_limit = false;
  return o;
}

// Tiered store options for tests: `device_budget` and test_host_options().
inline TieredStoreOptions test_store_options(std::size_t device_budget) {
  TieredStoreOptions o;
  o.device_budget_bytes = device_budget;
  o.host = test_host_options();
  return o;
}

// test_store_options with 64 KiB copy chunks, so that a handle of a few hundred KiB is
// copied in several chunks.
inline TieredStoreOptions small_chunk_store_options(std::size_t device_budget) {
  TieredStoreOptions o = test_store_options(device_budget);
  o.copy.chunk_bytes = 64 << 10;
  return o;
}

// A new handle of `store` acquired on a stream made for it, which the use-stream tests
// (Note [Use streams] in tiered_store.h) then release, forget or destroy. The caller
// writes through `dev` and releases the handle.
struct AcquiredOnNewStream {
  TieredStore::Handle handle;
  Stream stream;
  void* dev;
};
inline AcquiredOnNewStream acquire_on_new_stream(TieredStore& store, std::size_t bytes, int tag) {
  AcquiredOnNewStream a{};
  a.handle = store.create(bytes, tag);
  a.stream = store.backend().create_stream();
  a.dev = store.acquire(a.handle, a.stream);
  return a;
}

// Fixture: builds the parameter's backend; skips the cuda one without a GPU.
class TieringTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    backend_ = test_support::make_test_backend(GetParam(), capacity_bytes());
    if (!backend_) GTEST_SKIP() << "no CUDA device";
  }
  virtual std::size_t capacity_bytes() const { return std::size_t{1} << 30; }
  bool on_host() const { return GetParam() == BackendKind::host; }
  Backend& backend() { return *backend_; }

  // Copies `bytes` of device memory at `dev` to a host vector (waits on `s`).
  std::vector<unsigned char> read_device(const void* dev, std::size_t bytes, Stream s) {
    std::vector<unsigned char> out(bytes);
    backend_->copy_async(out.data(), dev, bytes, CopyKind::device_to_host, s);
    backend_->stream_synchronize(s);
    return out;
  }

  std::unique_ptr<Backend> backend_;
};

// TieringTest with one stream of its own for the test's device work.
class TieringStreamTest : public TieringTest {
 protected:
  void SetUp() override {
    TieringTest::SetUp();
    if (IsSkipped()) return;
    stream_ = backend().create_stream();
  }
  void TearDown() override {
    if (backend_ && stream_.handle) backend().destroy_stream(stream_);
  }
  Stream stream_;
};

using test_support::StreamGate;

// Deterministic random bytes.
inline std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t r = rng();
    for (std::size_t k = 0; k < 8 && i + k < n; ++k)
      v[i + k] = static_cast<unsigned char>(r >> (8 * k));
  }
  return v;
}

// The latest contents of a handle not acquired (TieredStore::read: waits for them).
inline std::vector<unsigned char> contents(TieredStore& store, TieredStore::Handle h) {
  std::vector<unsigned char> out(store.size(h));
  store.read(h, out.data());
  return out;
}

// Index of the first differing byte, or -1.
inline long first_difference(const unsigned char* a, const unsigned char* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<long>(i);
  }
  return -1;
}

}  // namespace tidepool::tiering_test
