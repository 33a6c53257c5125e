// Tests of the configuration parser (allocator/config.h): which entries of a
// PYTORCH_*_ALLOC_CONF string tidepool claims, what it leaves for PyTorch, every key's
// values, the error texts for bad input, the C ABI wrapper, and install_from_env's
// rewriting of the environment.
#include "allocator/config.h"

#include <gtest/gtest.h>

#include "allocator/c_api.h"
#include "allocator/tier_routing.h"

#include <cstdlib>
#include <optional>
#include <string>

namespace tidepool {
namespace {

// The message of the ConfigError `fn` throws (fails the test when it throws nothing).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return {};
}

TEST(ConfigClaim, BackendTidepoolIsClaimedAndPyTorchKeysStayInOrder) {
  const ClaimResult r = claim_config(
      "expandable_segments:True,backend:tidepool,max_split_size_mb:128,"
      "garbage_collection_threshold:0.6");
  EXPECT_TRUE(r.config.enabled);
  EXPECT_EQ(r.remaining,
            "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.6");
  EXPECT_EQ(r.config.mode, Mode::global);
}

TEST(ConfigClaim, NothingNamedLeavesTheStringExactlyAsGiven) {
  for (const char* conf : {"", "expandable_segments:True",
                           " max_split_size_mb:128 ,,backend:native", "backend:cudaMallocAsync"}) {
    const ClaimResult r = claim_config(conf);
    EXPECT_FALSE(r.config.enabled) << conf;
    EXPECT_EQ(r.remaining, conf);
    EXPECT_EQ(r.config, Config{});
  }
}

TEST(ConfigClaim, OnlyTidepoolEntriesLeaveNothing) {
  const ClaimResult r = claim_config("backend:tidepool, tidepool.mode:pool ,tidepool.log:debug");
  EXPECT_TRUE(r.config.enabled);
  EXPECT_EQ(r.remaining, "");
  EXPECT_EQ(r.config.mode, Mode::pool);
  EXPECT_EQ(r.config.log, LogLevel::debug);
}

TEST(ConfigClaim, AnyTidepoolKeyEnablesWithoutBackendEntry) {
  const ClaimResult r = claim_config("tidepool.state_budget:1GiB,expandable_segments:True");
  EXPECT_TRUE(r.config.enabled);
  EXPECT_EQ(r.remaining, "expandable_segments:True");
  EXPECT_EQ(r.config.state_budget.bytes, 1ull << 30);
}

TEST(ConfigClaim, BracketedPyTorchListsAreKeptWhole) {
  const ClaimResult r =
      claim_config("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],tidepool.mode:pool,"
                   "max_split_size_mb:64");
  EXPECT_EQ(r.remaining, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],max_split_size_mb:64");
  EXPECT_EQ(r.config.mode, Mode::pool);
}

TEST(ConfigClaim, PyTorchEntriesAreVerbatimIncludingSpaces) {
  const ClaimResult r = claim_config(" expandable_segments: True,backend:tidepool");
  EXPECT_EQ(r.remaining, " expandable_segments: True");
}

TEST(ConfigClaim, DefaultsWhenOnlyBackendIsNamed) {
  const Config c = claim_config("backend:tidepool").config;
  EXPECT_EQ(c.mode, Mode::global);
  EXPECT_EQ(c.state_budget, (Budget{Budget::Kind::bytes, 0, 0.0}));
  EXPECT_EQ(c.pinned_budget.kind, Budget::Kind::unset);
  EXPECT_EQ(c.log, LogLevel::warn);
  EXPECT_EQ(c.device_backend, DeviceBackendChoice::automatic);
  EXPECT_TRUE(c.optimizer_hooks);
  EXPECT_EQ(c.tier_min_bytes, kDefaultTierMinBytes);
}

TEST(ConfigClaim, EveryKeyAndValue) {
  const Config c = claim_config(
                       "tidepool.mode:pool,tidepool.state_budget:25%,tidepool.pinned_budget:16GiB,"
                       "tidepool.log:off,tidepool.device_backend:host,tidepool.optimizer_hooks:off,"
                       "tidepool.tier_min_bytes:2MiB")
                       .config;
  EXPECT_EQ(c.mode, Mode::pool);
  EXPECT_EQ(c.state_budget.kind, Budget::Kind::fraction);
  EXPECT_DOUBLE_EQ(c.state_budget.fraction, 0.25);
  EXPECT_EQ(c.pinned_budget, (Budget{Budget::Kind::bytes, 16ull << 30, 0.0}));
  EXPECT_EQ(c.log, LogLevel::off);
  EXPECT_EQ(c.device_backend, DeviceBackendChoice::host);
  EXPECT_FALSE(c.optimizer_hooks);
  EXPECT_EQ(c.tier_min_bytes, std::uint64_t{2} << 20);

  EXPECT_EQ(claim_config("tidepool.device_backend:cuda").config.device_backend,
            DeviceBackendChoice::cuda);
  EXPECT_EQ(claim_config("tidepool.log:info").config.log, LogLevel::info);
  const Budget unlimited = claim_config("tidepool.pinned_budget:unlimited").config.pinned_budget;
  EXPECT_EQ(unlimited.kind, Budget::Kind::fraction);
  EXPECT_EQ(unlimited.fraction, 1.0);
}

TEST(ConfigBudget, UnitsAndPercentages) {
  const auto bytes = [](const char* v) { return parse_budget("k", v).bytes; };
  EXPECT_EQ(bytes("0"), 0u);
  EXPECT_EQ(bytes("65536"), 65536u);
  EXPECT_EQ(bytes("100B"), 100u);
  EXPECT_EQ(bytes("3KiB"), 3072u);
  EXPECT_EQ(bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(bytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(bytes("2TiB"), 2ull << 40);
  EXPECT_EQ(bytes("2KB"), 2000u);
  EXPECT_EQ(bytes("7MB"), 7000000u);
  EXPECT_EQ(bytes("4GB"), 4000000000ull);
  EXPECT_EQ(bytes("1TB"), 1000000000000ull);
  const Budget half = parse_budget("k", "50%");
  EXPECT_EQ(half.kind, Budget::Kind::fraction);
  EXPECT_EQ(half.resolve(1000, 7), 500u);
  EXPECT_EQ(parse_budget("k", "100%").resolve(1000, 7), 1000u);
  EXPECT_EQ(Budget{}.resolve(1000, 7), 7u);
  EXPECT_EQ(parse_budget("k", "4GiB").resolve(1000, 7), 4ull << 30);
}

TEST(ConfigBudget, BadSizesNameTheKeyAndTheForm) {
  for (const char* v : {"", "-1", "GiB", "4XB", "4 GiB", "inf", "0x10", "1e9", "4gib", "%"}) {
    const std::string msg = error_of([&] { parse_budget("tidepool.state_budget", v); });
    EXPECT_NE(msg.find("tidepool.state_budget"), std::string::npos) << v << ": " << msg;
    EXPECT_NE(msg.find("GiB"), std::string::npos) << v << ": " << msg;
  }
  EXPECT_NE(error_of([] { parse_budget("k", "0%"); }).find("(0%, 100%]"), std::string::npos);
  EXPECT_NE(error_of([] { parse_budget("k", "150%"); }).find("(0%, 100%]"), std::string::npos);
  EXPECT_NE(error_of([] { parse_budget("k", "1.5"); }).find("whole number of bytes"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_budget("k", "99999999TiB"); }).find("too large"),
            std::string::npos);
}

// Whole byte counts are exact beyond a double's 53 bits (9007199254740993 read as one
// byte less), up to just below 2^63.
TEST(ConfigBudget, WholeByteCountsAreExact) {
  EXPECT_EQ(parse_byte_count("k", "9007199254740993"), 9007199254740993ull);
  EXPECT_EQ(parse_byte_count("k", "9223372036854775807"), 9223372036854775807ull);
  EXPECT_EQ(parse_byte_count("k", "8388607TiB"), 8388607ull << 40);
  EXPECT_EQ(parse_byte_count("k", "9007199254740993B"), 9007199254740993ull);
  for (const char* v : {"9223372036854775808", "8388608TiB", "18446744073709551616",
                        "18446744073709551615KiB"}) {
    EXPECT_NE(error_of([&] { parse_byte_count("k", v); }).find("too large"), std::string::npos)
        << v;
  }
}

TEST(ConfigTierMinBytes, DefaultsToOneMiBAndTakesByteCounts) {
  EXPECT_EQ(Config{}.tier_min_bytes, std::uint64_t{1} << 20);
  EXPECT_EQ(claim_config("backend:tidepool").config.tier_min_bytes, std::uint64_t{1} << 20);
  EXPECT_EQ(claim_config("tidepool.tier_min_bytes:256KiB").config.tier_min_bytes, 262144u);
  EXPECT_EQ(claim_config("tidepool.tier_min_bytes:0").config.tier_min_bytes, 0u);
  EXPECT_EQ(claim_config("tidepool.tier_min_bytes:3000000").config.tier_min_bytes, 3000000u);
  EXPECT_EQ(claim_config("tidepool.tier_min_bytes:1.5MiB").config.tier_min_bytes, 1572864u);
}

TEST(ConfigTierMinBytes, BadValuesNameTheKeyAndSayWhatItTakes) {
  EXPECT_EQ(error_of([] { claim_config("tidepool.tier_min_bytes:10%", "X"); }),
            "X: tidepool.tier_min_bytes: '10%' is not a valid value; allowed: a byte count with "
            "an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 1MiB; "
            "not a percentage");
  for (const char* v : {"lots", "-1", "1e6", "2 MiB", "inf"}) {
    const std::string msg =
        error_of([&] { claim_config(std::string("tidepool.tier_min_bytes:") + v, "X"); });
    const std::string expected =
        std::string("X: tidepool.tier_min_bytes: '") + v + "' is not a valid value";
    EXPECT_EQ(msg.rfind(expected, 0), 0u) << msg;
  }
  EXPECT_NE(error_of([] { claim_config("tidepool.tier_min_bytes:1.5"); })
                .find("whole number of bytes"),
            std::string::npos);
  EXPECT_NE(error_of([] { claim_config("tidepool.tier_min_bytes:99999999TiB"); }).find("too large"),
            std::string::npos);
  // More digits than a double holds: out of range, not read as 0 bytes.
  for (const std::string& digits : {std::string(400, '9'), "1" + std::string(400, '0') + "GiB",
                                   "0." + std::string(400, '0') + "1"}) {
    const std::string entry = "tidepool.tier_min_bytes:" + digits;
    const std::string msg = error_of([&] { claim_config(entry); });
    EXPECT_NE(msg.find(digits.size() > 400 && digits[0] == '0' ? "whole number" : "too large"),
              std::string::npos) << msg.substr(0, 80);
  }
  EXPECT_EQ(error_of([] { claim_config("tidepool.tier_min_bytes", "X"); }),
            "X: tidepool.tier_min_bytes needs a value (key:value); allowed: a byte count with an "
            "optional unit, e.g. 0, 1MiB, 262144");
}

TEST(ConfigTierMinBytes, ApplyingSetsTheRoutesThreshold) {
  apply_config(claim_config("tidepool.tier_min_bytes:4MiB").config);
  EXPECT_EQ(tier_min_bytes(), std::size_t{4} << 20);
  apply_config(Config{});
  EXPECT_EQ(tier_min_bytes(), kDefaultTierMinBytes);
}

TEST(ConfigErrors, UnknownKeyNamesItAndListsTheKnownOnes) {
  const std::string msg =
      error_of([] {
        claim_config("backend:tidepool,tidepool.moed:pool", "PYTORCH_CUDA_ALLOC_CONF");
      });
  EXPECT_EQ(msg,
            "PYTORCH_CUDA_ALLOC_CONF: unknown key 'tidepool.moed'; tidepool keys are: "
            "backend:tidepool, tidepool.mode, tidepool.state_budget, tidepool.pinned_budget, "
            "tidepool.log, tidepool.device_backend, tidepool.optimizer_hooks, "
            "tidepool.tier_min_bytes");
  EXPECT_NE(error_of([] { claim_config("tidepool:on"); }).find("unknown key 'tidepool'"),
            std::string::npos);
}

TEST(ConfigErrors, BadValueNamesKeyValueAndAllowedValues) {
  EXPECT_EQ(error_of([] { claim_config("tidepool.mode:globl", "PYTORCH_ALLOC_CONF"); }),
            "PYTORCH_ALLOC_CONF: tidepool.mode: 'globl' is not a valid value; "
            "allowed: global, pool");
  EXPECT_EQ(error_of([] { claim_config("tidepool.log:verbose", "X"); }),
            "X: tidepool.log: 'verbose' is not a valid value; allowed: off, warn, info, debug");
  EXPECT_EQ(error_of([] { claim_config("tidepool.device_backend:rocm", "X"); }),
            "X: tidepool.device_backend: 'rocm' is not a valid value; allowed: auto, cuda, host");
  EXPECT_EQ(error_of([] { claim_config("tidepool.optimizer_hooks:yes", "X"); }),
            "X: tidepool.optimizer_hooks: 'yes' is not a valid value; allowed: on, off");
  const std::string budget = error_of([] { claim_config("tidepool.pinned_budget:lots", "X"); });
  EXPECT_EQ(budget.rfind("X: tidepool.pinned_budget: 'lots' is not a valid value", 0), 0u)
      << budget;
}

TEST(ConfigErrors, MissingValueDuplicatesAndConflicts) {
  EXPECT_EQ(error_of([] { claim_config("tidepool.mode", "X"); }),
            "X: tidepool.mode needs a value (key:value); allowed: global, pool");
  EXPECT_EQ(error_of([] { claim_config("tidepool.mode:", "X"); }),
            "X: tidepool.mode needs a value (key:value); allowed: global, pool");
  EXPECT_EQ(error_of([] { claim_config("tidepool.mode:pool,tidepool.mode:global", "X"); }),
            "X: tidepool.mode is given twice");
  EXPECT_EQ(error_of([] { claim_config("backend:tidepool,backend:tidepool", "X"); }),
            "X: backend:tidepool is given twice");
  EXPECT_EQ(error_of([] { claim_config("backend:native,backend:tidepool", "X"); }),
            "X: backend:tidepool conflicts with 'backend:native'; name one backend");
  // Note [one backend]: tidepool keys alone turn tidepool on, so they conflict too.
  EXPECT_EQ(error_of([] { claim_config("tidepool.mode:pool,backend:cudaMallocAsync", "X"); }),
            "X: tidepool.mode:pool conflicts with 'backend:cudaMallocAsync'; name one backend");
  EXPECT_EQ(error_of([] { claim_config("backend:native, tidepool.log:off", "X"); }),
            "X: tidepool.log:off conflicts with 'backend:native'; name one backend");
  // Pool mode keeps PyTorch's native allocator: naming it is no conflict.
  EXPECT_EQ(claim_config("backend:native,tidepool.mode:pool", "X").remaining, "backend:native");
  EXPECT_NE(error_of([] { claim_config("a:[1,2,backend:tidepool", "X"); }).find("unbalanced '['"),
            std::string::npos);
  EXPECT_NE(error_of([] { claim_config("a:1],backend:tidepool", "X"); }).find("unbalanced ']'"),
            std::string::npos);
}

TEST(ConfigJson, DescribesEveryField) {
  EXPECT_EQ(config_to_json(claim_config("tidepool.mode:pool,tidepool.state_budget:10%,"
                                        "tidepool.pinned_budget:2KiB,tidepool.log:info")
                               .config),
            R"({"enabled":true,"mode":"pool",)"
            R"("state_budget":{"kind":"fraction","fraction":0.1},)"
            R"("pinned_budget":{"kind":"bytes","bytes":2048},"log":"info","device_backend":"auto",)"
            R"("optimizer_hooks":true,"tier_min_bytes":1048576})");
  EXPECT_EQ(config_to_json(Config{}),
            R"({"enabled":false,"mode":"global","state_budget":{"kind":"bytes","bytes":0},)"
            R"("pinned_budget":{"kind":"unset"},"log":"warn","device_backend":"auto",)"
            R"("optimizer_hooks":true,"tier_min_bytes":1048576})");
  EXPECT_NE(config_to_json(claim_config("tidepool.tier_min_bytes:64KiB").config)
                .find(R"("tier_min_bytes":65536})"),
            std::string::npos);
}

TEST(ConfigCApi, ClaimStatusesAndBuffers) {
  char remaining[128], json[512], error[256];
  EXPECT_EQ(tidepool_config_claim("a:1,backend:tidepool,b:2", remaining, sizeof remaining, json,
                                  sizeof json, error, sizeof error),
            1);
  EXPECT_STREQ(remaining, "a:1,b:2");
  EXPECT_STREQ(error, "");
  EXPECT_EQ(std::string(json).rfind(R"({"enabled":true,)", 0), 0u);

  EXPECT_EQ(tidepool_config_claim("a:1", remaining, sizeof remaining, json, sizeof json, error,
                                  sizeof error),
            0);
  EXPECT_STREQ(remaining, "a:1");

  EXPECT_EQ(tidepool_config_claim("tidepool.nope:1", remaining, sizeof remaining, json,
                                  sizeof json, error, sizeof error),
            -1);
  EXPECT_NE(std::string(error).find("unknown key 'tidepool.nope'"), std::string::npos);

  char small[4];
  EXPECT_EQ(tidepool_config_claim("abcdef:1,backend:tidepool", small, sizeof small, json,
                                  sizeof json, error, sizeof error),
            -2);
  EXPECT_NE(std::string(error).find("too small"), std::string::npos);

  // A too-small error buffer still receives the start of the message, NUL-terminated.
  char tiny_error[8];
  EXPECT_EQ(tidepool_config_claim("tidepool.nope:1", remaining, sizeof remaining, json,
                                  sizeof json, tiny_error, sizeof tiny_error),
            -1);
  EXPECT_EQ(std::string(tiny_error).size(), 7u);
  EXPECT_EQ(tidepool_config_claim(nullptr, remaining, sizeof remaining, json, sizeof json, error,
                                  sizeof error),
            -1);
}

// Saves and restores the three variables so tests do not leak into each other when the
// executable runs them all in one process.
class ConfigEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      const char* v = std::getenv(kNames[i]);
      saved_[i] = v ? std::optional<std::string>(v) : std::nullopt;
      ::unsetenv(kNames[i]);
    }
  }
  void TearDown() override {
    for (int i = 0; i < 3; ++i) {
      if (saved_[i]) {
        ::setenv(kNames[i], saved_[i]->c_str(), 1);
      } else {
        ::unsetenv(kNames[i]);
      }
    }
  }
  static std::optional<std::string> env(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  }
  static constexpr const char* kNames[3] = {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                            "TIDEPOOL_ALLOC_CONF"};
  std::optional<std::string> saved_[3];
};

