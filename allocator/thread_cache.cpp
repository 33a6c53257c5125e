// Per-thread caches of the caching allocator: finding the calling thread's cache,
// draining caches back into the shared pools, folding their statistics, and cleaning up
// at thread exit and allocator destruction. The fast paths themselves are in
// caching_allocator.cpp (allocate) and frees.cpp (deallocate), the lists in thread_cache.h.
//
// Note [Thread caches]
// With one mutex per device, 8 threads doing cached alloc+free pairs spent 559 ns per
// pair on the H200, almost all of it waiting for that mutex. So each thread keeps, per
// allocator, a small cache of small blocks (<= 1 MiB) it freed, per stream and exact size
// class, at most options.thread_cache_bytes in all and ThreadCache::kPerClass per class.
//  - Which blocks: a small block allocated by this thread through the shared path is
//    "held" by the thread's cache (Block::holder): the cache can then check its free
//    (double free, wrong size) without the shared block table. A held block freed by its
//    thread on the stream it was allocated on, with no record_stream streams, parks in
//    the cache; anything else (another stream, recorded streams, another thread's free, a
//    full cache) takes the shared path, which first ends the hold. So a parked block was
//    freed on its own stream, and it is handed out again only to an allocation on that
//    stream: Note [Stream contract] holds unchanged.
//  - The shared state sees a held block as allocated, always: none of the shared
//    algorithms (merge, move, release) touches it. The holder's mutex guards the fields
//    the fast path writes (Block::holder); the allocator takes that mutex while holding
//    its own whenever it reads them (frees, record_stream, snapshots).
//  - Back to the pools: drain_thread_caches() moves every parked block of every thread
//    into the pools, under the allocator's mutex and each cache's in turn. It runs on
//    empty_cache, flush_thread_caches, before the allocator grows (parked blocks never
//    cause growth, as with quick lists), in the OOM policy before cached memory is
//    released, and for one cache at its thread's exit.
//  - Statistics: the fast path counts into the cache's deltas (thread_cache.h), folded
//    into the shared stats under both mutexes: before a shared-path allocation of the
//    same thread, before a shared free of a held block, on drains, and whenever stats
//    are read (stats, snapshot_json, reset_peak_stats, the OOM message). So
//    every current value and count is exact whenever it is read. A peak is exact while
//    one thread at a time uses the caches; with several threads concurrently, the fold
//    adds each thread's own highest excursion to the shared value at fold time, which
//    can be off by the bytes other threads' caches hold (at most thread_cache_bytes each).
//  - The miss path: single-threaded, a cached pair saves little over the shared path
//    with its quick lists, so what a miss adds must stay small. Three checks let the
//    owning thread skip the cache's lock (ThreadCache's owner-only section): an
//    allocation of a class the cache holds no block of (a per-class hint, `maybe_cached`)
//    does not look into the lists; a free by a thread whose cache holds no block does
//    not look into `held`; a shared-path allocation with nothing to fold or hold does not
//    fold. They are safe without the lock because only the owner adds blocks, deltas and
//    held entries; other threads only take them away. And a cache that keeps missing
//    (fewer than one hit per 4 misses over 256 misses) is bypassed for the next 4096
//    misses: it neither holds nor parks, so that thread's frees take the shared path (and
//    its quick lists) as with caches off; then it probes again.
//  - Lifetime: a cache is shared (shared_ptr) by its thread's thread_local list and the
//    allocator's registry. A global lifecycle mutex orders thread exit against allocator
//    destruction: whichever comes first unhooks the cache under it.
//  - Cost (tidepool_bench_alloc, host backend, 2-core CI machine, caches off in the same
//    run): a cached pair 25 ns instead of 38; with 2-8 threads 12 ns of real time per
//    pair instead of 100-136. 64 live blocks of mixed sizes (Mixed64Live) first cost 68
//    ns instead of 59: the cache hits ~83% of allocations there, but single-threaded a
//    hit saves little over the quick lists, and each miss took the cache's lock twice
//    more, folded and probed a 32 KiB held table (L1 misses). With the miss path above,
//    the small-first held table and the cheap lookup (initial-exec TLS, hidden Impl),
//    callgrind counts 650 instructions and 3.75 L1 misses per Mixed64Live pair with
//    caches on against 676 and 3.36 off (was 645 and 4.48 against 690 and 3.53). On a
//    quiet host, caches on against off in the same run with interleaved repetitions
//    (bench/RESULTS.md, 2026-11-30): pair 23.4 ns against 30.2; 8 threads 11.8 ns against
//    89.7; Mixed64Live 59.4 ns against 62.4 (0.95x; 1.04-1.08x in two runs without
//    interleaving, within the noise).
#include "allocator/thread_cache.h"

