// The pinned budget battery of test_vmm_pinned_budget.cpp on the cuda backend (ctest label
// gpu): host backings of host-NUMA memory, charged to the budget. Skips itself where no
// GPU exists.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::cuda)
#include "tests/tiering/test_vmm_pinned_budget.cpp"
