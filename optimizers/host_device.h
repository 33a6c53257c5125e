// TIDEPOOL_HOST_DEVICE marks a function that CUDA kernels and host code both call: the
// arithmetic headers kept apart from their kernels so that the CPU tests can run it
// (linalg/gram_plan.h, apollo_step_math.h). nvcc compiles it for both; g++ sees a plain
// inline function.
#pragma once

#if defined(__CUDACC__)
#define TIDEPOOL_HOST_DEVICE __host__ __device__
#else
#define TIDEPOOL_HOST_DEVICE
#endif
