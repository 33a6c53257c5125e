/* A stand-in for libcudart's five functions the LD_PRELOAD shim calls, so that the
 * shim's routing (cudaMalloc -> tidepool, cudaFree of its own pointers -> tidepool,
 * of anything else -> the real cudaFree) is tested on a machine without a GPU. The
 * shim is pointed at it with TIDEPOOL_CUDART; the counters let the test see which
 * calls reached "CUDA". "Device memory" here is plain malloc. */
#include <stdlib.h>

int fake_cudart_malloc_calls = 0;
int fake_cudart_free_calls = 0;
int fake_cudart_synchronize_calls = 0;

int cudaMalloc(void** ptr, size_t size) {
  ++fake_cudart_malloc_calls;
  *ptr = malloc(size);
  return *ptr ? 0 : 2; /* cudaErrorMemoryAllocation */
}

int cudaFree(void* ptr) {
  ++fake_cudart_free_calls;
  free(ptr);
  return 0;
}

int cudaGetDevice(int* device) {
  *device = 0;
  return 0;
}

int cudaSetDevice(int device) { return device == 0 ? 0 : 101; /* cudaErrorInvalidDevice */ }

int cudaDeviceSynchronize(void) {
  ++fake_cudart_synchronize_calls;
  return 0;
}
