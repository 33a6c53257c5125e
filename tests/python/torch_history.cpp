// PyTorch's memory history with the Python stacks it records, for test_history_at_exit.py
// on a machine without a GPU: torch.cuda.memory._record_memory_history initialises CUDA
// first, so the test calls c10's recordHistory through this library instead, with the
// context recorder PyTorch passes for stacks="python" (torch::CapturedTraceback with the
// Python frames), and allocates and frees through c10's current allocator (tidepool's,
// once the test installed it over the host backend).
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <cstddef>
#include <memory>

namespace {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

std::shared_ptr<c10::GatheredContext> python_stack() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
}

Pluggable& current() {
  return dynamic_cast<Pluggable&>(*c10::cuda::CUDACachingAllocator::get());
}

}  // namespace

extern "C" {

// torch.cuda.memory._record_memory_history(enabled="all" or None, stacks="python").
__attribute__((visibility("default"))) void tidepool_test_record_history(int on) {
  c10::cuda::CUDACachingAllocator::recordHistory(
      on != 0, on != 0 ? python_stack : nullptr, 100000,
      on != 0 ? c10::cuda::CUDACachingAllocator::RecordContext::ALL
              : c10::cuda::CUDACachingAllocator::RecordContext::NEVER,
      /*clearHistory=*/false, {});
}

// A CUDA tensor's memory on device 0's default stream, and its deleter.
__attribute__((visibility("default"))) void* tidepool_test_alloc(std::size_t bytes) {
  return current().malloc(bytes, 0, nullptr);
}
__attribute__((visibility("default"))) void tidepool_test_free(void* ptr) {
  current().raw_delete(ptr);
}
}
