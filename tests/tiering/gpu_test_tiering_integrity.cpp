// The integrity and concurrency battery of test_tiering_integrity.cpp on the cuda backend
// (ctest label gpu). Skips itself where no GPU exists; host-only fault-injection suites are
// left out.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::cuda)
#include "tests/tiering/test_tiering_integrity.cpp"