TEST_F(ConfigEnv, InstallRewritesTheVariableAndAppliesTheConfig) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF",
           "backend:tidepool,tidepool.log:debug,expandable_segments:True", 1);
  const Config c = install_from_env();
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.log, LogLevel::debug);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True");
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), "backend:tidepool,tidepool.log:debug");
  EXPECT_EQ(active_config(), c);
}

// The shim's rules, checked by the Python package before the shim sets up (which would end
// the process on an error): the same result as install_from_env, with nothing changed.
TEST_F(ConfigEnv, APlanChangesNothingAndSaysWhatInstallWouldDo) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "tidepool.log:info,backend:cudaMallocAsync", 1);
  const Config before = active_config();
  const EnvPlan plan = plan_from_env(Installer::preload_shim);
  EXPECT_TRUE(plan.config.enabled);
  EXPECT_EQ(plan.config.log, LogLevel::info);
  EXPECT_STREQ(plan.variable, "PYTORCH_CUDA_ALLOC_CONF");
  EXPECT_EQ(plan.remaining, "backend:cudaMallocAsync");
  EXPECT_EQ(plan.claimed, "tidepool.log:info");
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "tidepool.log:info,backend:cudaMallocAsync");
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), std::nullopt);
  EXPECT_EQ(active_config(), before);
  // The hook's rules refuse what the shim's accept (Note [one backend]).
  EXPECT_THROW(plan_from_env(Installer::pytorch), ConfigError);
  char json[4096];
  char error[512];
  EXPECT_EQ(tidepool_config_plan_for_preload(json, sizeof json, error, sizeof error), 1) << error;
  EXPECT_NE(std::string(json).find("\"log\":\"info\""), std::string::npos) << json;
  EXPECT_EQ(tidepool_config_plan_for_preload(json, 8, error, sizeof error), -2);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "tidepool.log:loud", 1);
  EXPECT_EQ(tidepool_config_plan_for_preload(json, sizeof json, error, sizeof error), -1);
  EXPECT_NE(std::string(error).find("tidepool.log"), std::string::npos) << error;
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  EXPECT_EQ(tidepool_config_plan_for_preload(json, sizeof json, error, sizeof error), 0) << error;
}

