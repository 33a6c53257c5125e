// The LD_PRELOAD shim across fork(): its locks are taken around every fork, so that a
// child finds the shim's tables whole and unlocked, and a child forked after tidepool
// was in use leaves CUDA's calls to the runtime (Note [Forked child under the shim]).
//
// Note [Forked child under the shim]
// A fork copies one thread. A lock another thread of the parent held at that moment stays
// locked in the child for good, and what it guarded may be half-changed. The shim's
// table of the pointers it handed out (`owned`) is locked on every cudaMalloc and
// cudaFree of the program, so a parent thread allocating at the fork hung the child's
// first cudaFree (a DataLoader worker dropping what it inherited, cleanup in a child
// before exec). The same goes for the shim's set-up: a fork while another thread ran it
// (a once-flag in progress) left the child's first call waiting for a set-up no thread
// would finish. So the shim takes its four locks (the set-up's, held while either
// once-flag's function runs; the table's; the ordering streams'; the legacy-ordered
// frees') before every fork (pthread_atfork, registered when the shim is loaded) and
// lets them go after it, in the parent and in the child: the fork waits until a thread
// inside the shim leaves its section, and the child's tables and set-up are whole. The
// set-up's is taken first, as the set-up's own calls would; the other three are never
// taken while another is held. None is held across anything that could fork or wait for
// the forking thread (the set-up loads libraries and calls libtidepool's start-up; the
// ordering and legacy-frees locks span CUDA runtime calls). They are plain mutexes
// (std::mutex): a recursive one could not be let go by the child's thread, whose id is
// not the parent thread's, so the set-up's nested calls skip the lock instead
// (SetUpScope in libraries.cpp). A fork that waited for the set-up may see libtidepool
// loaded meanwhile, and libtidepool's own fork handler, registered as it loaded, not run
// in the child: the child then counts as forked after tidepool was in use
// (Shim::forked_during_setup), whether or not an allocator was made yet.
// In a child forked after tidepool made an allocator (tidepool_in_forked_child; Note
// [Forked child] in allocator/fork_guard.h) CUDA cannot be used, and tidepool refuses
// every call but frees, which do nothing. There the shim:
//   - answers a free (cudaFree, cudaFreeAsync and its _ptsz form) of a pointer it handed
//     out with cudaSuccess, making no CUDA call (cudaFree's device synchronisation
//     included): the memory is the parent's, which still owns it, as tidepool_free does;
//   - forwards every other call unchanged, so that the runtime answers the child as it
//     answers any process forked after CUDA was initialised (cudaErrorInitializationError)
//     rather than the shim turning tidepool's refusal into cudaErrorInvalidValue: an
//     allocation, a free of a pointer the shim did not hand out (the runtime holds
//     nothing of the child's to free, so no check against tidepool's memory is needed),
//     and cudaStreamDestroy, without releasing the stream in tidepool.
// A child forked before tidepool made an allocator is not marked, and the shim serves it
// as it serves any process.
#include <pthread.h>

#include <mutex>

#include "preload/shim.h"

namespace tidepool_preload {

namespace {

// Whether tidepool served before this thread's fork waited for the set-up (the forking
// thread's; the child's one thread is that thread).
constinit thread_local bool t_served_before_fork = false;

void lock_before_fork() {
  Shim& s = shim();
  t_served_before_fork = s.serving.load(std::memory_order_acquire);
  s.setup_mutex.lock();
  s.mutex.lock();
  s.ordering_mutex.lock();
  legacy_frees_mutex().lock();
}

// In the parent, and (unlock_in_child) in the child, whose one thread is the one that
// locked them.
void unlock_after_fork() {
  Shim& s = shim();
  legacy_frees_mutex().unlock();
  s.ordering_mutex.unlock();
  s.mutex.unlock();
  s.setup_mutex.unlock();
}

void unlock_in_child() {
  Shim& s = shim();
  // libtidepool was loaded while this fork waited for the set-up: its own fork handler,
  // registered then, may not have run in this child.
  if (!t_served_before_fork && s.serving.load(std::memory_order_acquire)) {
    s.forked_during_setup.store(true, std::memory_order_relaxed);
  }
  unlock_after_fork();
}

}  // namespace

void register_fork_handlers() {
  static std::once_flag registered;
  std::call_once(registered,
                 [] { pthread_atfork(&lock_before_fork, &unlock_after_fork, &unlock_in_child); });
}

bool in_forked_child() {
  const Shim& s = shim();
  if (s.forked_during_setup.load(std::memory_order_relaxed)) return true;
  return s.tp.in_forked_child != nullptr && s.tp.in_forked_child() == 1;
}

}  // namespace tidepool_preload