#include <atomic>
#include <new>
#include <vector>

#include "allocator/caching_allocator_impl.h"
#include "allocator/fork_guard.h"

namespace tidepool {

using detail::Block;
using detail::BlockState;
using detail::ThreadCache;

namespace {

// Outermost lock of the cache lifecycle (order: lifecycle -> allocator -> cache). Never
// destroyed: thread_local destructors may run during static destruction.
std::mutex& lifecycle_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

std::atomic<std::uint64_t> g_next_allocator_id{1};

// The last lookup of this thread: allocator id -> its cache (null: none). Constant-
// initialised and trivially destructible, so reading it costs one TLS address lookup; the
// list below, with its destructor, goes through a TLS wrapper on every access, which
// made up a third of a cached pair (perf). Ids are never reused, so a stale entry never
// matches a live allocator.
// Initial-exec TLS: a fixed offset from the thread pointer, where the default model for a
// shared library calls __tls_get_addr on every lookup (callgrind, Mixed64Live: 40 of
// ~650 instructions per pair). See Note [Static TLS].
//
// Note [Static TLS]
// One initial-exec variable marks libtidepool.so STATIC_TLS: the loader must then place
// the library's *whole* TLS block (every thread_local in it, of any model) in the static
// TLS that glibc keeps spare for libraries loaded with dlopen (Python's import of
// tidepool), and dlopen fails ("cannot allocate memory in static TLS block") when too
// little is left. Measured on the CI machine (glibc 2.36, x86-64): a single initial-exec
// block of 1700 bytes loads into a fresh python3, 1400 after `import torch` (2.11, CUDA
// wheel). libtidepool's block was 1193 bytes while the tag stack held 256 entries in
// place; it is now 241 (tags.cpp keeps 16 in place), and tests/lint (check_static_tls.py)
// fails when it grows past 512 bytes, the part of the spare static TLS glibc reserves for
// such libraries (tunable glibc.rtld.optional_static_tls). Since the block is
// static anyway, hot variables may as well be initial-exec (the tag stack is). Measured
// against the default model in the same run: dropping initial-exec everywhere (no
// STATIC_TLS at all) cost 2-16 ns on a 24-37 ns cached pair on the loaded CI machine.
struct LastLookup {
  std::uint64_t id = 0;
  ThreadCache* cache = nullptr;
};
constinit thread_local LastLookup t_last [[gnu::tls_model("initial-exec")]]{};
// Set once this thread's list was destroyed (thread exit): later calls from other
// thread_local destructors take the shared path and create no cache.
constinit thread_local bool t_exited [[gnu::tls_model("initial-exec")]] = false;

// The calling thread's caches, one per allocator it allocated small blocks from.
struct ThreadCacheList {
  std::vector<std::shared_ptr<ThreadCache>> caches;

  ThreadCacheList() = default;
  ThreadCacheList(const ThreadCacheList&) = delete;
  ThreadCacheList& operator=(const ThreadCacheList&) = delete;

