// Streams of tidepool's host backend for the shim's cudaStreamDestroy tests: the fake
// libcudart (fake_cudart.c) hands them out from cudaStreamCreate when this library is
// loaded, so tidepool, on the host backend, can wait for a "CUDA" stream as it waits for
// a program's stream on a GPU, and a dead handle is an error to it. Loaded by the test
// after the shim set libtidepool up (it resolves to the copy the shim loaded).
#include "allocator/device_registry.h"

extern "C" {

__attribute__((visibility("default"))) void* host_streams_create() {
  return tidepool::device_allocator(0).backend().create_stream().handle;
}

__attribute__((visibility("default"))) void host_streams_destroy(void* stream) {
  tidepool::device_allocator(0).backend().destroy_stream(tidepool::Stream{stream});
}

}  // extern "C"
