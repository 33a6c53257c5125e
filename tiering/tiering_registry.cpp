// The per-device tiering registry behind the C ABI. See tiering_registry.h.
#include "tiering/tiering_registry.h"

#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "allocator/device_registry.h"
#include "allocator/reclaim.h"
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

void for_each_tiered_store(int device, const std::function<void(TieredStore&)>& fn) {
  std::lock_guard lock(registry_mutex());
  auto it = registry().find(device);
  if (it == registry().end()) return;
  for (TieredStore* s : it->second.stores) fn(*s);
}

namespace detail {

std::size_t reclaim_tiered_stores(int device, std::size_t bytes_needed) {
  std::unique_lock lock(registry_mutex(), std::try_to_lock);
  if (!lock.owns_lock()) return 0;
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
