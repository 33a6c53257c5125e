// The host backend: a complete implementation of the backend seam on plain host memory.
//
// It is not a mock. The allocator and tiering tests run on it in CI, so it keeps every
// promise backend.h makes, with the failure modes a GPU has:
//   - "device" memory is 256-byte aligned host memory under a capacity limit shared by
//     device_alloc and device-located physical memory; exceeding it is an OOM (nullptr /
//     null handle), like cudaMalloc / cuMemCreate;
//   - streams are FIFOs run by their own worker thread (host_stream.h), the null stream
//     is one of them; events are markers the stream passes; copies and memsets are done by
//     the stream's worker, so they really are asynchronous;
//   - VA ranges are PROT_NONE reservations; physical memory is a memfd; map is
//     mmap(MAP_SHARED|MAP_FIXED) of the memfd, unmap puts PROT_NONE back. Data therefore
//     follows the physical handle, not the address: the same bytes show up wherever the
//     handle is mapped, which is exactly what pointer-stable migration relies on;
//   - every handle and pointer is validated against the backend's own records, so a
//     caller bug (double free, unknown handle, overlapping registration) is a
//     BackendError instead of memory corruption;
//   - peer access is recorded per mapping (the devices it emulates are 0..kMaxDevices-1),
//     so the grants of Note [Peer access to mapped ranges] can be checked: a new mapping
//     starts with none, as on CUDA;
//   - fault injection (Backend::consume_fault) at device_alloc, copy, host_register, map,
//     create_physical and peer_access.
//
// Locks: handles_mutex_ (streams, events), memory_mutex_ (capacity, allocations),
// pinned_mutex_ (registrations), vm_mutex_ (reservations, physicals, mappings). No two
// are ever held at once, so there is no lock order to get wrong (the seam's own peer
// mutex, backend.cpp, is taken outside all of them).
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "allocator/backend.h"
#include "allocator/backends/host_stream.h"

namespace tidepool {
namespace {

using host_detail::HostStream;
using host_detail::StreamMarker;

constexpr std::size_t kDeviceAlignment = 256;
constexpr std::size_t kGranularity = std::size_t{2} << 20;  // 2 MiB, as on CUDA

[[noreturn]] void fail(const char* op, const std::string& what, int cuda_error = 0) {
  throw BackendError(std::string("tidepool host backend: ") + op + ": " + what, cuda_error);
}

std::string errno_text(int err) { return std::string(std::strerror(err)); }

std::string hex(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

// An event: the marker of its last record (null until recorded).
struct HostEvent {
  std::mutex mutex;
  std::shared_ptr<StreamMarker> last;

  std::shared_ptr<StreamMarker> current() {
    std::lock_guard lock(mutex);
    return last;
  }
};

struct PhysicalMemory {
  int fd = -1;
  std::size_t bytes = 0;
  MemoryLocation where = MemoryLocation::device;
};

struct Mapping {
  std::size_t bytes = 0;
  std::uint64_t handle = 0;
  std::uint64_t peer_mask = 0;  // bit d: device d was granted access
};
static_assert(kMaxDevices <= 64, "Mapping::peer_mask has a bit per device");

class HostBackend final : public Backend {
 public:
  HostBackend(int device, HostBackendOptions options)
      : Backend(BackendKind::host, device, kGranularity),
        capacity_(options.capacity_bytes),
        default_stream_(std::make_shared<HostStream>("default")) {}

  ~HostBackend() override;

 private:
  // --- lookups ---
  std::shared_ptr<HostStream> stream_of(const char* op, Stream s);
  std::shared_ptr<HostEvent> event_of(const char* op, Event e);
  std::vector<std::shared_ptr<HostStream>> all_streams();
  // Takes `bytes` of the emulated device capacity; false when it would be exceeded.
  bool take_capacity(std::size_t bytes);
  void return_capacity(std::size_t bytes);

  // --- Backend hooks ---
  void* do_device_alloc(std::size_t bytes) override;
  void do_device_free(void* ptr, std::size_t bytes) override;
  MemInfo do_mem_info() override;
  Stream do_create_stream() override;
  void do_destroy_stream(Stream s) override;
  void do_stream_synchronize(Stream s) override;
  void do_device_synchronize() override;
  Event do_create_event() override;
  void do_destroy_event(Event e) override;
  void do_record_event(Event e, Stream s) override;
  bool do_event_query(Event e) override;
  void do_event_synchronize(Event e) override;
  void do_stream_wait_event(Stream s, Event e) override;
  float do_event_elapsed_ms(Event start, Event end) override;
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                     Stream s) override;
  void do_memset_async(void* dst, int value, std::size_t bytes, Stream s) override;
  void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) override;
  void do_host_register(void* ptr, std::size_t bytes) override;
  void do_host_unregister(void* ptr) override;
  void* do_reserve_address(std::size_t bytes) override;
  void do_release_address(void* va, std::size_t bytes) override;
  PhysicalHandle do_create_physical(std::size_t bytes, MemoryLocation where) override;
  void do_release_physical(PhysicalHandle h, std::size_t bytes) override;
  void do_map(void* va, std::size_t bytes, PhysicalHandle h) override;
  void do_unmap(void* va, std::size_t bytes) override;
  void do_grant_peer_access(void* va, std::size_t bytes, const std::vector<int>& peers) override;
  bool do_peer_has_access(const void* addr, int peer) override;

