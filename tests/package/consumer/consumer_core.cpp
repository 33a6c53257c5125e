// A trainer-side program built against the *installed* tidepool (tests/package): the C
// ABI a Python hook would call, and the C++ tiered store an optimizer would use, on the
// host backend. Exits non-zero, saying what failed, when the installed package is wrong.
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "tiering/tiered_store.h"

#if EXPECT_OPTIM
int run_optimizer_check();
#endif

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "tidepool_consumer: %s\n", what);
  return 1;
}

int run_c_api_check() {
  void* p = tidepool_malloc(1 << 20, 0, nullptr);
  if (p == nullptr) return fail(tidepool_last_error());
  std::memset(p, 0x5a, 1 << 20);  // host backend: device memory is host memory
  tidepool_free(p, 1 << 20, 0, nullptr);
  if (tidepool_malloc(-1, 0, nullptr) != nullptr) return fail("a negative size was accepted");
  const char* why = tidepool_last_error();
  if (why == nullptr || why[0] == '\0') return fail("a bad request left no error message");
  return 0;
}

int run_tiered_store_check() {
  auto backend = tidepool::make_host_backend();
  tidepool::TieredStoreOptions options;
  options.device_budget_bytes = 4 << 20;
  tidepool::TieredStore store(*backend, options);
  std::vector<unsigned char> written(3 << 20), read_back(3 << 20);
  for (std::size_t i = 0; i < written.size(); ++i) written[i] = static_cast<unsigned char>(i * 7);
  const auto h = store.create(written.size(), TIDEPOOL_TAG_OPTIMIZER_STATE);
  store.write(h, written.data());
  auto* device = static_cast<unsigned char*>(store.acquire(h, tidepool::Stream{}));
  backend->stream_synchronize(tidepool::Stream{});
  device[0] ^= 0xff;
  store.release(h, /*dirty=*/true);
  store.evict(h);
  store.read(h, read_back.data());
  written[0] ^= 0xff;
  if (read_back != written) return fail("tiered store lost data across acquire/evict/read");
  return 0;
}

}  // namespace

int main() {
  if (int rc = run_c_api_check()) return rc;
  if (int rc = run_tiered_store_check()) return rc;
#if EXPECT_OPTIM
  if (int rc = run_optimizer_check()) return rc;
#endif
  std::puts("tidepool_consumer: installed package OK");
  return 0;
}