TEST_F(ConfigEnv, ChildrenInheritTheClaimedKeys) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "tidepool.mode:pool, tidepool.state_budget:1GiB,a:1", 1);
  const Config parent = install_from_env();
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), "tidepool.mode:pool,tidepool.state_budget:1GiB");
  // What a child process sees: PyTorch's variable without tidepool keys, and ours.
  EXPECT_EQ(install_from_env(), parent);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "a:1");
}

TEST_F(ConfigEnv, PyTorchVariablesWinOverAnInheritedConfiguration) {
  ::setenv("TIDEPOOL_ALLOC_CONF", "tidepool.log:off", 1);
  ::setenv("PYTORCH_ALLOC_CONF", "tidepool.log:info", 1);
  EXPECT_EQ(install_from_env().log, LogLevel::info);
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), "tidepool.log:info");
}

TEST_F(ConfigEnv, TidepoolAllocConfTakesTidepoolKeysOnly) {
  ::setenv("TIDEPOOL_ALLOC_CONF", "tidepool.log:off,expandable_segments:True", 1);
  EXPECT_EQ(error_of([] { install_from_env(); }),
            "TIDEPOOL_ALLOC_CONF holds tidepool keys only; 'expandable_segments:True' belongs in "
            "PYTORCH_ALLOC_CONF");
  ::setenv("TIDEPOOL_ALLOC_CONF", "tidepool.mode:bad", 1);
  EXPECT_EQ(error_of([] { install_from_env(); })
                .rfind("TIDEPOOL_ALLOC_CONF: tidepool.mode: 'bad'", 0),
            0u);
}

