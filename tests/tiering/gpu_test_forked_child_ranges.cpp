// The forked-child test of test_forked_child_ranges.cpp with the parent's pointer-stable
// ranges backed by CUDA virtual memory (ctest label gpu). Skips itself where no GPU exists.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_FORK_TEST_BACKEND "cuda"
#include "tests/tiering/test_forked_child_ranges.cpp"