  const std::size_t capacity_;

  std::mutex handles_mutex_;
  std::shared_ptr<HostStream> default_stream_;
  std::unordered_map<void*, std::shared_ptr<HostStream>> streams_;
  // Destroyed, their handles dead, their queued work still running (do_destroy_stream).
  std::vector<std::shared_ptr<HostStream>> draining_streams_;
  std::unordered_map<void*, std::shared_ptr<HostEvent>> events_;
  std::uint64_t streams_created_ = 0;

  std::mutex memory_mutex_;
  std::size_t used_ = 0;                               // device_alloc + device physical
  std::unordered_map<void*, std::size_t> allocations_;  // device_alloc'd ptr -> bytes

  std::mutex pinned_mutex_;
  std::map<std::uintptr_t, std::size_t> registered_;  // start -> bytes

  std::mutex vm_mutex_;
  std::map<std::uintptr_t, std::size_t> reservations_;  // start -> bytes
  std::map<std::uintptr_t, Mapping> mappings_;          // start -> mapping
  std::unordered_map<std::uint64_t, PhysicalMemory> physicals_;
  std::uint64_t next_physical_ = 1;  // 0 is the null handle
};

HostBackend::~HostBackend() {
  // Streams first: queued work may still touch the memory released below.
  std::vector<std::shared_ptr<HostStream>> streams = all_streams();
  {
    std::lock_guard lock(handles_mutex_);
    streams_.clear();
    events_.clear();
    default_stream_.reset();
  }
  streams.clear();  // the last references: each destructor drains and joins its worker
  // Whatever the caller leaked goes back now, so a leak in a test is not a leak of the
  // process (and LeakSanitizer reports the caller, not us).
  for (auto& [ptr, bytes] : allocations_) std::free(ptr);
  // Unmapping is implied: munmap of each reservation drops the mappings inside it.
  for (auto& [start, bytes] : reservations_) ::munmap(reinterpret_cast<void*>(start), bytes);
  for (auto& [handle, phys] : physicals_) ::close(phys.fd);
}

// --- lookups ----------------------------------------------------------------------------

std::shared_ptr<HostStream> HostBackend::stream_of(const char* op, Stream s) {
  std::lock_guard lock(handles_mutex_);
  if (s.handle == nullptr) return default_stream_;
  auto it = streams_.find(s.handle);
  if (it == streams_.end())
    fail(op, "unknown stream " + hex(s.handle) + " (destroyed, or from another backend)");
  return it->second;
}

std::shared_ptr<HostEvent> HostBackend::event_of(const char* op, Event e) {
  std::lock_guard lock(handles_mutex_);
  auto it = events_.find(e.handle);
  if (it == events_.end())
    fail(op, "unknown event " + hex(e.handle) + " (destroyed, or from another backend)");
  return it->second;
}

std::vector<std::shared_ptr<HostStream>> HostBackend::all_streams() {
  std::lock_guard lock(handles_mutex_);
  std::vector<std::shared_ptr<HostStream>> out;
  out.reserve(streams_.size() + draining_streams_.size() + 1);
  if (default_stream_) out.push_back(default_stream_);
  for (auto& [handle, stream] : streams_) out.push_back(stream);
  out.insert(out.end(), draining_streams_.begin(), draining_streams_.end());
  return out;
}

bool HostBackend::take_capacity(std::size_t bytes) {
  std::lock_guard lock(memory_mutex_);
  if (bytes > capacity_ - used_) return false;
  used_ += bytes;
  return true;
}

void HostBackend::return_capacity(std::size_t bytes) {
  std::lock_guard lock(memory_mutex_);
  used_ -= bytes;
}

// --- device memory --------------------------------------------------------------------

void* HostBackend::do_device_alloc(std::size_t bytes) {
  if (consume_fault(FaultPoint::device_alloc)) return nullptr;
  if (!take_capacity(bytes)) return nullptr;
  // aligned_alloc wants a size that is a multiple of the alignment; bytes <= capacity,
  // so rounding up cannot overflow for any sane capacity.
  const std::size_t rounded = (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
  void* ptr = rounded >= bytes ? std::aligned_alloc(kDeviceAlignment, rounded) : nullptr;
  if (ptr == nullptr) {  // the host itself is out of memory: an OOM to the caller as well
    return_capacity(bytes);
    return nullptr;
  }
  try {
    std::lock_guard lock(memory_mutex_);
    allocations_.emplace(ptr, bytes);
  } catch (...) {  // std::bad_alloc: the memory and its capacity go back, not astray
    std::free(ptr);
    return_capacity(bytes);
    throw;
  }
  return ptr;
}

void HostBackend::do_device_free(void* ptr, std::size_t bytes) {
  {
    std::lock_guard lock(memory_mutex_);
    auto it = allocations_.find(ptr);
    if (it == allocations_.end())
      fail("device_free", "pointer " + hex(ptr) +
                              " was not allocated by device_alloc of this backend (or was "
                              "already freed)");
    if (it->second != bytes)
      fail("device_free", "pointer " + hex(ptr) + " was allocated with " +
                              std::to_string(it->second) + " bytes but freed with " +
                              std::to_string(bytes));
    allocations_.erase(it);
    used_ -= bytes;
  }
  std::free(ptr);
}

MemInfo HostBackend::do_mem_info() {
  std::lock_guard lock(memory_mutex_);
  return MemInfo{capacity_ - used_, capacity_};
}

// --- streams and events ---------------------------------------------------------------

Stream HostBackend::do_create_stream() {
  std::uint64_t number;
  {
    std::lock_guard lock(handles_mutex_);
    number = ++streams_created_;
  }
  auto stream = std::make_shared<HostStream>("stream " + std::to_string(number));
  void* handle = stream.get();
  std::lock_guard lock(handles_mutex_);
  streams_.emplace(handle, std::move(stream));
  return Stream{handle};
}

void HostBackend::do_destroy_stream(Stream s) {
  std::shared_ptr<HostStream> stream;
  {
    std::lock_guard lock(handles_mutex_);
    auto it = streams_.find(s.handle);
    if (it == streams_.end())
      fail("destroy_stream", "unknown stream " + hex(s.handle) + " (already destroyed?)");
    stream = std::move(it->second);
    streams_.erase(it);
    // As with cudaStreamDestroy, the handle is dead now but its queued work still runs,
    // and a device_synchronize meanwhile waits for it (the allocator's free after a lost
    // stream relies on that: Note [Free after a lost stream]).
    draining_streams_.push_back(stream);
  }
  struct Drained {
    HostBackend& backend;
    const HostStream* stream;
    ~Drained() {
      std::lock_guard lock(backend.handles_mutex_);
      std::erase_if(backend.draining_streams_,
                    [this](const auto& s) { return s.get() == stream; });
    }
  } drained{*this, stream.get()};
  // Drained here (and joined once the last reference goes); a failure of its work is
  // reported now rather than lost.
  stream->synchronize();
}

void HostBackend::do_stream_synchronize(Stream s) {
  stream_of("stream_synchronize", s)->synchronize();
}

void HostBackend::do_device_synchronize() {
  for (auto& stream : all_streams()) stream->synchronize();
}

Event HostBackend::do_create_event() {
  auto event = std::make_shared<HostEvent>();
  void* handle = event.get();
  std::lock_guard lock(handles_mutex_);
  events_.emplace(handle, std::move(event));
  return Event{handle};
}

void HostBackend::do_destroy_event(Event e) {
  std::lock_guard lock(handles_mutex_);
  if (events_.erase(e.handle) == 0)
    fail("destroy_event", "unknown event " + hex(e.handle) + " (already destroyed?)");
}

void HostBackend::do_record_event(Event e, Stream s) {
  auto event = event_of("record_event", e);
  auto marker = stream_of("record_event", s)->enqueue_marker();
  std::lock_guard lock(event->mutex);
  event->last = std::move(marker);
}

bool HostBackend::do_event_query(Event e) {
  auto marker = event_of("event_query", e)->current();
  return marker == nullptr || marker->done();
}

void HostBackend::do_event_synchronize(Event e) {
  auto marker = event_of("event_synchronize", e)->current();
  if (marker) marker->wait();
}

void HostBackend::do_stream_wait_event(Stream s, Event e) {
  // The marker is captured now: a later re-record of `e` must not change what this wait
  // waits for (CUDA semantics).
  auto marker = event_of("stream_wait_event", e)->current();
  auto stream = stream_of("stream_wait_event", s);
  if (marker == nullptr || marker->done()) return;  // nothing to wait for
  stream->enqueue_wait(std::move(marker));
}

float HostBackend::do_event_elapsed_ms(Event start, Event end) {
  auto first = event_of("event_elapsed_ms", start)->current();
  auto last = event_of("event_elapsed_ms", end)->current();
  if (!first || !last) fail("event_elapsed_ms", "both events must have been recorded");
  if (!first->done() || !last->done())
    fail("event_elapsed_ms", "both events must have completed (query or synchronize first)");
  const std::chrono::duration<float, std::milli> elapsed =
      last->completed_at() - first->completed_at();
  return elapsed.count();
}

// --- copies ---------------------------------------------------------------------------

void HostBackend::do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                                Stream s) {
  auto stream = stream_of("copy_async", s);
  if (consume_fault(FaultPoint::copy))
    fail("copy_async", "injected fault: copy of " + std::to_string(bytes) + " bytes failed",
         injected_fault_code(FaultPoint::copy));
  stream->enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

void HostBackend::do_memset_async(void* dst, int value, std::size_t bytes, Stream s) {
  stream_of("memset_async", s)->enqueue([dst, value, bytes] { std::memset(dst, value, bytes); });
}

void HostBackend::do_launch_host_func(Stream s, void (*fn)(void*), void* arg) {
  stream_of("launch_host_func", s)->enqueue([fn, arg] { fn(arg); });
}

// --- pinned host memory ---------------------------------------------------------------
// Registration is recorded, not enforced with mlock: mlock would fault in every page of
// what tiering registers (GiBs of slabs in a test) and fails under a low RLIMIT_MEMLOCK.
// What matters to the layers above is the bookkeeping: double or overlapping
// registration and unregistering what was never registered are errors, as on CUDA.

void HostBackend::do_host_register(void* ptr, std::size_t bytes) {
  if (consume_fault(FaultPoint::host_register))
    fail("host_register",
         "injected fault: registering " + std::to_string(bytes) + " bytes at " + hex(ptr) +
             " failed",
         injected_fault_code(FaultPoint::host_register));
  const auto start = reinterpret_cast<std::uintptr_t>(ptr);
  if (bytes > UINTPTR_MAX - start) fail("host_register", "range wraps around the address space");
  std::lock_guard lock(pinned_mutex_);
  auto next = registered_.lower_bound(start);
  const bool overlaps_next = next != registered_.end() && next->first < start + bytes;
  const bool overlaps_prev =
      next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > start;
  if (overlaps_next || overlaps_prev)
    fail("host_register", "range " + hex(ptr) + " + " + std::to_string(bytes) +
                              " overlaps a range that is already registered");
  registered_.emplace(start, bytes);
}

void HostBackend::do_host_unregister(void* ptr) {
  std::lock_guard lock(pinned_mutex_);
  if (registered_.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0)
    fail("host_unregister", hex(ptr) + " is not the start of a registered range");
}

// --- virtual address ranges -----------------------------------------------------------

void* HostBackend::do_reserve_address(std::size_t bytes) {
  if (bytes > SIZE_MAX - kGranularity) fail("reserve_address", "size too large");
  // mmap only promises page alignment: over-reserve by one granule and trim both ends.
  const std::size_t padded = bytes + kGranularity;
  void* raw = ::mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
  if (raw == MAP_FAILED)
    fail("reserve_address", "mmap of " + std::to_string(padded) + " bytes failed: " +
                                errno_text(errno));
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (base + kGranularity - 1) / kGranularity * kGranularity;
  if (start > base) ::munmap(raw, start - base);
  const std::size_t tail = base + padded - (start + bytes);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(start + bytes), tail);
  std::lock_guard lock(vm_mutex_);
  reservations_.emplace(start, bytes);
  return reinterpret_cast<void*>(start);
}

void HostBackend::do_release_address(void* va, std::size_t bytes) {
  const auto start = reinterpret_cast<std::uintptr_t>(va);
  std::lock_guard lock(vm_mutex_);
  auto it = reservations_.find(start);
  if (it == reservations_.end() || it->second != bytes)
    fail("release_address", hex(va) + " + " + std::to_string(bytes) +
                                " is not a range returned by reserve_address");
  auto mapped = mappings_.lower_bound(start);
  if (mapped != mappings_.end() && mapped->first < start + bytes)
    fail("release_address", "range " + hex(va) + " still has mapped memory; unmap it first");
  if (::munmap(va, bytes) != 0)
    fail("release_address", "munmap failed: " + errno_text(errno));
  reservations_.erase(it);
}

PhysicalHandle HostBackend::do_create_physical(std::size_t bytes, MemoryLocation where) {
  if (consume_fault(FaultPoint::create_physical)) return PhysicalHandle{};
  const bool on_device = where == MemoryLocation::device;
  if (on_device && !take_capacity(bytes)) return PhysicalHandle{};
  const int fd = ::memfd_create("tidepool-physical", MFD_CLOEXEC);
  const int err = errno;
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int reason = fd < 0 ? err : errno;
    if (fd >= 0) ::close(fd);
    if (on_device) return_capacity(bytes);
    fail("create_physical", "memfd of " + std::to_string(bytes) + " bytes failed: " +
                                errno_text(reason));
  }
  std::lock_guard lock(vm_mutex_);
  const std::uint64_t handle = next_physical_++;
  try {
    physicals_.emplace(handle, PhysicalMemory{fd, bytes, where});
  } catch (...) {  // std::bad_alloc: no record, so nothing could ever release it
    ::close(fd);
    if (on_device) return_capacity(bytes);
    throw;
  }
  return PhysicalHandle{handle};
}