TEST_F(ConfigEnv, InstallUnsetsAVariableLeftEmpty) {
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool,tidepool.mode:pool", 1);
  const Config c = install_from_env();
  EXPECT_EQ(c.mode, Mode::pool);
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), std::nullopt);
}

// Note [the variable PyTorch reads]: PyTorch reads PYTORCH_CUDA_ALLOC_CONF whenever it is
// set, and PYTORCH_ALLOC_CONF only when it is not. Review finding: emptied and unset, the
// older name let PyTorch take up the current one's keys, which it had been ignoring.
TEST_F(ConfigEnv, TheOlderVariableEmptiedStaysSetWhilePyTorchWouldReadTheOther) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:tidepool", 1);
  ::setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6", 1);
  EXPECT_TRUE(install_from_env().enabled);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "");
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "garbage_collection_threshold:0.6");
  // Without the other one set, emptied is unset, as before.
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:tidepool", 1);
  ::unsetenv("PYTORCH_ALLOC_CONF");
  EXPECT_TRUE(install_from_env().enabled);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), std::nullopt);
}

// What PyTorch ignores conflicts with nothing: a backend or expandable segments in
// PYTORCH_ALLOC_CONF while PYTORCH_CUDA_ALLOC_CONF is set (review finding: refused).
TEST_F(ConfigEnv, KeysInTheVariablePyTorchIgnoresConflictWithNothing) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:tidepool,tidepool.mode:pool", 1);
  ::setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync,expandable_segments:True", 1);
  EXPECT_EQ(install_from_env().mode, Mode::pool);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "");
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "backend:cudaMallocAsync,expandable_segments:True");
  // The one it reads does conflict: tidepool's keys in the ignored one, a backend in it.
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool,tidepool.mode:pool", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", 1);
  EXPECT_NE(error_of([] { install_from_env(); }).find("conflicts with 'expandable_segments:True'"
                                                      " in PYTORCH_CUDA_ALLOC_CONF"),
            std::string::npos);
}

