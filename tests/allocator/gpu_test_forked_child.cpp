// The forked-child tests of test_forked_child.cpp with the parent on the cuda backend
// (ctest label gpu): a child forked from a process with a CUDA context frees nothing and
// refuses the rest without touching CUDA. Skips itself where no GPU exists.
#define TIDEPOOL_FORK_TEST_BACKEND "cuda"
#include "tests/allocator/test_forked_child.cpp"
