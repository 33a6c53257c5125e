// tidepool::optim::install_from_env: every state it can report without a GPU, that a
// machine without CUDA gets a status rather than an exception, that the environment is
// rewritten for LibTorch, and that a bad configuration is a clear error.
#include "optimizers/install/torch_install.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace tidepool::optim {
namespace {

constexpr const char* kVariables[] = {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                      "TIDEPOOL_ALLOC_CONF"};

// Clears the configuration variables for the test and restores them (and the default
// configuration) afterwards.
class TorchInstallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kVariables) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
      unsetenv(name);
    }
  }
  void TearDown() override {
    for (const auto& [name, value] : saved_) {
      if (value) setenv(name.c_str(), value->c_str(), 1); else unsetenv(name.c_str());
    }
    apply_config(Config{});
  }
  static std::optional<std::string> env(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST_F(TorchInstallTest, NothingNamedChangesNothing) {
  setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True", 1);
  const InstallStatus s = install_from_env();
  EXPECT_EQ(s.state, InstallState::not_configured) << install_state_name(s.state);
  EXPECT_FALSE(s.config.enabled);
  EXPECT_EQ(s.message.rfind("inactive", 0), 0u) << s.message;
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "expandable_segments:True");
}

TEST_F(TorchInstallTest, GlobalModeWithoutCudaIsAStatusNotAnError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA is available: this tests its absence";
  setenv("PYTORCH_ALLOC_CONF",
         "backend:tidepool,expandable_segments:True,tidepool.state_budget:1GiB", 1);
  const InstallStatus s = install_from_env();
  EXPECT_EQ(s.state, InstallState::inactive_no_cuda) << install_state_name(s.state);
  EXPECT_NE(s.message.find("inactive: no CUDA"), std::string::npos) << s.message;
  EXPECT_TRUE(s.config.enabled);
  EXPECT_EQ(s.config.mode, Mode::global);
  // The configuration is applied and LibTorch sees only its own keys.
  EXPECT_TRUE(active_config().enabled);
  EXPECT_EQ(active_config().state_budget.bytes, std::uint64_t{1} << 30);
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "expandable_segments:True");
  EXPECT_NE(env("TIDEPOOL_ALLOC_CONF").value_or("").find("backend:tidepool"), std::string::npos);
  // Calling it again is harmless and says the same.
  EXPECT_EQ(install_from_env().state, InstallState::inactive_no_cuda);
}

TEST_F(TorchInstallTest, PoolModeLeavesLibTorchsAllocator) {
  setenv("PYTORCH_CUDA_ALLOC_CONF", "tidepool.mode:pool", 1);
  const InstallStatus s = install_from_env();
  EXPECT_EQ(s.state, InstallState::pool_mode) << install_state_name(s.state);
  EXPECT_EQ(s.config.mode, Mode::pool);
  EXPECT_EQ(env("PYTORCH_CUDA_ALLOC_CONF"), std::nullopt);  // left empty: unset
}

TEST_F(TorchInstallTest, HostBackendIsNotInstalledAsTheCudaAllocator) {
  setenv("TIDEPOOL_ALLOC_CONF", "tidepool.device_backend:host", 1);
  const InstallStatus s = install_from_env();
  EXPECT_EQ(s.state, InstallState::host_backend) << install_state_name(s.state);
  EXPECT_NE(s.message.find("device_backend:host"), std::string::npos) << s.message;
}

TEST_F(TorchInstallTest, BadConfigurationThrowsNamingTheKeyAndChangesNothing) {
  setenv("PYTORCH_ALLOC_CONF", "backend:tidepool,tidepool.state_budget:lots", 1);
  try {
    install_from_env();
    FAIL() << "a bad state budget must throw";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("tidepool.state_budget"), std::string::npos) << e.what();
  }
  EXPECT_EQ(env("PYTORCH_ALLOC_CONF"), "backend:tidepool,tidepool.state_budget:lots");
  EXPECT_FALSE(active_config().enabled);
}

// The names tidepool.status() and the logs show, each its own.
TEST(InstallStateName, EveryStateHasItsName) {
  EXPECT_STREQ(install_state_name(InstallState::not_configured), "not_configured");
  EXPECT_STREQ(install_state_name(InstallState::pool_mode), "pool_mode");
  EXPECT_STREQ(install_state_name(InstallState::host_backend), "host_backend");
  EXPECT_STREQ(install_state_name(InstallState::inactive_no_cuda), "inactive_no_cuda");
  EXPECT_STREQ(install_state_name(InstallState::installed), "installed");
  EXPECT_STREQ(install_state_name(static_cast<InstallState>(99)), "unknown");
}

}  // namespace
}  // namespace tidepool::optim
