// The configuration parser (allocator/config.h) on random strings: entries of PyTorch's,
// tidepool's keys with good and bad values, other backends, blank entries, brackets,
// separators and stray characters, in random order. Whatever the string:
//   - claim_config returns or throws ConfigError naming the source, nothing else;
//   - a string that does not turn tidepool on comes back whole, for PyTorch;
//   - one that does splits in two that claim again to the same: the claimed entries give
//     the same configuration, and what is left for PyTorch names no tidepool key;
//   - the C call tidepool_config_claim says the same through buffers of every size, never
//     writes past them (ASan checks, the buffers are exactly as large as said) and always
//     leaves a NUL-terminated error.
// Size: TIDEPOOL_TEST_SCALE x 20k strings; TIDEPOOL_TEST_SEED draws other ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "allocator/config.h"
#include "tests/support/test_scale.h"
#include "tests/support/test_seed.h"

namespace tidepool {
namespace {

const std::vector<std::string> kPyTorchEntries = {
    "expandable_segments:True", "max_split_size_mb:128", " max_split_size_mb : 64 ",
    "roundup_power2_divisions:[256:1,512:2,1024:4]", "garbage_collection_threshold:0.6",
    "pinned_use_cuda_host_register:True", "a:[[1,2],[3]]", "weird", "", "   ", "x:[", "]",
    "tidepoolish:1", "backend", "backend:", "\xc3\xa9t\xc3\xa9:1"};
const std::vector<std::string> kBackendEntries = {"backend:tidepool", " backend : tidepool ",
                                                  "backend:native", "backend:cudaMallocAsync"};
const std::vector<std::string> kTidepoolEntries = {
    "tidepool.mode:pool", "tidepool.mode:global", "tidepool.mode:bogus", "tidepool.mode",
    "tidepool.mode:", "tidepool.state_budget:2GiB", "tidepool.state_budget:25%",
    "tidepool.state_budget:-1", "tidepool.state_budget:101%", "tidepool.state_budget:0",
    "tidepool.pinned_budget:1TiB", "tidepool.pinned_budget:1e400", "tidepool.log:debug",
    "tidepool.log:loud", "tidepool.device_backend:host", "tidepool.device_backend:auto",
    "tidepool.optimizer_hooks:off", "tidepool.optimizer_hooks:maybe",
    "tidepool.tier_min_bytes:64KiB", "tidepool.tier_min_bytes:99999999999999999999999",
    "tidepool.unknown:1", "tidepool", "tidepool.:1", " tidepool.log : info "};
constexpr char kStray[] = ",:[] \t%.0123456789abkKMGiBtidepol\xc3\xa9";

// tidepool_config_claim through buffers of exactly the given sizes (heap, so that ASan
// sees a write past one).
struct CClaim {
  int status;
  std::string remaining, json, error;
};
CClaim c_claim(const std::string& conf, std::size_t remaining_size, std::size_t json_size,
               std::size_t error_size) {
  std::vector<char> remaining(remaining_size), json(json_size), error(error_size);
  const int status =
      tidepool_config_claim(conf.c_str(), remaining.empty() ? nullptr : remaining.data(),
                            remaining.size(), json.empty() ? nullptr : json.data(), json.size(),
                            error.empty() ? nullptr : error.data(), error.size());
  auto text = [](const std::vector<char>& buffer) {
    const auto end = std::find(buffer.begin(), buffer.end(), '\0');
    EXPECT_TRUE(buffer.empty() || end != buffer.end()) << "a buffer left without its NUL";
    return std::string(buffer.begin(), end);
  };
  return {status, text(remaining), text(json), text(error)};
}

TEST(ConfigRandom, AnyStringIsClaimedConsistentlyOrRefusedWithAConfigError) {
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(20261204));
  auto pick = [&](const std::vector<std::string>& from) { return from[rng() % from.size()]; };
  const long strings = test_support::scaled(20000);
  long claimed = 0, refused = 0, untouched = 0;
  for (long n = 0; n < strings && !::testing::Test::HasFailure(); ++n) {
    std::string conf;
    const int entries = static_cast<int>(rng() % 6);
    for (int i = 0; i < entries; ++i) {
      if (i > 0) conf += rng() % 10 == 0 ? ",," : ",";
      switch (rng() % 8) {
        case 0: case 1: case 2: conf += pick(kPyTorchEntries); break;
        case 3: conf += pick(kBackendEntries); break;
        case 4: case 5: case 6: conf += pick(kTidepoolEntries); break;
        default:
          for (int c = static_cast<int>(rng() % 6); c > 0; --c)
            conf += kStray[rng() % (sizeof kStray - 1)];
      }
    }
    SCOPED_TRACE("conf '" + conf + "'");
    ClaimResult result;
    bool ok = false;
    try {
      result = claim_config(conf);
      ok = true;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("allocator configuration: ", 0), 0u) << e.what();
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a ConfigError: " << e.what();
    }
    if (ok && !result.config.enabled) {
      EXPECT_EQ(result.remaining, conf);
      ++untouched;
    } else if (ok) {
      ++claimed;
      const ClaimResult again = claim_config(result.claimed);
      EXPECT_TRUE(again.config == result.config) << "claimed '" << result.claimed << "'";
      EXPECT_EQ(again.remaining, "");
      const ClaimResult left = claim_config(result.remaining);
      EXPECT_FALSE(left.config.enabled) << "left '" << result.remaining << "'";
      EXPECT_EQ(left.remaining, result.remaining);
    }
    // The C call: ample buffers say the same; buffers of random sizes, -2 or the same.
    const CClaim ample = c_claim(conf, conf.size() + 1, 4096, 2048);
    EXPECT_EQ(ample.status, !ok ? -1 : result.config.enabled ? 1 : 0) << ample.error;
    if (ok) {
      EXPECT_EQ(ample.remaining, result.remaining);
      EXPECT_EQ(ample.json, config_to_json(result.config));
      EXPECT_EQ(ample.error, "");
    }
    const std::size_t remaining_size = rng() % (conf.size() + 2), json_size = rng() % 400;
    const CClaim tight = c_claim(conf, remaining_size, json_size, rng() % 80);
    // The same with room for the whole message: a short error buffer holds its start.
    const CClaim told = c_claim(conf, remaining_size, json_size, 2048);
    EXPECT_EQ(told.status, tight.status);
    EXPECT_EQ(told.error.substr(0, tight.error.size()), tight.error);
    if (tight.status == -2) {
      EXPECT_NE(told.error.find("too small"), std::string::npos) << told.error;
    } else {
      EXPECT_EQ(tight.status, ample.status) << told.error;
      EXPECT_EQ(told.error, ample.error);
      if (tight.status >= 0) {
        EXPECT_EQ(tight.remaining, ample.remaining);
      }
    }
  }
  // The strings reached every outcome.
  EXPECT_GT(claimed, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(untouched, 0);
}

}  // namespace
}  // namespace tidepool
