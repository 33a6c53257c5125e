// test_cached_by_tag.cpp's suite (cached memory by tag) on the cuda backend (ctest label
// gpu). Skips itself where no GPU exists.
#define TIDEPOOL_ALLOCATOR_TEST_BACKENDS ::testing::Values(std::string("cuda"))
#include "tests/allocator/test_cached_by_tag.cpp"
