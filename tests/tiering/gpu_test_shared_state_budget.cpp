// The shared state budget battery of test_shared_state_budget.cpp on the cuda backend (ctest
// label gpu): the ledger, the stores that share it and a VMM pool backed by CUDA virtual
// memory. Skips itself where no GPU exists.
#define TIDEPOOL_TIERING_GPU_BUILD 1
#define TIDEPOOL_TIERING_BACKENDS ::testing::Values(::tidepool::BackendKind::cuda)
#include "tests/tiering/test_shared_state_budget.cpp"