TEST_F(ConfigEnv, InstallDoesNothingWhenTidepoolIsNotNamed) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", 1);
  EXPECT_FALSE(install_from_env().enabled);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True");
  EXPECT_FALSE(install_from_env().enabled);  // neither variable set at all
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  EXPECT_FALSE(install_from_env().enabled);
}

TEST_F(ConfigEnv, BadConfigurationChangesNothing) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:tidepool,tidepool.mode:nope", 1);
  const std::string msg = error_of([] { install_from_env(); });
  EXPECT_EQ(msg.rfind("PYTORCH_CUDA_ALLOC_CONF: tidepool.mode: 'nope'", 0), 0u) << msg;
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "backend:tidepool,tidepool.mode:nope");
}

TEST_F(ConfigEnv, TidepoolKeysInBothVariablesAreAnError) {
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "tidepool.log:info", 1);
  EXPECT_EQ(error_of([] { install_from_env(); }),
            "tidepool keys are set in both PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF; put "
            "them in one of the two");
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "backend:tidepool");
  char error[256];
  EXPECT_EQ(tidepool_install_from_env(error, sizeof error), -1);
  EXPECT_NE(std::string(error).find("in both"), std::string::npos);
}

TEST_F(ConfigEnv, AnotherBackendInTheOtherVariableIsAConflictAndNothingChanges) {
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool,expandable_segments:True", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
  EXPECT_EQ(error_of([] { install_from_env(); }),
            "PYTORCH_ALLOC_CONF turns tidepool on, which conflicts with 'backend:cudaMallocAsync' "
            "in PYTORCH_CUDA_ALLOC_CONF; name one backend");
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "backend:tidepool,expandable_segments:True");
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), std::nullopt);
  // Pool mode on PyTorch's native allocator is pool mode, in the other variable or in the
  // same string (one rule for both).
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool,tidepool.mode:pool", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native", 1);
  EXPECT_EQ(install_from_env().mode, Mode::pool);
  const ClaimResult one = claim_config("backend:tidepool,tidepool.mode:pool,backend:native");
  EXPECT_EQ(one.config.mode, Mode::pool);
  EXPECT_EQ(one.remaining, "backend:native");
}

