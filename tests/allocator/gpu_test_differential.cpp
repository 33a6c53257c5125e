// test_differential.cpp's parametrised suites (the differential run against the reference model) on
// the cuda backend (ctest label gpu): its cuda instances ran on no machine before, as the CPU
// suites are not built on the GPU machine. Skips itself where no GPU exists; the file's host-only
// suites run too.
#define TIDEPOOL_ALLOCATOR_TEST_BACKENDS ::testing::Values(std::string("cuda"))
#include "tests/allocator/test_differential.cpp"
