// Teardown's stderr line when the C++ heap is exhausted: a destructor must still never
// throw or abort (teardown.h), so the line falls back to a fixed text that needs no heap.
// Its own executable: it replaces operator new (tests/support/failing_operator_new.h).
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "tests/support/failing_operator_new.h"
#include "tiering/teardown.h"

namespace tidepool {
namespace {

// Review finding: the fallback was assigned to a std::string, which needs the heap that had
// just run out: a second std::bad_alloc out of a destructor, so std::terminate.
TEST(TeardownWithoutHeap, TheLineIsStillWrittenAndNothingAborts) {
  bool completed = false;
  ::testing::internal::CaptureStderr();
  std::thread([&] {
    completed = test_support::survives_exhaustion(0, [] {
      Teardown teardown("test object");
      // The step's own exception cannot be built either: a std::bad_alloc, recorded.
      teardown.attempt("a step", [] { throw std::logic_error("the step failed"); });
    });
  }).join();
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(completed);
  EXPECT_NE(printed.find("tidepool: test object destroyed with 1 failed release step"),
            std::string::npos)
      << printed;
  EXPECT_NE(printed.find("(out of memory for the errors)"), std::string::npos) << printed;
}

}  // namespace
}  // namespace tidepool