// Note [expandable segments]: pool mode would fail at its first optimizer step (PyTorch's
// MemPool refuses expandable segments), and the shim would serve nothing (PyTorch maps
// them with cuMemCreate); global mode replaces PyTorch's allocator, which ignores the key.
TEST_F(ConfigEnv, ExpandableSegmentsConflictWithPoolModeAndTheShim) {
  const std::string pool_why =
      "pool mode puts optimizer state in a torch.cuda.MemPool, and PyTorch does not support "
      "MemPools with expandable segments; drop expandable_segments:True or use "
      "tidepool.mode:global";
  EXPECT_EQ(error_of([] {
              claim_config("backend:tidepool,tidepool.mode:pool,expandable_segments:True", "X");
            }),
            "X: tidepool conflicts with 'expandable_segments:True': " + pool_why);
  EXPECT_NE(error_of([] { claim_config(" expandable_segments : true ,tidepool.mode:pool"); })
                .find("expandable"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              claim_config("tidepool.log:off,expandable_segments:True", "X",
                           Installer::preload_shim);
            }),
            "X: tidepool conflicts with 'expandable_segments:True': PyTorch then maps its memory "
            "with the driver's cuMemCreate, which the LD_PRELOAD shim does not see, so tidepool "
            "would serve none of it; drop expandable_segments:True");
  // No conflict: global mode, expandable segments off, or tidepool not named at all.
  EXPECT_EQ(claim_config("backend:tidepool,expandable_segments:True").remaining,
            "expandable_segments:True");
  EXPECT_EQ(claim_config("tidepool.mode:pool,expandable_segments:False").config.mode, Mode::pool);
  EXPECT_FALSE(claim_config("expandable_segments:True", "X", Installer::preload_shim)
                   .config.enabled);

  // Across the two variables (the key in the one PyTorch reads: Note [the variable
  // PyTorch reads]), and nothing changes when refused.
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", 1);
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool,tidepool.mode:pool", 1);
  EXPECT_EQ(error_of([] { install_from_env(); }),
            "PYTORCH_ALLOC_CONF turns tidepool on, which conflicts with "
            "'expandable_segments:True' in PYTORCH_CUDA_ALLOC_CONF: " + pool_why);
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "backend:tidepool,tidepool.mode:pool");
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), std::nullopt);
  // An inherited configuration is held to the same rule.
  ::unsetenv("PYTORCH_ALLOC_CONF");
  ::setenv("TIDEPOOL_ALLOC_CONF", "tidepool.mode:pool", 1);
  EXPECT_NE(error_of([] { install_from_env(); }).find("'expandable_segments:True' in "
                                                     "PYTORCH_CUDA_ALLOC_CONF"),
            std::string::npos);
  ::setenv("TIDEPOOL_ALLOC_CONF", "tidepool.mode:global", 1);
  EXPECT_EQ(install_from_env().mode, Mode::global);
}

