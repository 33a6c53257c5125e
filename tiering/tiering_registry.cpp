// The per-device tiering registry behind the C ABI. See tiering_registry.h.
#include "tiering/tiering_registry.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>

#include "allocator/config.h"
#include "allocator/device_registry.h"
#include "allocator/reclaim.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tiering/lock_before.h"
#include "tiering/steps_in_flight.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {

namespace {

struct DeviceTiering {
  Backend* backend = nullptr;  // borrowed
  std::unique_ptr<VmmPool> vmm;
  std::set<TieredStore*> stores;
  std::optional<bool> host_backing;  // Note [No host backing], once probed
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
// Never destroyed: stores and pools may outlive static destruction order.
std::map<int, DeviceTiering>& registry() {
  static auto* r = new std::map<int, DeviceTiering>();
  return *r;
}

// Note [Registry re-entry]
// The registry lock is held while its walks (for_each_tiered_store, reclaim_tiered_stores)
// call into stores, and a store calls out: to its memory source, to the backend, to the
// allocator, whose OOM path runs reclaim hooks. Code reached that way can come back to
// the registry on the same thread, where locking registry_mutex() again would deadlock
// (lock) or be undefined (try_lock of a mutex the thread owns). So every path that holds
// the lock marks this thread (t_holding_registry, set and cleared by RegistryHold), and
// a call that finds the mark does not lock again:
//   - reclaim_tiered_stores walks the stores as they are: the thread holds the lock, so
//     no other thread changes the set, and a store this thread is inside refuses itself
//     (Note [Locking] in tiered_store.cpp), so the others still give room;
//   - unregister_tiered_store (a store destroyed from inside a walk) leaves the set under
//     the hold this thread already has, since a destructor cannot be refused; the walks
//     step by key (next_store), never holding an iterator across a call, so they skip it;
//   - the empty-cache hook (tidepool_empty_cache called from inside a walk) finds the
//     device's VMM pool under that hold too: it only reads the registry, and an
//     empty_cache is not refused (Note [empty_cache releases the spares]);
//   - everything else (creating a store, a nested for_each_tiered_store, the VMM pool
//     accessors, set_tiering_backend) throws TieringError: the documented rule is that a
//     walk's callback creates no store, and a nested walk would call stores this thread
//     may be inside (their own locks would deadlock instead).
thread_local bool t_holding_registry = false;

TieringError reentry_error(const char* what) {
  return TieringError(std::string("tiering: ") + what +
                      " on a thread that already holds the tiering registry (from inside "
                      "for_each_tiered_store or an OOM reclaim of tiered stores): refused "
                      "(Note [Registry re-entry])");
}

// Holds registry_mutex() and marks this thread as holding it until destroyed
// (Note [Registry re-entry]). Taken only by a thread that does not hold it: the locking
// form throws reentry_error(what) on one that does; the try_lock form is for the reclaim
// path, which checks first, and owns() says whether the lock was free.
class RegistryHold {
 public:
  explicit RegistryHold(const char* what) : lock_(registry_mutex(), std::defer_lock) {
    if (t_holding_registry) throw reentry_error(what);
    lock_.lock();
    t_holding_registry = true;
  }
  // The reclaim path's form: locks before `deadline` or not at all (lock_before.h).
  explicit RegistryHold(std::chrono::steady_clock::time_point deadline)
      : lock_(registry_mutex(), std::defer_lock) {
    lock_before(deadline);
  }
  ~RegistryHold() {
    if (lock_.owns_lock()) t_holding_registry = false;
  }
  RegistryHold(const RegistryHold&) = delete;
  RegistryHold& operator=(const RegistryHold&) = delete;
  bool owns() const { return lock_.owns_lock(); }
  // Locks before `deadline` if this hold does not own the lock yet (the reclaim path's
  // form, and its wait after a first try). Returns owns().
  bool lock_before(std::chrono::steady_clock::time_point deadline) {
    if (!lock_.owns_lock() && detail::lock_before(lock_, deadline)) t_holding_registry = true;
    return lock_.owns_lock();
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// The device's VMM pool, or nullptr when it has none; the caller holds the registry. A
// pool, once made, lives as long as the registry (the process).
VmmPool* vmm_pool_locked(int device) {
  auto it = registry().find(device);
  return it == registry().end() ? nullptr : it->second.vmm.get();
}

// Note [A busy registry in an OOM]
// The allocator's reclaim hook (reclaim_tiered_stores) runs in another allocation's OOM
// path, possibly inside a store this thread holds, so it must not block on the registry
// or a store for ever: a thread holding them may be waiting for something this one holds.
// It used to try each lock once and give nothing when it was busy, so whether an
// allocation got OutOfMemoryError depended on timing: another thread evicting by tag,
// reading the tiering stats, releasing a stream, or in its own OOM held the registry, and
// the state that could have made room stayed on the device. Now:
//   - the device's VMM pool is found without the registry (pool_index, under a mutex of
//     its own held only to read or add a pointer), and its ranges are pushed to the host
//     whether the registry was free or not: a migration takes only the pool's lock;
//   - the registry and each store are waited for until one deadline, kReclaimPatience
//     after the hook starts: a holder that is only busy (a walk, a wait for copies)
//     finishes within it, and one waiting for this thread costs it that long, not a hang.
// reclaims_that_found_the_registry_busy() counts the reclaims that found it busy, and
// reclaims_that_waited_for_the_registry() those of them that waited, for the tests.
//
// Note [One wait for a busy registry per store operation]
// A store that runs out of device memory while it makes room (allocate_reserved_locked)
// evicts a victim and asks the allocator again, one victim at a time, each ask through the
// full OOM path. With the registry held all along (a thread reading the tiering stats or
// evicting by tag, waiting for this store's lock), every ask waited kReclaimPatience: k
// victims, k × 500 ms, and the other thread waited as long. So within one outermost store
// operation (InsideStore's scope: each attempt of an acquire that asks the stores sharing
// its budget is one) the hook waits for the registry once; after a wait in vain the later
// OOMs of the same operation only try it (the pointer-stable ranges are still pushed),
// except the store's last ask, when it has nothing left to evict, which may wait again: a
// holder that was only busy (not waiting for this thread) may have finished, and the
// other stores' room is what the request needs then. Another operation, or an OOM
// outside any store, waits again.
constexpr std::chrono::milliseconds kReclaimPatience{500};
std::atomic<std::uint64_t> g_registry_busy_in_reclaim{0};
std::atomic<std::uint64_t> g_registry_waits_in_reclaim{0};

std::mutex& pool_index_mutex() {
  static std::mutex m;
  return m;
}
std::map<int, VmmPool*>& pool_index() {
  static auto* index = new std::map<int, VmmPool*>();  // never destroyed, as registry()
  return *index;
}
VmmPool* indexed_pool(int device) {
  std::lock_guard lock(pool_index_mutex());
  auto it = pool_index().find(device);
  return it == pool_index().end() ? nullptr : it->second;
}

// The store after `current` in `stores` (the first one for nullptr), or nullptr. Found by
// key, so a store added or removed by the previous call leaves no dangling iterator.
TieredStore* next_store(const std::set<TieredStore*>& stores, TieredStore* current) {
  auto it = current == nullptr ? stores.begin() : stores.upper_bound(current);
  return it == stores.end() ? nullptr : *it;
}

// Default: the backend of the device's caching allocator, so tiering and the allocator
// share streams, capacity and (on the host backend) the emulated device.
Backend& backend_locked(int device, DeviceTiering& d) {
  if (d.backend == nullptr) d.backend = &device_allocator(device).backend();
  return *d.backend;
}

// The bases of allocate_tierable_range's ranges, per device, with the bytes each was asked
// for (their tags and ages live in the VmmPool, which knows only whole granules). A mutex
// of its own: is_tierable_range is asked on frees, and must not wait behind a store
// operation that holds the registry lock.
using TierableRanges = std::unordered_map<const void*, std::size_t>;

std::mutex& ranges_mutex() {
  static std::mutex m;
  return m;
}
std::map<int, TierableRanges>& tierable() {
  static auto* r = new std::map<int, TierableRanges>();  // never destroyed, as registry()
  return *r;
}
// The records in tierable(), every device's: TierRoute::live_ranges, read lock-free on
// every large free. Changed under ranges_mutex() with the records.
constinit std::atomic<std::size_t> g_tierable_ranges{0};

}  // namespace

void set_tiering_backend(int device, Backend* backend) {
  RegistryHold hold("set_tiering_backend");
  DeviceTiering& d = registry()[device];
  if (d.vmm && d.backend != backend) {
    throw TieringError("tiering: set_tiering_backend for device " + std::to_string(device) +
                       " after its VMM pool was created on another backend");
  }
  d.backend = backend;
}

namespace detail {
void ensure_allocator_hooks();
}  // namespace detail

VmmPool& tiering_vmm_pool(int device) {
  if (device < 0) throw TieringError("tiering: invalid device " + std::to_string(device));
  // Note [State pushed out under pressure]: the allocator's OOM reaches the pool's ranges;
  // Note [empty_cache releases the spares]: its empty_cache reaches the pool's spares.
  detail::ensure_allocator_hooks();
  RegistryHold hold("tiering_vmm_pool");
  DeviceTiering& d = registry()[device];
  if (!d.vmm) {
    d.vmm = std::make_unique<VmmPool>(backend_locked(device, d));
    std::lock_guard lock(pool_index_mutex());  // Note [A busy registry in an OOM]
    pool_index()[device] = d.vmm.get();
  }
  return *d.vmm;
}

VmmPool* existing_tiering_vmm_pool(int device) {
  RegistryHold hold("existing_tiering_vmm_pool");
  return vmm_pool_locked(device);
}

namespace {

// Note [State pushed out under pressure]
// A pointer-stable range is state the GPU reaches wherever its backing is: on the host it
// is read and written over the link, at the same address. So when the device runs out,
// the ranges on it make room before anything fails: the caching allocator's OOM policy,
// through the reclaim hook (reclaim_tiered_stores), moves ranges after the tiered stores
// have given what they could; and where no state budget is configured (the C ABI used
// without tidepool's configuration; with one, new state goes where the budget puts it,
// Note [New state where the budget puts it] in vmm_migration.cpp, on the host when the
// device is full), a fresh range that finds no device memory (allocate_tierable_range)
// first has the caching allocator give back its cached blocks, then moves older ranges
// to the host, oldest first, until it fits. A foreach AdamW's first step needs all of
// its state at once, with temporaries of the same size: under a memory cap below that,
// the step goes on with part of the state in host memory instead of raising
// OutOfMemoryError (on the H200 on 2026-12-04 a cap between the steady-state peaks of
// the plain and the tidepool runs stopped both at their first step). Moving a
// range waits for the streams that used it, in the middle of an allocation: the price
// of going on. Only the route's tags are moved (optimizer_state): ranges the tiering C
// ABI made under other tags are their owner's to place.
constexpr std::uint64_t kRoutedTags = std::uint64_t{1} << kTagOptimizerState;

// Note [Steps of other threads] in steps_in_flight.cpp: asked before each range, as a
// step may begin while earlier ranges move (each move lets the pool's lock go).
bool another_thread_steps(const VmmPool& pool) {
  const int device = pool.backend().device();
  if (!steps_of_other_threads(device)) return false;
  static std::once_flag said;
  std::call_once(said, [&] {
    std::fprintf(stderr, "tidepool: device %d ran out of memory while another thread's "
                         "optimizer step was in flight there: its state is not moved to the "
                         "host under it (said once)\n", device);
  });
  return true;
}

std::size_t push_ranges_to_host(VmmPool& pool, std::size_t bytes_needed) {
  std::size_t moved = 0;
  for (int tag = 0; tag < kTagCount && moved < bytes_needed; ++tag) {
    if ((kRoutedTags >> tag & 1u) == 0) continue;
    // The lock is let go between ranges (each move waits for streams): a range freed
    // meanwhile, whose address a new range (another tag's) may have taken, is skipped.
    std::vector<std::uint64_t> ids;
    const std::vector<void*> bases = pool.device_backed_ranges(tag, {}, &ids);
    for (std::size_t i = 0; i < bases.size(); ++i) {
      if (moved >= bytes_needed || another_thread_steps(pool)) break;
      try {
        const MigrationResult r = pool.migrate(bases[i], MemoryLocation::host, ids[i]);
        moved += r.bytes_moved;
        // The pinned budget had no room for a chunk (Note [Pinned host backings] in
        // vmm_backings.cpp): the ranges after it would each wait for their streams only to
        // be refused too.
        if (r.bytes_left > 0) return moved;
      } catch (const std::exception& e) {
        // A step that failed (counted in failed_migrations, and the range stays readable
        // where it is): the next range may still move.
        static std::once_flag said;
        std::call_once(said, [&] {
          std::fprintf(stderr, "tidepool: moving optimizer state to the host to make room "
                               "on the device failed (said once): %s\n", e.what());
        });
      }
    }
  }
  return moved;
}

}  // namespace

// Note [No host backing]
// Pointer-stable state moves to the host by being backed with host-NUMA physical memory
// (CU_MEM_LOCATION_TYPE_HOST_NUMA), which some devices, drivers and platforms (WSL, some
// virtual machines) do not support: every eviction then failed, and with a state budget
// the Python hooks raised out of each optimizer.step(). So before the first range of a
// device, one granule of host backing is made, mapped, unmapped and given back: where
// that fails, the route makes no range on that device (the state stays in ordinary device
// memory, as without tiering) and says so once on stderr, with the backend's reason. The tiering C
// ABI's explicit tidepool_vmm_malloc still makes ranges (its evictions say why they fail).
namespace {
bool host_backing_works(int device) {
  Backend* backend = nullptr;
  {
    RegistryHold hold("allocate_tierable_range");
    DeviceTiering& d = registry()[device];
    if (d.host_backing.has_value()) return *d.host_backing;
    backend = &backend_locked(device, d);
  }
  std::string why;
  try {
    const std::size_t granule = backend->granularity();
    const PhysicalHandle h = backend->create_physical(granule, MemoryLocation::host);
    // An empty handle is a host out of memory now, not a missing capability: asked again.
    if (!h) return true;
    // Mapped too, as a range's eviction maps it: a platform may make host-NUMA memory
    // and still refuse to map it for the device (or set its access).
    void* va = nullptr;
    bool mapped = false;
    try {
      va = backend->reserve_address(granule);
      backend->map(va, granule, h);
      mapped = true;
      backend->unmap(va, granule);
      mapped = false;
      backend->release_address(va, granule);
    } catch (const BackendError&) {
      // Best effort: the probe's reason is the error to report. A range left mapped
      // keeps its address (releasing a mapped range is not allowed).
      try {
        if (va != nullptr && !mapped) backend->release_address(va, granule);
      } catch (const BackendError&) {
      }
      try {
        backend->release_physical(h, granule);
      } catch (const BackendError&) {
      }
      throw;
    }
    backend->release_physical(h, granule);
  } catch (const BackendError& e) {
    why = e.what();
  }
  RegistryHold hold("allocate_tierable_range");
  DeviceTiering& d = registry()[device];
  if (!d.host_backing.has_value()) {
    d.host_backing = why.empty();
    if (!why.empty() && active_config().log != LogLevel::off) {
      std::fprintf(stderr,
                   "tidepool: device %d cannot back pointer-stable ranges with host memory "
                   "(%s); optimizer state there stays in ordinary device memory and is not "
                   "moved to the host\n",
                   device, why.c_str());
    }
  }
  return *d.host_backing;
}
}  // namespace

void* allocate_tierable_range(int device, std::size_t bytes, int tag, Stream stream) {
  VmmPool& pool = tiering_vmm_pool(device);
  // Note [New state where the budget puts it] (vmm_migration.cpp): with tidepool
  // configured there is a state budget (0 unless tidepool.state_budget says otherwise),
  // and new state goes where the prefetches will keep it; without one, on the device.
  const bool budgeted = pool.device_budget_bytes().has_value();
  void* p = budgeted ? pool.allocate_within_budget(bytes, tag)
                     : pool.allocate(bytes, tag, MemoryLocation::device);
  if (p == nullptr) {
    // Note [State pushed out under pressure]: the cache first, then older state, unless
    // the range could not fit the device even with nothing else on it. Within a budget
    // a chunk had room neither on the device nor on the host (its memory, or the pinned
    // budget: Note [Pinned host backings] in vmm_backings.cpp): the cache alone may give
    // the device room, as older state has no host room to go to.
    CachingAllocator& allocator = device_allocator(device);
    allocator.empty_cache();
    if (budgeted) {
      p = pool.allocate_within_budget(bytes, tag);
    } else {
      p = pool.allocate(bytes, tag, MemoryLocation::device);
      if (p == nullptr && bytes <= allocator.backend().mem_info().total_bytes &&
          push_ranges_to_host(pool, bytes) > 0) {
        p = pool.allocate(bytes, tag, MemoryLocation::device);
      }
    }
    if (p == nullptr) return nullptr;
  }
  try {
    // PyTorch gives a pluggable allocator no record_stream for other streams; at least
    // the allocating stream's work must finish before the range moves.
    pool.record_use(p, stream);
    std::lock_guard lock(ranges_mutex());
    tierable()[device].emplace(p, bytes);
    g_tierable_ranges.fetch_add(1, std::memory_order_relaxed);
  } catch (...) {
    pool.deallocate(p);
    throw;
  }
  return p;
}

namespace {
// The pool a free or a record of use of `ptr` on `device` goes to: never made for the
// question (a wrong device would otherwise get a pool, a stream and, on CUDA, a context).
VmmPool& existing_pool_holding(int device, const void* ptr) {
  check_device(device);
  VmmPool* pool = existing_tiering_vmm_pool(device);
  if (pool == nullptr) {
    std::ostringstream message;
    message << "tidepool: " << ptr << " is not a pointer-stable range of device " << device
            << " (no range was made there)";
    throw TieringError(message.str());
  }
  return *pool;
}
}  // namespace

// Note [A free's record goes first]
// The record is taken out before the pool's deallocate, which waits for the streams that
// used the range, and the ranges' mutex is not held across that wait: it is every
// device's, and is_tierable_range, asked on every large tidepool_free and
// record_stream, would wait behind one free's kernels. Taken out first, the record cannot
// erase the one of a range that gets the address as soon as deallocate releases it. A
// deallocate that fails (the range stays) puts the record back.
void free_tierable_range(int device, void* ptr, std::optional<std::size_t> bytes) {
  VmmPool& pool = existing_pool_holding(device, ptr);
  std::optional<std::size_t> recorded;
  {
    std::lock_guard lock(ranges_mutex());
    const auto ranges = tierable().find(device);
    if (ranges != tierable().end()) {
      if (const auto range = ranges->second.find(ptr); range != ranges->second.end()) {
        if (bytes.has_value() && range->second != *bytes) {
          std::ostringstream message;
          message << "tidepool: free of " << *bytes << " bytes at " << ptr << " on device "
                  << device << ", but that range was allocated with " << range->second
                  << " bytes; the range was not freed";
          throw TieringError(message.str());
        }
        recorded = range->second;
        ranges->second.erase(range);
        g_tierable_ranges.fetch_sub(1, std::memory_order_relaxed);
      }
    }
  }
  try {
    pool.deallocate(ptr);
  } catch (...) {
    if (recorded.has_value()) {
      std::lock_guard lock(ranges_mutex());
      tierable()[device].emplace(ptr, *recorded);
      g_tierable_ranges.fetch_add(1, std::memory_order_relaxed);
    }
    throw;
  }
}

void record_tierable_range_use(int device, void* ptr, Stream stream) {
  existing_pool_holding(device, ptr).record_use(ptr, stream);
}

bool is_tierable_range(int device, const void* ptr) {
  std::lock_guard lock(ranges_mutex());
  auto it = tierable().find(device);
  return it != tierable().end() && it->second.contains(ptr);
}

namespace {

// Note [tier route] (allocator/tier_routing.h): optimizer_state allocations reaching
// tidepool_malloc become tierable ranges.
const TierRoute kTierRoute{
    kRoutedTags,
    [](std::size_t bytes, int device, int tag, void* stream) -> void* {
      // Beyond any range: the caching allocator refuses it with its own message (a throw
      // here would be taken for a failure of the route, and use up its one report).
      if (bytes > VmmPool::kMaxRangeBytes) return nullptr;
      if (!host_backing_works(device)) return nullptr;  // Note [No host backing]
      return allocate_tierable_range(device, bytes, tag, Stream{stream});
    },
    [](const void* ptr, int device) { return is_tierable_range(device, ptr); },
    [](void* ptr, std::size_t bytes, int device) { free_tierable_range(device, ptr, bytes); },
    [](void* ptr, int device, void* stream) {
      record_tierable_range_use(device, ptr, Stream{stream});
    },
    [](int device, void* stream) {
      // The allocator waited for the stream only if it held something for it (Note
      // [Releasing a stream tidepool never saw], allocator/stream_ordering.cpp). Here too
      // only a user waits: the pool's release_stream when a range names the stream, else
      // that of the first store a handle of which names it (Note [Releasing a stream no
      // range used] in vmm_migration.cpp, Note [Use streams] in tiered_store.h); once one
      // has waited, the other stores only forget it. A stream no range or handle used
      // costs no backend call, as does a device without tiering objects.
      const Stream s{stream};
      VmmPool* pool = existing_tiering_vmm_pool(device);
      bool waited = pool != nullptr && pool->release_stream(s);
      for_each_tiered_store(device, [&](TieredStore& store) {
        if (waited) {
          store.forget_stream(s);
        } else {
          waited = store.release_stream(s);
        }
      });
    },
    []() noexcept { return g_tierable_ranges.load(std::memory_order_relaxed); },
};

// Runs while libtidepool.so is loaded, before anyone can allocate (see the Note).
[[maybe_unused]] const bool g_tier_route_registered = (register_tier_route(&kTierRoute), true);

}  // namespace

void for_each_tiered_store(int device, const std::function<void(TieredStore&)>& fn) {
  RegistryHold hold("for_each_tiered_store");
  auto it = registry().find(device);
  if (it == registry().end()) return;
  for (TieredStore* s = next_store(it->second.stores, nullptr); s != nullptr;
       s = next_store(it->second.stores, s)) {
    fn(*s);
  }
}

namespace detail {

// The allocator's reclaim hook: it waits a bounded time for the registry and the stores
// (Note [A busy registry in an OOM]), and on a thread that holds the registry already it
// walks the stores under that hold (Note [Registry re-entry]): a store's OOM inside a walk
// (a prefetch by tag) still gets the others'.
std::size_t reclaim_tiered_stores(int device, std::size_t bytes_needed) {
  std::size_t freed = 0;
  const auto deadline = std::chrono::steady_clock::now() + kReclaimPatience;
  {
    std::optional<RegistryHold> hold;
    if (!t_holding_registry) {
      hold.emplace(std::chrono::steady_clock::now());  // a try first, to count a wait
      if (!hold->owns()) {
        g_registry_busy_in_reclaim.fetch_add(1, std::memory_order_relaxed);
        if (!registry_wait_failed_in_store_operation()) {
          g_registry_waits_in_reclaim.fetch_add(1, std::memory_order_relaxed);
          hold->lock_before(deadline);
          if (!hold->owns()) note_registry_wait_failed();
        }
      }
    }
    if (!hold || hold->owns()) {
      auto it = registry().find(device);
      if (it != registry().end()) {
        for (TieredStore* s = next_store(it->second.stores, nullptr);
             s != nullptr && freed < bytes_needed; s = next_store(it->second.stores, s)) {
          freed += s->reclaim(bytes_needed - freed, deadline);
        }
      }
    }
  }
  // The registry never destroys a pool it made (registry() lives for the process).
  VmmPool* pool = indexed_pool(device);
  // Note [State pushed out under pressure]: then the pointer-stable ranges, past the
  // registry's lock (a migration takes only the pool's).
  if (freed < bytes_needed && pool != nullptr) {
    freed += push_ranges_to_host(*pool, bytes_needed - freed);
  }
  return freed;
}

std::uint64_t reclaims_that_waited_for_the_registry() noexcept {
  return g_registry_waits_in_reclaim.load(std::memory_order_relaxed);
}

std::uint64_t reclaims_that_found_the_registry_busy() noexcept {
  return g_registry_busy_in_reclaim.load(std::memory_order_relaxed);
}

// Note [empty_cache releases the spares]
// torch.cuda.empty_cache() reaches tidepool_empty_cache_all, whose empty-cache hooks
// (Note [Empty-cache hooks] in allocator/reclaim.cpp) bring it here, to give back the
// pinned host memory tiering keeps only as a cache, which a user who empties the cache
// expects back:
//   - the device's VMM pool gives back its spare host backings, as large as the state
//     moved back to the device (Note [Spare host backings] in vmm_backings.cpp); the next
//     move to the host creates its backings anew;
//   - each tiered store of the device unregisters its empty host slabs (Note [Empty slabs
//     are unpinned] in host_arena.h).
// The hook creates nothing (it is called for every device index). It runs with no
// allocator lock held and takes the registry to find the pool and walk the stores (on a
// thread that holds it already, tidepool_empty_cache called from inside a walk, it reads
// under that hold: Note [Registry re-entry]), then the arenas' and the pool's locks, which
// no path holds while it empties a cache. It cannot recurse: releasing spares and slabs
// calls only the backend, and allocate_tierable_range's own empty_cache runs no hooks.
namespace {
void release_cached_host_memory(int device) {
  VmmPool* pool = nullptr;
  {
    std::optional<RegistryHold> hold;
    if (!t_holding_registry) hold.emplace("releasing cached host memory");
    pool = vmm_pool_locked(device);
    // Each store's empty pinned slabs (Note [Empty slabs are unpinned] in host_arena.h):
    // only the arenas' own locks, which no path holds while it empties a cache.
    if (auto it = registry().find(device); it != registry().end()) {
      for (TieredStore* s = next_store(it->second.stores, nullptr); s != nullptr;
           s = next_store(it->second.stores, s)) {
        s->release_empty_host_slabs();  // never throws
      }
    }
  }
  if (pool != nullptr) pool->release_spare_host_backings();  // never throws
}
}  // namespace

// Registered once the first store or VMM pool exists: before that there is nothing to
// reclaim or release, and a process that never tiers pays nothing.
void ensure_allocator_hooks() {
  static std::once_flag hooks_once;
  std::call_once(hooks_once, [] {
    register_reclaim_hook(
        [](int dev, std::size_t bytes) { return reclaim_tiered_stores(dev, bytes); });
    register_empty_cache_hook([](int dev) { release_cached_host_memory(dev); });
  });
}

void register_tiered_store(int device, TieredStore* store) {
  ensure_allocator_hooks();
  RegistryHold hold("creating a tiered store");
  registry()[device].stores.insert(store);
}
void unregister_tiered_store(int device, TieredStore* store) {
  std::optional<RegistryHold> hold;
  // On a thread inside a walk: leaves the set under that walk's hold (Note [Registry
  // re-entry]).
  if (!t_holding_registry) hold.emplace("unregistering a tiered store");
  registry()[device].stores.erase(store);
}
}  // namespace detail

}  // namespace tidepool
