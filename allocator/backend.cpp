// The backend seam's shared half: the non-virtual public methods of `Backend`.
//
// Each public method checks its preconditions here, once for both implementations, and
// only then calls the private `do_*` hook (the RMM / mimalloc prim.h pattern). A broken
// precondition is a BackendError whose message names the operation and the bad argument,
// so a caller bug never reaches the CUDA driver or the host backend's bookkeeping.
// The fault-injection counters for the reliability tests also live here.
#include "allocator/backend.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <unistd.h>

namespace tidepool {

// One counter per FaultPoint: how many more operations at that point must fail.
struct Backend::FaultState {
  std::mutex mutex;
  std::array<int, static_cast<std::size_t>(FaultPoint::count_)> pending{};
  std::array<int, static_cast<std::size_t>(FaultPoint::count_)> codes{};
};

// The device limit and what counts against it. release_physical is not told where a
// handle's memory lives, so the device-located handles are remembered (physical memory
// comes in 2 MiB granules: few handles, created and released off the hot path).
struct Backend::DeviceLimit {
  std::atomic<std::size_t> limit{std::numeric_limits<std::size_t>::max()};
  std::atomic<std::size_t> in_use{0};
  std::mutex handles_mutex;
  std::unordered_set<std::uint64_t> device_handles;
};

// Who may access the mapped ranges besides this device, and which ranges are mapped
// (Note [Peer access to mapped ranges] in backend.h).
struct Backend::PeerState {
  std::mutex mutex;
  std::vector<int> peers;                       // ascending
  std::map<std::uintptr_t, std::size_t> mapped;  // start -> bytes, as passed to do_map
};

namespace {

std::string hex(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw BackendError(std::string("tidepool backend: ") + op + ": " + what);
}

void require_nonzero(const char* op, std::size_t bytes) {
  if (bytes == 0) fail(op, "bytes must be > 0");
}

void require_ptr(const char* op, const void* p, const char* what) {
  if (p == nullptr) fail(op, std::string(what) + " is a null pointer");
}

void require_event(const char* op, Event e, const char* which = "event") {
  if (!e) fail(op, std::string(which) + " is a null event (create it with create_event)");
}

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

Backend::Backend(BackendKind kind, int device, std::size_t granularity)
    : kind_(kind),
      device_(device),
      granularity_(granularity),
      faults_(std::make_shared<FaultState>()),
      limit_(std::make_unique<DeviceLimit>()),
      peers_(std::make_unique<PeerState>()) {
  if (device < 0) fail("constructor", "device index " + std::to_string(device) + " is negative");
  if (granularity == 0 || (granularity & (granularity - 1)) != 0)
    fail("constructor", "granularity " + std::to_string(granularity) + " is not a power of two");
}

Backend::~Backend() = default;

// --- fault injection ------------------------------------------------------------------

void Backend::inject_fault(FaultPoint point, int count, int cuda_error) {
  const auto index = static_cast<std::size_t>(point);
  if (index >= faults_->pending.size())
    fail("inject_fault", "unknown fault point " + std::to_string(index));
  if (count < 0) fail("inject_fault", "count " + std::to_string(count) + " is negative");
  // The cuda backend never consults the counters (see backend.h); keeping them at zero
  // there means a test that injects on cuda sees real behaviour, not a stale fault.
  if (kind_ == BackendKind::cuda) return;
  std::lock_guard lock(faults_->mutex);
  faults_->pending[index] += count;
  faults_->codes[index] = cuda_error;
}

int Backend::injected_fault_code(FaultPoint point) const {
  const auto index = static_cast<std::size_t>(point);
  if (index >= faults_->codes.size()) return 0;
  std::lock_guard lock(faults_->mutex);
  return faults_->codes[index];
}

bool Backend::consume_fault(FaultPoint point) {
  const auto index = static_cast<std::size_t>(point);
  if (index >= faults_->pending.size()) return false;
  std::lock_guard lock(faults_->mutex);
  if (faults_->pending[index] == 0) return false;
  --faults_->pending[index];
  return true;
}

// --- device memory --------------------------------------------------------------------

void* Backend::device_alloc(std::size_t bytes) {
  require_nonzero("device_alloc", bytes);
  if (!claim_device_bytes(bytes)) return nullptr;
  void* p = nullptr;
  try {
    p = do_device_alloc(bytes);
  } catch (...) {
    unclaim_device_bytes(bytes);
    throw;
  }
  if (p == nullptr) unclaim_device_bytes(bytes);
  return p;
}

void Backend::device_free(void* ptr, std::size_t bytes) {
  require_ptr("device_free", ptr, "ptr");
  require_nonzero("device_free", bytes);
  do_device_free(ptr, bytes);
  unclaim_device_bytes(bytes);
}

MemInfo Backend::mem_info() { return do_mem_info(); }

// --- device memory limit --------------------------------------------------------------

void Backend::set_device_limit(std::size_t bytes) { limit_->limit.store(bytes); }

std::size_t Backend::device_limit() const { return limit_->limit.load(); }

std::size_t Backend::device_bytes_in_use() const { return limit_->in_use.load(); }

bool Backend::claim_device_bytes(std::size_t bytes) {
  // Claimed before the allocation, so two threads cannot both pass the check.
  std::size_t used = limit_->in_use.load();
  do {
    const std::size_t limit = limit_->limit.load();
    if (bytes > limit || used > limit - bytes) return false;
  } while (!limit_->in_use.compare_exchange_weak(used, used + bytes));
  return true;
}

void Backend::unclaim_device_bytes(std::size_t bytes) { limit_->in_use.fetch_sub(bytes); }

// --- streams and events ---------------------------------------------------------------

Stream Backend::create_stream() { return do_create_stream(); }

void Backend::destroy_stream(Stream s) {
  if (s.handle == nullptr) fail("destroy_stream", "the default (null) stream cannot be destroyed");
  do_destroy_stream(s);
}

void Backend::stream_synchronize(Stream s) { do_stream_synchronize(s); }

void Backend::device_synchronize() { do_device_synchronize(); }

Event Backend::create_event() { return do_create_event(); }

void Backend::destroy_event(Event e) {
  require_event("destroy_event", e);
  do_destroy_event(e);
}

void Backend::record_event(Event e, Stream s) {
  require_event("record_event", e);
  do_record_event(e, s);
}

bool Backend::event_query(Event e) {
  require_event("event_query", e);
  return do_event_query(e);
}

void Backend::event_synchronize(Event e) {
  require_event("event_synchronize", e);
  do_event_synchronize(e);
}

void Backend::stream_wait_event(Stream s, Event e) {
  require_event("stream_wait_event", e);
  do_stream_wait_event(s, e);
}

float Backend::event_elapsed_ms(Event start, Event end) {
  require_event("event_elapsed_ms", start, "start");
  require_event("event_elapsed_ms", end, "end");
  return do_event_elapsed_ms(start, end);
}

// --- copies ---------------------------------------------------------------------------

void Backend::copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream s) {
  if (static_cast<std::uint8_t>(kind) > static_cast<std::uint8_t>(CopyKind::host_to_host))
    fail("copy_async", "unknown copy kind " + std::to_string(static_cast<int>(kind)));
  // Zero bytes is a valid no-op, as with cudaMemcpyAsync; null pointers are still a bug.
  require_ptr("copy_async", dst, "dst");
  require_ptr("copy_async", src, "src");
  if (bytes == 0) return;
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto sr = reinterpret_cast<std::uintptr_t>(src);
  if (d < sr + bytes && sr < d + bytes)
    fail("copy_async", "source " + hex(src) + " and destination " + hex(dst) + " overlap for " +
                           std::to_string(bytes) + " bytes");
  do_copy_async(dst, src, bytes, kind, s);
}

void Backend::memset_async(void* dst, int value, std::size_t bytes, Stream s) {
  require_ptr("memset_async", dst, "dst");
  if (bytes == 0) return;
  do_memset_async(dst, value, bytes, s);
}

void Backend::launch_host_func(Stream s, void (*fn)(void*), void* arg) {
  if (fn == nullptr) fail("launch_host_func", "fn is a null function pointer");
  do_launch_host_func(s, fn, arg);
}

// --- pinned host memory ---------------------------------------------------------------

void Backend::host_register(void* ptr, std::size_t bytes) {
  require_ptr("host_register", ptr, "ptr");
  require_nonzero("host_register", bytes);
  if (reinterpret_cast<std::uintptr_t>(ptr) % page_size() != 0)
    fail("host_register", "ptr " + hex(ptr) + " is not aligned to the page size (" +
                              std::to_string(page_size()) + " bytes)");
  do_host_register(ptr, bytes);
}

void Backend::host_unregister(void* ptr) {
  require_ptr("host_unregister", ptr, "ptr");
  do_host_unregister(ptr);
}

// --- virtual address ranges -----------------------------------------------------------

namespace {

void require_granular(const char* op, std::size_t bytes, std::size_t granularity) {
  require_nonzero(op, bytes);
  if (bytes % granularity != 0)
    fail(op, "bytes " + std::to_string(bytes) + " is not a multiple of the granularity (" +
                 std::to_string(granularity) + ")");
}

void require_granular_va(const char* op, const void* va, std::size_t granularity) {
  require_ptr(op, va, "va");
  if (reinterpret_cast<std::uintptr_t>(va) % granularity != 0)
    fail(op, "va " + hex(va) + " is not aligned to the granularity (" +
                 std::to_string(granularity) + ")");
}

}  // namespace

void* Backend::reserve_address(std::size_t bytes) {
  require_granular("reserve_address", bytes, granularity_);
  return do_reserve_address(bytes);
}

void Backend::release_address(void* va, std::size_t bytes) {
  require_granular_va("release_address", va, granularity_);
  require_granular("release_address", bytes, granularity_);
  do_release_address(va, bytes);
}

PhysicalHandle Backend::create_physical(std::size_t bytes, MemoryLocation where) {
  require_granular("create_physical", bytes, granularity_);
  if (where != MemoryLocation::device && where != MemoryLocation::host)
    fail("create_physical", "unknown memory location " + std::to_string(static_cast<int>(where)));
  if (where == MemoryLocation::host) return do_create_physical(bytes, where);
  if (!claim_device_bytes(bytes)) return PhysicalHandle{};
  PhysicalHandle h{};
  try {
    h = do_create_physical(bytes, where);
  } catch (...) {
    unclaim_device_bytes(bytes);
    throw;
  }
  if (!h) {
    unclaim_device_bytes(bytes);
    return h;
  }
  try {
    std::lock_guard lock(limit_->handles_mutex);
    limit_->device_handles.insert(h.value);
  } catch (...) {  // std::bad_alloc: give the memory back rather than lose track of it
    do_release_physical(h, bytes);
    unclaim_device_bytes(bytes);
    throw;
  }
  return h;
}

void Backend::release_physical(PhysicalHandle h, std::size_t bytes) {
  if (!h) fail("release_physical", "null physical handle");
  require_granular("release_physical", bytes, granularity_);
  // Forgotten before the release: once released, the driver may give the same handle value
  // to another thread's create_physical (the VMM moves create backings on helper threads),
  // whose record an erase after the release would remove.
  bool on_device = false;
  {
    std::lock_guard lock(limit_->handles_mutex);
    on_device = limit_->device_handles.erase(h.value) != 0;
  }
  try {
    do_release_physical(h, bytes);
  } catch (...) {  // still allocated: still counted
    if (on_device) {
      std::lock_guard lock(limit_->handles_mutex);
      limit_->device_handles.insert(h.value);
    }
    throw;
  }
  if (on_device) unclaim_device_bytes(bytes);
}

void Backend::map(void* va, std::size_t bytes, PhysicalHandle h) {
  require_granular_va("map", va, granularity_);
  require_granular("map", bytes, granularity_);
  if (!h) fail("map", "null physical handle");
  do_map(va, bytes, h);
  const auto start = reinterpret_cast<std::uintptr_t>(va);
  std::lock_guard lock(peers_->mutex);
  try {
    peers_->mapped.emplace(start, bytes);
    if (!peers_->peers.empty()) do_grant_peer_access(va, bytes, peers_->peers);
  } catch (...) {
    // A mapping the peers cannot reach would fault on them later: map fails as a whole.
    peers_->mapped.erase(start);
    try {
      do_unmap(va, bytes);
    } catch (...) {  // the grant's error is the one to report
    }
    throw;
  }
}

void Backend::unmap(void* va, std::size_t bytes) {
  require_granular_va("unmap", va, granularity_);
  require_granular("unmap", bytes, granularity_);
  const auto start = reinterpret_cast<std::uintptr_t>(va);
  // The records move between the maps as nodes (extract, insert of the node): no heap, so
  // an unmap, which callers make to give memory back when the heap has run out, needs none.
  std::map<std::uintptr_t, std::size_t> forgotten;
  {
    std::lock_guard lock(peers_->mutex);
    auto& mapped = peers_->mapped;
    auto it = mapped.lower_bound(start);
    while (it != mapped.end() && it->first < start + bytes) {
      auto next = std::next(it);
      forgotten.insert(mapped.extract(it));
      it = next;
    }
  }
  try {
    do_unmap(va, bytes);
  } catch (...) {
    std::lock_guard lock(peers_->mutex);
    while (!forgotten.empty()) peers_->mapped.insert(forgotten.extract(forgotten.begin()));
    throw;
  }
}

// --- peer access ----------------------------------------------------------------------

void Backend::enable_peer_access(int peer) {
  check_peer_access(kind_, device_, peer);
  std::lock_guard lock(peers_->mutex);
  auto& peers = peers_->peers;
  auto at = std::lower_bound(peers.begin(), peers.end(), peer);
  if (at != peers.end() && *at == peer) return;
  const std::vector<int> just_this{peer};
  for (const auto& [start, bytes] : peers_->mapped)
    do_grant_peer_access(reinterpret_cast<void*>(start), bytes, just_this);
  peers.insert(at, peer);
}

std::vector<int> Backend::peers() const {
  std::lock_guard lock(peers_->mutex);
  return peers_->peers;
}

bool Backend::peer_has_access(const void* addr, int peer) {
  require_ptr("peer_has_access", addr, "addr");
  if (peer < 0 || peer >= kMaxDevices)
    fail("peer_has_access", "device " + std::to_string(peer) + " is not a device index (0.." +
                                std::to_string(kMaxDevices - 1) + ")");
  return do_peer_has_access(addr, peer);
}

void check_peer_access(BackendKind kind, int device, int peer) {
  const char* op = "enable_peer_access";
  const bool cuda = kind == BackendKind::cuda;
  const int count = cuda ? std::min(cuda_device_count(), kMaxDevices) : kMaxDevices;
  const auto exists = [&](int d) { return d >= 0 && d < count; };
  const std::string devices =
      std::string(" (the ") + (cuda ? "cuda" : "host") + " backend has " +
      (count > 0 ? "devices 0.." + std::to_string(count - 1) : std::string("no devices")) + ")";
  if (!exists(device)) fail(op, "device " + std::to_string(device) + " does not exist" + devices);
  if (!exists(peer)) fail(op, "peer device " + std::to_string(peer) + " does not exist" + devices);
  if (peer == device)
    fail(op, "device " + std::to_string(device) +
                 " cannot be its own peer (it always has access to its own memory)");
  if (cuda && !cuda_can_access_peer(device, peer))
    fail(op, "device " + std::to_string(peer) + " cannot access the memory of device " +
                 std::to_string(device) +
                 " (cuDeviceCanAccessPeer says no: no peer-to-peer path between these GPUs)");
}

}  // namespace tidepool
