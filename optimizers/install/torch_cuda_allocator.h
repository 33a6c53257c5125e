// tidepool as c10's CUDA allocator, with the hooks PyTorch calls during training that its
// plain pluggable allocator leaves out.
//
// torch::cuda::CUDAPluggableAllocator wraps an alloc/free pair; what else c10 asks of a
// CUDA allocator it answers with "does not yet support ..." or nothing. Some of those
// calls come from PyTorch itself, not from the user, so a training script that works with
// PyTorch's allocator would stop, or silently race, with a plain pluggable one:
//   cacheInfo       cuDNN's autotuner (torch.backends.cudnn.benchmark = True) asks for
//                   the largest block it may take as workspace in every convolution it
//                   tunes; the plain class raises there (pytorch#98481).
//                   -> tidepool_cache_info: what c10's own allocator answers.
//   recordStream    Tensor::record_stream, also from PyTorch's C++ internals, is dropped
//                   without a record-stream function: memory a side stream still reads is
//                   handed out again. -> tidepool_pytorch_record_stream.
//   emptyCache      does nothing without a reset function. -> tidepool_empty_cache_all.
//   resetPeakStats  raises. -> tidepool_reset_peak_stats.
//   getDeviceStats / resetAccumulatedStats
//                   raise: torch.cuda.memory_stats(), memory_allocated(),
//                   max_memory_reserved(), memory_summary(), ... stop a training script
//                   that logs them. -> tidepool_get_pytorch_stats_v1 /
//                   tidepool_pytorch_reset_accumulated_stats (Note [PyTorch's view of the
//                   stats] in allocator/c_api.h).
//   recordHistory / isHistoryEnabled / snapshot / attachOutOfMemoryObserver
//                   raise: torch.cuda.memory._record_memory_history, _snapshot and
//                   _dump_snapshot (PyTorch's memory visualizer), memory_snapshot() and
//                   out-of-memory observers stop the program. -> MemoryHistory
//                   (memory_history.h): trace entries and stacks as c10 records them,
//                   tidepool's backed ranges as the snapshot's segments.
//   setMemoryFraction / getMemoryFraction
//                   torch.cuda.set_per_process_memory_fraction is silently ignored without
//                   a memory-fraction function, and its getter raises.
//                   -> tidepool_set_memory_fraction / tidepool_get_memory_fraction: the
//                   cap binds all of tidepool's device memory, optimizer state included.
//   createOrIncrefPool / beginAllocateToPool
//                   memory pools (torch.cuda.MemPool, CUDA graph capture's private pool)
//                   are ignored or refused with a generic message; tidepool has no pools,
//                   and memory a captured graph uses would be reused after capture.
//                   -> a clear error naming tidepool.mode:pool, which supports them.
//   shareIpcHandle / getIpcDevPtr
//                   CUDA IPC (torch.multiprocessing with CUDA tensors) ends in "please file
//                   a PyTorch issue". -> a clear error naming tidepool.mode:pool.
//   raw_delete      throws for a second zero-byte buffer's null. -> null frees nothing.
//   attachAllocatorTraceTracker
//                   throws, failing ProcessGroupNCCL with NCCL buffer registration on.
//                   -> still refused, but saying why (NCCL would keep registrations of
//                   memory tidepool remaps and releases) and what to do: unset
//                   TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK.
//   memcpyAsync     cudaMemcpyAsync across devices, which memory mapped through CUDA VMM
//                   for its own device cannot rely on. -> cudaMemcpyPeerAsync across
//                   devices.
//   enablePeerAccess
//                   cudaDeviceEnablePeerAccess alone leaves tidepool's VMM-mapped ranges
//                   (expandable segments, optimizer state) to their own device: a kernel
//                   on the peer reading them (a cross-device copy with a dtype change or
//                   a non-contiguous source under P2P) faults. -> also
//                   tidepool_enable_peer_access, for the ranges mapped now and later.
//   GetAllocator(kCUDA)
//                   c10's registry by device type (torch.accelerator's memory functions)
//                   keeps c10's own allocator after changeCurrentAllocator. -> set too.
// And malloc and free: out of memory is c10's OutOfMemoryError (Python:
// torch.OutOfMemoryError) with c10's opening "CUDA out of memory. Tried to allocate ...",
// as with PyTorch's own allocator, not the RuntimeError the plain pair can throw; and both report
// to torch.profiler(profile_memory=True), which the plain pair leaves without a single CUDA memory
// event.
//
// Two ways in, both before LibTorch's CUDA allocator is first used:
//   C++     tidepool::optim::install_from_env() (torch_install.h) in global mode;
//   C ABI   tidepool_torch_install_cuda_allocator(), which the Python package calls in
//           global mode through ctypes (libtidepool_torch_cuda.so, built against the
//           torch the package was built with).
#pragma once

#include <memory>

#include "allocator/export.h"

namespace c10::cuda::CUDACachingAllocator {
class CUDAAllocator;
}

namespace tidepool::optim {

// A new allocator object (not installed): for tests that call its hooks directly.
TIDEPOOL_API std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>
make_torch_cuda_allocator();

// Makes a make_torch_cuda_allocator() c10's CUDA allocator, once per process: later calls
// change nothing. Throws c10::Error when LibTorch refuses (its own CUDA allocator has been
// used already). The installed allocator is never destroyed, not even at exit (Note [the
// installed allocator is never destroyed] in torch_cuda_allocator.cpp).
TIDEPOOL_API void install_torch_cuda_allocator();

}  // namespace tidepool::optim

extern "C" {
// install_torch_cuda_allocator() for C callers: 0 when tidepool is c10's CUDA allocator
// (now or from an earlier call), -1 with the reason in tidepool_last_error().
TIDEPOOL_API int tidepool_torch_install_cuda_allocator(void);
// The LibTorch version this library was built against ("2.11.0"): its allocator subclasses
// c10's, whose layout and virtual methods change between releases, so the Python package
// loads it only under that torch (Note [one torch for libtidepool_torch_cuda]).
TIDEPOOL_API const char* tidepool_torch_cuda_built_for(void);
}
