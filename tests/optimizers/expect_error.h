// Test helper shared by the optimizer batteries: expect a c10::Error whose message names
// the problem (the contract is "a clear error naming what is wrong").
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include <c10/util/Exception.h>

namespace tidepool::testing {

inline void expect_error_mentions(const std::function<void()>& f, const std::string& word) {
  try {
    f();
    FAIL() << "expected an error mentioning '" << word << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
}

}  // namespace tidepool::testing