TEST_F(ConfigEnv, UnderTheShimAnotherBackendIsNoConflict) {
  // The LD_PRELOAD shim serves the calls PyTorch's allocator makes, whichever it is.
  EXPECT_EQ(claim_config("tidepool.mode:pool,backend:cudaMallocAsync", "X",
                         Installer::preload_shim).remaining,
            "backend:cudaMallocAsync");
  EXPECT_EQ(error_of([] {
              claim_config("backend:tidepool,backend:native", "X", Installer::preload_shim);
            }),
            "X: backend:tidepool conflicts with 'backend:native'; name one backend");
  ::setenv("PYTORCH_ALLOC_CONF", "tidepool.log:off", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
  EXPECT_TRUE(install_from_env(Installer::preload_shim).enabled);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "backend:cudaMallocAsync");
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), std::nullopt);
  EXPECT_EQ(env("TIDEPOOL_ALLOC_CONF"), "tidepool.log:off");
  // backend:tidepool against another backend is a conflict across the two variables too, as
  // in one string (it was accepted), the backend in the one PyTorch reads.
  ::unsetenv("TIDEPOOL_ALLOC_CONF");
  ::setenv("PYTORCH_ALLOC_CONF", "backend:tidepool", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
  EXPECT_EQ(error_of([] { install_from_env(Installer::preload_shim); }),
            "PYTORCH_ALLOC_CONF turns tidepool on, which conflicts with "
            "'backend:cudaMallocAsync' in PYTORCH_CUDA_ALLOC_CONF; name one backend");
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "backend:tidepool");
}

TEST_F(ConfigEnv, AnInheritedConfigurationConflictsWithAnotherBackendNamedByTheChild) {
  // A parent ran with tidepool; this child asks PyTorch for cudaMallocAsync.
  ::setenv("TIDEPOOL_ALLOC_CONF", "backend:tidepool,tidepool.log:off", 1);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
  EXPECT_EQ(error_of([] { install_from_env(); }),
            "TIDEPOOL_ALLOC_CONF (inherited from a parent process, or set by hand; unset it to "
            "run without tidepool) turns tidepool on, which conflicts with "
            "'backend:cudaMallocAsync' in PYTORCH_CUDA_ALLOC_CONF; name one backend");
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), "backend:cudaMallocAsync");
}

