// The shared pinned budget battery of test_shared_pinned_budget.cpp on the cuda backend
// (ctest label gpu): slabs and direct mappings registered with cudaHostRegister. Skips
// itself where no GPU exists.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::cuda)
#include "tests/tiering/test_shared_pinned_budget.cpp"
