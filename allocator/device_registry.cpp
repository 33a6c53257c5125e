// Process-wide per-device allocators (see device_registry.h). Lookup of an existing
// allocator is one atomic load, because the C ABI does it on every malloc and free.
#include "allocator/device_registry.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bitset>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "allocator/fork_guard.h"

namespace tidepool {
namespace {

struct Registry {
  std::mutex mutex;
  std::array<std::atomic<CachingAllocator*>, kMaxDevices> allocators{};
  std::optional<BackendKind> chosen;  // set by set_backend or resolved at first use
  // enable_peer_access for devices without an allocator yet: granted at its creation.
  std::array<std::bitset<kMaxDevices>, kMaxDevices> pending_peers{};
  int segment_observers = 0;  // observe_segment_events: starts minus stops
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed, see the header
  return *r;
}

// Note [Forked child]: a child forked while a thread held the registry's lock is marked.
// Registered (and the registry made) when libtidepool is loaded, so the probe, which runs
// in the child's fork handler, allocates nothing and no fork comes before it.
bool registry_locked_at_fork() {
  Registry& r = registry();
  if (!r.mutex.try_lock()) return true;
  r.mutex.unlock();
  return false;
}
const bool g_registry_watched = [] {
  registry();
  detail::watch_registry_at_fork(&registry_locked_at_fork);
  return true;
}();

std::optional<BackendKind> parse_backend(std::string_view name) {
  if (name == "host") return BackendKind::host;
  if (name == "cuda") return BackendKind::cuda;
  if (name == "auto")
    return cuda_device_count() > 0 ? BackendKind::cuda : BackendKind::host;
  return std::nullopt;
}

// Pre: registry mutex held.
BackendKind resolve(Registry& r) {
  if (!r.chosen) {
    const char* env = std::getenv("TIDEPOOL_BACKEND");
    std::string_view name = env != nullptr && *env != '\0' ? env : "auto";
    auto kind = parse_backend(name);
    if (!kind)
      throw AllocatorUsageError("tidepool: TIDEPOOL_BACKEND='" + std::string(name) +
                                "' is not one of cuda, host, auto");
    r.chosen = kind;
  }
  return *r.chosen;
}

std::unique_ptr<Backend> make_backend(BackendKind kind, int device) {
  if (kind == BackendKind::cuda) return make_cuda_backend(device);
  HostBackendOptions options;
  if (const char* mb = std::getenv("TIDEPOOL_HOST_CAPACITY_MB")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(mb, &end, 10);
    // strtoull accepts a minus sign and wraps "-1" to its maximum.
    if (end == mb || *end != '\0' || v == 0 || std::strchr(mb, '-') != nullptr)
      throw AllocatorUsageError(std::string("tidepool: TIDEPOOL_HOST_CAPACITY_MB='") + mb +
                                "' is not a positive number of MiB");
    // Larger values would wrap in the shift below to a small capacity (or none).
    constexpr unsigned long long kMaxMiB = std::numeric_limits<std::size_t>::max() >> 20;
    if (v > kMaxMiB)
      throw AllocatorUsageError(std::string("tidepool: TIDEPOOL_HOST_CAPACITY_MB='") + mb +
                                "' is too large (at most " + std::to_string(kMaxMiB) +
                                " MiB fit in a byte count)");
    options.capacity_bytes = static_cast<std::size_t>(v) << 20;
  }
  return make_host_backend(device, options);
}

// The backend kind, after checking that `device` exists on it; r.mutex held.
BackendKind checked_kind_locked(Registry& r, int device) {
  const BackendKind kind = resolve(r);
  const int limit = kind == BackendKind::cuda ? std::min(cuda_device_count(), kMaxDevices)
                                              : kMaxDevices;
  if (device < 0 || device >= limit)
    throw AllocatorUsageError("tidepool: device " + std::to_string(device) +
                              " does not exist (the " +
                              (kind == BackendKind::cuda ? "cuda" : "host") +
                              " backend has devices 0.." + std::to_string(limit - 1) + ")");
  return kind;
}

}  // namespace

CachingAllocator* existing_device_allocator(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return registry().allocators[device].load(std::memory_order_acquire);
}

void check_device(int device) {
  if (existing_device_allocator(device) != nullptr) return;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  checked_kind_locked(r, device);
}

CachingAllocator* checked_existing_allocator(int device) {
  CachingAllocator* a = existing_device_allocator(device);
  if (a == nullptr) check_device(device);
  return a;
}

CachingAllocator& device_allocator(int device) {
  refuse_in_forked_child();  // Note [Forked child]: before any lock
  if (CachingAllocator* a = existing_device_allocator(device)) return *a;
  // Note [Forked child]: from here on a fork marks its child, which then never waits for
  // the lock below (held through the backend's start-up, which may take seconds).
  detail::note_allocator_in_use();
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const BackendKind kind = checked_kind_locked(r, device);
  if (CachingAllocator* a = r.allocators[device].load(std::memory_order_acquire)) return *a;
  std::unique_ptr<Backend> backend = make_backend(kind, device);
  for (int peer = 0; peer < kMaxDevices; ++peer)
    if (r.pending_peers[device].test(peer)) backend->enable_peer_access(peer);
  auto* a = new CachingAllocator(std::move(backend));
  // Before it is published: no event of its first allocation may be missed.
  if (r.segment_observers > 0) a->segment_events().set_observed(true);
  r.allocators[device].store(a, std::memory_order_release);
  return *a;
}

void enable_peer_access(int device, int peer) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);  // an allocator created meanwhile would miss the peer
  check_peer_access(resolve(r), device, peer);
  if (CachingAllocator* a = r.allocators[device].load(std::memory_order_acquire)) {
    a->backend().enable_peer_access(peer);
  } else {
    r.pending_peers[device].set(peer);
  }
}

void check_device_index(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw AllocatorUsageError("tidepool: " + std::to_string(device) +
                              " is not a device index (0.." + std::to_string(kMaxDevices - 1) +
                              ")");
}

bool peer_access_enabled(int device, int peer) {
  check_device_index(device);
  check_device_index(peer);
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (CachingAllocator* a = r.allocators[device].load(std::memory_order_acquire)) {
    const std::vector<int> peers = a->backend().peers();
    return std::find(peers.begin(), peers.end(), peer) != peers.end();
  }
  return r.pending_peers[device].test(peer);
}

void observe_segment_events(bool on) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);  // an allocator created meanwhile gets the new state
  const bool was = r.segment_observers > 0;
  r.segment_observers = on ? r.segment_observers + 1 : std::max(0, r.segment_observers - 1);
  const bool now = r.segment_observers > 0;
  if (was == now) return;
  for (auto& slot : r.allocators)
    if (CachingAllocator* a = slot.load(std::memory_order_acquire))
      a->segment_events().set_observed(now);
}

void set_backend(std::string_view name) {
  auto kind = parse_backend(name);
  if (!kind)
    throw AllocatorUsageError("tidepool: backend '" + std::string(name) +
                              "' is not one of cuda, host, auto");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (auto& a : r.allocators)
    if (a.load() != nullptr)
      throw std::logic_error("tidepool: set_backend('" + std::string(name) +
                             "') after a device allocator was created; call it first");
  r.chosen = kind;
}

BackendKind selected_backend() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return resolve(r);
}

std::optional<BackendKind> backend_in_use() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (auto& a : r.allocators) {
    if (a.load() != nullptr) return r.chosen;  // resolved when the first was made
  }
  return std::nullopt;
}

}  // namespace tidepool