  // Thread exit: every cache goes back to its allocator, if that still exists. Not in a
  // forked child (Note [Forked child] in fork_guard.h): its allocators serve nothing, and
  // the locks this takes may have been held by a parent thread at the fork, which no
  // thread in the child releases (exit() runs this for the exiting thread: a forked
  // Python process that ends normally hung here).
  ~ThreadCacheList() {
    t_last = LastLookup{};
    t_exited = true;
    if (in_forked_child()) return;
    for (auto& c : caches) {
      std::lock_guard life(lifecycle_mutex());
      CachingAllocator::Impl* a = nullptr;
      {
        std::lock_guard g(c->mutex);
        a = c->allocator;
      }
      if (a == nullptr) continue;
      std::lock_guard lock(a->mutex);
      try {
        a->release_thread_cache(*c);
      } catch (...) {
        // A backend error while returning blocks: nothing a dying thread can report to.
      }
    }
  }
};

thread_local ThreadCacheList t_caches;

}  // namespace

std::uint64_t CachingAllocator::Impl::next_id() {
  return g_next_allocator_id.fetch_add(1, std::memory_order_relaxed);
}

ThreadCache* CachingAllocator::Impl::find_thread_cache() const {
  if (options.thread_cache_bytes == 0) return nullptr;
  LastLookup& last = t_last;  // one TLS address lookup, not one per access
  if (last.id == id) return last.cache;
  if (t_exited) return nullptr;
  ThreadCache* found = nullptr;
  for (auto& c : t_caches.caches)
    if (c->allocator_id == id) found = c.get();
  last = LastLookup{id, found};  // a miss is remembered too
  return found;
}

ThreadCache* CachingAllocator::Impl::thread_cache() {
  if (ThreadCache* c = find_thread_cache()) return c;
  if (t_exited) return nullptr;
  ThreadCacheList& list = t_caches;
  // Drop caches of allocators destroyed since (their ids never come back).
  std::erase_if(list.caches, [](const std::shared_ptr<ThreadCache>& c) {
    std::lock_guard g(c->mutex);
    return c->allocator == nullptr;
  });
  // Room first, so that a std::bad_alloc leaves the cache registered in neither list.
  thread_caches.reserve(thread_caches.size() + 1);
  list.caches.reserve(list.caches.size() + 1);
  auto cache = std::make_shared<ThreadCache>(id, this);
  thread_caches.push_back(cache);
  list.caches.push_back(cache);
  t_last = LastLookup{id, cache.get()};
  return cache.get();
}

void CachingAllocator::Impl::release_held(ThreadCache& tc, Block* b) {
  tc.held.erase(b->ptr);
  b->holder = nullptr;
  b->in_thread_cache = false;
}

std::size_t CachingAllocator::Impl::drain_thread_cache(ThreadCache& tc) {
  std::size_t moved = 0;
  tc.drain([&](Block* b) {
    release_held(tc, b);
    insert_free(b, true);
    ++moved;
  });
  return moved;
}

std::size_t CachingAllocator::Impl::drain_thread_caches() {
  std::size_t moved = 0;
  for (auto& c : thread_caches) {
    std::lock_guard g(c->mutex);
    // Fold too: the drained blocks' frees are in the deltas, and another thread may
    // allocate them through the shared path before this cache's thread comes back.
    c->fold_into(stats);
    moved += drain_thread_cache(*c);
  }
  return moved;
}

std::vector<std::unique_lock<detail::SpinLock>> CachingAllocator::Impl::lock_thread_caches()
    const {
  std::vector<std::unique_lock<detail::SpinLock>> locks;
  locks.reserve(thread_caches.size());
  for (auto& c : thread_caches) locks.emplace_back(c->mutex);
  return locks;
}

void CachingAllocator::Impl::fold_locked_thread_caches() {
  for (auto& c : thread_caches) c->fold_into(stats);
}

void* CachingAllocator::Impl::finish_shared_allocation(Block* b, std::size_t bytes, int tag,
                                                       ThreadCache* tc) {
  const bool holdable = options.thread_cache_bytes != 0 && b->segment->small;
  if (tc == nullptr && holdable) {
    try {
      tc = thread_cache();
    } catch (const std::bad_alloc&) {
      // No room for this thread's cache: b is already out of the pool, and the cache is
      // only a fast path, so b is handed out through the shared one.
      tc = nullptr;
    }
  }
  if (tc == nullptr) return finish_allocation(b, bytes, tag);
  const bool hold = holdable && tc->should_hold();
  // Nothing to hold and nothing to fold: the cache's lock is not needed (tc is the calling
  // thread's own cache, so is_dirty may be read without it).
  if (!hold && !tc->is_dirty()) return finish_allocation(b, bytes, tag);
  std::lock_guard g(tc->mutex);
  tc->fold_into(stats);
  void* p = finish_allocation(b, bytes, tag);
  if (hold && tc->held.insert(b)) b->holder = tc;
  return p;
}

void CachingAllocator::Impl::release_thread_cache(ThreadCache& tc) {
  {
    std::lock_guard g(tc.mutex);
    tc.fold_into(stats);
    drain_thread_cache(tc);
    // Live blocks the thread still had: freed later through the shared path.
    tc.held.for_each([](Block* b) { b->holder = nullptr; });
    tc.held.clear();
    tc.allocator = nullptr;
  }
  std::erase_if(thread_caches,
                [&](const std::shared_ptr<ThreadCache>& c) { return c.get() == &tc; });
}

void CachingAllocator::Impl::detach_thread_caches() {
  std::lock_guard life(lifecycle_mutex());
  std::lock_guard lock(mutex);
  for (auto& c : thread_caches) {
    std::lock_guard g(c->mutex);
    // The blocks die with the allocator's segments; only the links to them go.
    c->drain([](Block*) {});
    c->held.clear();
    c->allocator = nullptr;
  }
  thread_caches.clear();
}

std::size_t CachingAllocator::flush_thread_caches() {
  std::lock_guard lock(impl_->mutex);
  return impl_->drain_thread_caches();
}

}  // namespace tidepool