void HostBackend::do_release_physical(PhysicalHandle h, std::size_t bytes) {
  PhysicalMemory phys;
  {
    std::lock_guard lock(vm_mutex_);
    auto it = physicals_.find(h.value);
    if (it == physicals_.end())
      fail("release_physical", "unknown physical handle " + std::to_string(h.value) +
                                   " (already released?)");
    if (it->second.bytes != bytes)
      fail("release_physical", "handle " + std::to_string(h.value) + " holds " +
                                   std::to_string(it->second.bytes) + " bytes, not " +
                                   std::to_string(bytes));
    phys = it->second;
    physicals_.erase(it);
  }
  // A mapping still using it keeps the memfd's pages alive (as cuMemRelease defers the
  // free until the last unmap); the capacity is returned now, as the handle is gone.
  ::close(phys.fd);
  if (phys.where == MemoryLocation::device) return_capacity(phys.bytes);
}

void HostBackend::do_map(void* va, std::size_t bytes, PhysicalHandle h) {
  if (consume_fault(FaultPoint::map))
    fail("map",
         "injected fault: mapping " + std::to_string(bytes) + " bytes at " + hex(va) + " failed",
         injected_fault_code(FaultPoint::map));
  const auto start = reinterpret_cast<std::uintptr_t>(va);
  std::lock_guard lock(vm_mutex_);
  auto phys = physicals_.find(h.value);
  if (phys == physicals_.end())
    fail("map", "unknown physical handle " + std::to_string(h.value) + " (released?)");
  if (bytes > phys->second.bytes)
    fail("map", "cannot map " + std::to_string(bytes) + " bytes of a physical handle holding " +
                    std::to_string(phys->second.bytes));
  auto res = reservations_.upper_bound(start);
  if (res == reservations_.begin() ||
      std::prev(res)->first + std::prev(res)->second < start + bytes)
    fail("map", "range " + hex(va) + " + " + std::to_string(bytes) +
                    " is not inside one range returned by reserve_address");
  auto next = mappings_.lower_bound(start);
  const bool overlaps_next = next != mappings_.end() && next->first < start + bytes;
  const bool overlaps_prev =
      next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > start;
  if (overlaps_next || overlaps_prev)
    fail("map", "range " + hex(va) + " + " + std::to_string(bytes) + " is already mapped");
  void* got = ::mmap(va, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                     phys->second.fd, 0);
  if (got == MAP_FAILED) fail("map", "mmap failed: " + errno_text(errno));
  try {
    mappings_.emplace(start, Mapping{bytes, h.value});
  } catch (...) {
    // std::bad_alloc: a mapping with no record could never be unmapped, and would keep
    // the handle's pages: back to the reservation's inaccessible pages, as unmap leaves it.
    ::mmap(va, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    throw;
  }
}

void HostBackend::do_unmap(void* va, std::size_t bytes) {
  const auto start = reinterpret_cast<std::uintptr_t>(va);
  const std::uintptr_t end = start + bytes;
  std::lock_guard lock(vm_mutex_);
  // The range must consist of whole mappings (as with cuMemUnmap) and hold at least one.
  auto first = mappings_.lower_bound(start);
  if (first != mappings_.begin() &&
      std::prev(first)->first + std::prev(first)->second.bytes > start)
    fail("unmap", "range " + hex(va) + " starts inside a mapping; unmap whole mappings");
  auto last = first;
  while (last != mappings_.end() && last->first < end) {
    if (last->first + last->second.bytes > end)
      fail("unmap", "range " + hex(va) + " + " + std::to_string(bytes) +
                        " ends inside a mapping; unmap whole mappings");
    ++last;
  }
  if (first == last)
    fail("unmap", "nothing is mapped in " + hex(va) + " + " + std::to_string(bytes));
  // MAP_FIXED replaces the mapping atomically: the address range stays reserved.
  void* got = ::mmap(va, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                     -1, 0);
  if (got == MAP_FAILED) fail("unmap", "mmap(PROT_NONE) failed: " + errno_text(errno));
  mappings_.erase(first, last);
}

// --- peer access ------------------------------------------------------------------------

void HostBackend::do_grant_peer_access(void* va, std::size_t bytes, const std::vector<int>& peers) {
  if (consume_fault(FaultPoint::peer_access))
    fail("grant_peer_access", "injected fault: granting peer access to " + hex(va) + " failed",
         injected_fault_code(FaultPoint::peer_access));
  std::lock_guard lock(vm_mutex_);
  auto it = mappings_.find(reinterpret_cast<std::uintptr_t>(va));
  if (it == mappings_.end() || it->second.bytes != bytes)
    fail("grant_peer_access", hex(va) + " + " + std::to_string(bytes) + " is not a mapping");
  for (const int peer : peers) it->second.peer_mask |= std::uint64_t{1} << peer;
}

bool HostBackend::do_peer_has_access(const void* addr, int peer) {
  const auto at = reinterpret_cast<std::uintptr_t>(addr);
  std::lock_guard lock(vm_mutex_);
  auto it = mappings_.upper_bound(at);
  if (it == mappings_.begin() || std::prev(it)->first + std::prev(it)->second.bytes <= at)
    fail("peer_has_access", hex(addr) + " is not in a mapped range");
  return peer == device() || (std::prev(it)->second.peer_mask >> peer & 1U) != 0;
}

}  // namespace

std::unique_ptr<Backend> make_host_backend(int device, HostBackendOptions options) {
  return std::make_unique<HostBackend>(device, options);
}

}  // namespace tidepool
