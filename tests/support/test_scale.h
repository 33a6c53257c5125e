// TIDEPOOL_TEST_SCALE: one multiplier for the iteration counts and sizes of the stress
// tests in every layer, so a soak run (e.g. 10) or a slow sanitizer run (e.g. 0.25) is one
// variable. Unset, empty, non-numeric or non-positive means 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace tidepool::test_support {

inline double test_scale() {
  const char* value = std::getenv("TIDEPOOL_TEST_SCALE");
  if (value == nullptr || *value == '\0') return 1.0;
  const double scale = std::atof(value);
  return scale > 0 ? scale : 1.0;
}

// Whether this build runs under ASan or TSan, which slow every backend call by an order
// of magnitude: the longest random sequences are sized down for them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif

// `n` times the scale, at least 1.
inline std::int64_t scaled(std::int64_t n) {
  return std::max<std::int64_t>(
      1, static_cast<std::int64_t>(static_cast<double>(n) * test_scale()));
}

}  // namespace tidepool::test_support
