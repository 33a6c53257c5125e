// What tidepool does in a process forked after it was in use: frees do nothing, every
// other call that would reach an allocator fails with a message that says why and what
// to do instead (Note [Forked child]).
//
// Note [Forked child]
// A fork copies the address space but only the forking thread. In the child, the locks
// other threads held at that moment stay locked for good, the host backend's stream
// threads are gone (a wait for their work never ends), and CUDA must not be called at
// all (NVIDIA: a child forked after CUDA was initialised cannot use it). Yet a child of
// a training process is common: PyTorch's DataLoader forks its workers (Linux's default
// start method) from a process whose allocator is tidepool, and a worker that drops a
// CUDA tensor it inherited (its objects collected at exit) calls the allocator's free.
// Reaching the allocator there could hang the worker on a lock the parent's other thread
// held at the fork, or touch CUDA. So once a device allocator exists in a process, a fork
// marks the child (pthread_atfork, registered when libtidepool is loaded; the mark is
// inherited by the child's own children):
//   - frees (tidepool_free, tidepool_pytorch_free, tidepool_vmm_free) return at once and
//     succeed: the memory is the parent's, which still owns it; the child's copy of the
//     address space ends with the child;
//   - every other entry point of the C ABIs, and device_allocator(), fails before it
//     takes any lock, with a message naming the cause and the fix (start such processes
//     with 'spawn' or 'forkserver'), as PyTorch refuses CUDA in a forked child;
//   - what needs neither works as before: the last error, and the tags (push, pop, the
//     current tag, names: Note [Tags across fork] in tags.cpp).
// A process that forks before tidepool made an allocator is not marked: its child starts
// afresh and may use tidepool itself. "Made" counts from the moment a thread asks for
// the first allocator, before it takes the device registry's lock to create it: a child
// forked while another thread creates it (the backend's start-up may take seconds) is
// marked, and so never waits for that lock, which no thread of it would release. So is a
// child forked while any other holder had that lock (a device check, the backend choice,
// peer access: the child's handler finds it locked), what it guards being possibly
// half-changed there.
#pragma once

#include <string>

#include "allocator/errors.h"
#include "allocator/export.h"

namespace tidepool {

// Thrown by the calls a forked child may not make (Note [Forked child]).
class TIDEPOOL_API ForkedChildError : public AllocatorUsageError {
 public:
  using AllocatorUsageError::AllocatorUsageError;
};

// Whether this process was forked after tidepool made an allocator (in it or in an
// ancestor it was forked from).
TIDEPOOL_API bool in_forked_child() noexcept;
// Throws ForkedChildError when in_forked_child().
TIDEPOOL_API void refuse_in_forked_child();

namespace detail {
// A device allocator is being made (or exists): from now on a fork marks its child.
// Idempotent.
void note_allocator_in_use() noexcept;
// `busy()`, asked in a forked child, says whether the device registry's lock was held at
// the fork (by a thread the child does not have); the child is then marked too.
void watch_registry_at_fork(bool (*busy)()) noexcept;
}  // namespace detail

}  // namespace tidepool