TEST_F(ConfigEnv, ActiveJsonThroughTheCAbi) {
  char error[256];
  ASSERT_EQ(
      tidepool_config_apply("backend:tidepool,tidepool.state_budget:3MiB", error, sizeof error), 0)
      << error;
  const std::size_t n = tidepool_config_active_json(nullptr, 0);
  std::string json(n + 1, '\0');
  EXPECT_EQ(tidepool_config_active_json(json.data(), json.size()), n);
  json.resize(n);
  EXPECT_EQ(json, config_to_json(active_config()));
  EXPECT_NE(json.find(R"("bytes":3145728)"), std::string::npos);
  EXPECT_EQ(tidepool_config_apply("tidepool.mode:x", error, sizeof error), -1);
  EXPECT_EQ(active_config().state_budget.bytes, 3145728u);  // unchanged by the failed apply
}

// A configuration that names the backend is applied without resolving the one the
// environment would choose: that read TIDEPOOL_BACKEND, which the configuration
// overrides, and left its error (and asked CUDA for its devices, for a host one).
TEST(ConfigApply, ANamedBackendIsAppliedWithoutReadingTheOneItOverrides) {
  ::setenv("TIDEPOOL_BACKEND", "bogus", 1);
  ::testing::internal::CaptureStderr();
  apply_config(claim_config("tidepool.device_backend:host").config);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ::unsetenv("TIDEPOOL_BACKEND");
  EXPECT_EQ(std::string(tidepool_last_error()).find("bogus"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(said.find("bogus"), std::string::npos) << said;
  EXPECT_STREQ(tidepool_backend_name(0), "host");
}

// Runs in its own process under ctest (one test per invocation); run directly, it must
// come after the other tests' applies, which select no backend and allocate nothing.
TEST(ConfigApply, DeviceBackendIsSelectedBeforeTheFirstAllocationOnly) {
  apply_config(claim_config("tidepool.device_backend:host").config);
  EXPECT_STREQ(tidepool_backend_name(0), "host");
  void* p = tidepool_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  const Config before = active_config();
  const std::string msg =
      error_of([] {
        apply_config(claim_config("tidepool.device_backend:cuda,tidepool.log:debug").config);
      });
  EXPECT_EQ(msg.rfind("tidepool.device_backend:cuda cannot be applied: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("before the first allocation"), std::string::npos) << msg;
  EXPECT_EQ(active_config(), before);  // nothing half-applied
  EXPECT_STREQ(tidepool_backend_name(0), "host");
  tidepool_free(p, 4096, 0, nullptr);
}

// ---- the budgets in bytes, for tiering (allocator/tier_routing.h) ----------------------

TEST(TierRouting, BudgetsResolveToBytesAgainstDeviceAndHostMemory) {
  HostBackendOptions o;
  o.capacity_bytes = std::size_t{1} << 30;
  auto backend = make_host_backend(0, o);
  const Config absolute =
      claim_config("tidepool.state_budget:1.5GiB,tidepool.pinned_budget:512MiB").config;
  EXPECT_EQ(configured_state_budget_bytes(absolute, *backend), std::size_t{3} << 29);
  EXPECT_EQ(configured_pinned_budget_bytes(absolute), std::size_t{512} << 20);

  const Config percent =
      claim_config("tidepool.state_budget:50%,tidepool.pinned_budget:25%").config;
  EXPECT_EQ(configured_state_budget_bytes(percent, *backend), backend->mem_info().total_bytes / 2);
  EXPECT_EQ(configured_pinned_budget_bytes(percent), host_memory_bytes() / 4);
  EXPECT_GT(host_memory_bytes(), std::size_t{64} << 20);
}

TEST(TierRouting, NothingConfiguredMeansNoBudget) {
  HostBackendOptions o;
  auto backend = make_host_backend(0, o);
  // tidepool not enabled: the configuration sets nothing, whatever its fields say.
  EXPECT_EQ(configured_state_budget_bytes(Config{}, *backend), std::nullopt);
  EXPECT_EQ(configured_pinned_budget_bytes(Config{}), std::nullopt);
  // Enabled with defaults: state budget 0 (keep nothing), pinned budget unset.
  const Config defaults = claim_config("backend:tidepool").config;
  EXPECT_EQ(configured_state_budget_bytes(defaults, *backend), std::size_t{0});
  EXPECT_EQ(configured_pinned_budget_bytes(defaults), std::nullopt);
  EXPECT_EQ(configured_pinned_budget_bytes(claim_config("tidepool.pinned_budget:unlimited").config),
            host_memory_bytes());
}

}  // namespace
}  // namespace tidepool
