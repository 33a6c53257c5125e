// The new-state placement battery of test_new_state_placement.cpp on the cuda backend
// (ctest label gpu). Skips itself where no GPU exists.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::cuda)
#include "tests/tiering/test_new_state_placement.cpp"
