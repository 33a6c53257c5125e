// The loads-over-write-backs battery of test_loads_over_writebacks.cpp on the cuda
// backend (ctest label gpu). Skips itself where no GPU exists; the gated tests need
// host-backend streams and skip there too.
#define TIDEPOOL_TIERING_BACKENDS_RAW ::tidepool::BackendKind::cuda
#include "tests/tiering/test_loads_over_writebacks.cpp"
