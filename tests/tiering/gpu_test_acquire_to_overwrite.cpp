// The acquire_to_overwrite battery of test_acquire_to_overwrite.cpp on the cuda backend
// (ctest label gpu). Skips itself where no GPU exists.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::cuda)
#include "tests/tiering/test_acquire_to_overwrite.cpp"
