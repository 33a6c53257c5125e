// The per-device tiering registry behind the C ABI. See tiering_registry.h.
#include "tiering/tiering_registry.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_set>

#include "allocator/device_registry.h"
#include "allocator/reclaim.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {

namespace {

struct DeviceTiering {
  Backend* backend = nullptr;  // borrowed
  std::unique_ptr<VmmPool> vmm;
  std::set<TieredStore*> stores;
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

// Default: the backend of the device's caching allocator, so tiering and the allocator
// share streams, capacity and (on the host backend) the emulated device.
Backend& backend_locked(int device, DeviceTiering& d) {
  if (d.backend == nullptr) d.backend = &device_allocator(device).backend();
  return *d.backend;
}

// The bases of allocate_tierable_range's ranges, per device (their tags and ages live in
// the VmmPool). A mutex of its own: is_tierable_range is asked on frees, and must not
// wait behind a store operation that holds the registry lock.
using TierableRanges = std::unordered_set<const void*>;

std::mutex& ranges_mutex() {
  static std::mutex m;
  return m;
}
std::map<int, TierableRanges>& tierable() {
  static auto* r = new std::map<int, TierableRanges>();  // never destroyed, as registry()
  return *r;
}

}  // namespace

void set_tiering_backend(int device, Backend* backend) {
  std::lock_guard lock(registry_mutex());
  DeviceTiering& d = registry()[device];
  if (d.vmm && d.backend != backend) {
    throw TieringError("tiering: set_tiering_backend for device " + std::to_string(device) +
                       " after its VMM pool was created on another backend");
  }
  d.backend = backend;
}

VmmPool& tiering_vmm_pool(int device) {
  if (device < 0) throw TieringError("tiering: invalid device " + std::to_string(device));
  std::lock_guard lock(registry_mutex());
  DeviceTiering& d = registry()[device];
  if (!d.vmm) d.vmm = std::make_unique<VmmPool>(backend_locked(device, d));
  return *d.vmm;
}

VmmPool* existing_tiering_vmm_pool(int device) {
  std::lock_guard lock(registry_mutex());
  auto it = registry().find(device);
  return it == registry().end() ? nullptr : it->second.vmm.get();
}

void* allocate_tierable_range(int device, std::size_t bytes, int tag, Stream stream) {
  VmmPool& pool = tiering_vmm_pool(device);
  void* p = pool.allocate(bytes, tag, MemoryLocation::device);
  if (p == nullptr) return nullptr;
  try {
    // PyTorch gives a pluggable allocator no record_stream for other streams; at least
    // the allocating stream's work must finish before the range moves.
    pool.record_use(p, stream);
    std::lock_guard lock(ranges_mutex());
    tierable()[device].insert(p);
  } catch (...) {
    pool.deallocate(p);
    throw;
  }
  return p;
}

void free_tierable_range(int device, void* ptr) {
  VmmPool& pool = tiering_vmm_pool(device);
  // Held across deallocate: the address may be handed out again as soon as it is
  // released, and its new record must not be erased by this free.
  std::lock_guard lock(ranges_mutex());
  pool.deallocate(ptr);
  tierable()[device].erase(ptr);
}

bool is_tierable_range(int device, const void* ptr) {
  std::lock_guard lock(ranges_mutex());
  auto it = tierable().find(device);
  return it != tierable().end() && it->second.count(ptr) != 0;
}

namespace {

// Note [tier route] (allocator/tier_routing.h): optimizer_state allocations reaching
// tidepool_malloc become tierable ranges.
const TierRoute kTierRoute{
    std::uint64_t{1} << kTagOptimizerState,
    [](std::size_t bytes, int device, int tag, void* stream) {
      return allocate_tierable_range(device, bytes, tag, Stream{stream});
    },
    [](const void* ptr, int device) { return is_tierable_range(device, ptr); },
    [](void* ptr, int device) { free_tierable_range(device, ptr); },
    [](void* ptr, int device, void* stream) {
      tiering_vmm_pool(device).record_use(ptr, Stream{stream});
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
};

// Runs while libtidepool.so is loaded, before anyone can allocate (see the Note).
[[maybe_unused]] const bool g_tier_route_registered = (register_tier_route(&kTierRoute), true);

}  // namespace

namespace {
// This thread holds registry_mutex() in for_each_tiered_store: a store the callback runs
// into an OOM (a prefetch by tag), whose reclaim hook comes back here on the same thread,
// must not lock it again (try_lock of a mutex the thread owns is undefined); the set of
// stores cannot change meanwhile, so the hook reads it as it is.
thread_local bool t_holding_registry = false;
}  // namespace

void for_each_tiered_store(int device, const std::function<void(TieredStore&)>& fn) {
  std::lock_guard lock(registry_mutex());
  auto it = registry().find(device);
  if (it == registry().end()) return;
  const bool outer = t_holding_registry;
  t_holding_registry = true;
  try {
    for (TieredStore* s : it->second.stores) fn(*s);
  } catch (...) {
    t_holding_registry = outer;
    throw;
  }
  t_holding_registry = outer;
}

namespace detail {

std::size_t reclaim_tiered_stores(int device, std::size_t bytes_needed) {
  std::unique_lock lock(registry_mutex(), std::defer_lock);
  if (!t_holding_registry && !lock.try_lock()) return 0;
  auto it = registry().find(device);
  if (it == registry().end()) return 0;
  std::size_t freed = 0;
  for (TieredStore* s : it->second.stores) {
    if (freed >= bytes_needed) break;
    freed += s->reclaim(bytes_needed - freed);
  }
  return freed;
}

void register_tiered_store(int device, TieredStore* store) {
  static std::once_flag hook_once;
  std::call_once(hook_once, [] {
    register_reclaim_hook([](int dev, std::size_t bytes) { return reclaim_tiered_stores(dev, bytes); });
  });
  std::lock_guard lock(registry_mutex());
  registry()[device].stores.insert(store);
}
void unregister_tiered_store(int device, TieredStore* store) {
  std::lock_guard lock(registry_mutex());
  registry()[device].stores.erase(store);
}
}  // namespace detail

}  // namespace tidepool
