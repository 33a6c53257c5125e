// The backend seam: the few device primitives everything above is built on.
//
// tidepool never calls CUDA outside the backend files. The allocator and the tiering
// layer talk to one `Backend` with two real implementations:
//   - cuda (backends/cuda_backend.cpp): the CUDA runtime and driver API, every return
//     code checked;
//   - host (backends/host_backend.cpp): plain host memory with a capacity limit, streams
//     that are FIFOs run in order on their own worker thread, events that complete when
//     their stream passes them, copies that copy, and VA mapping through
//     memfd_create + mmap(MAP_FIXED).
// So every allocator and tiering test runs in CI on a machine with no GPU, on the same
// code paths the GPU uses.
//
// Like RMM's resources and mimalloc's prim.h, the public methods are non-virtual: they
// check preconditions once, then call a private `do_*` hook. Pre/postconditions are
// written beside each method and hold for both implementations.
//
// Note [Stream semantics]
// Device memory handed out by `device_alloc` is not bound to a stream; the allocator on
// top makes it stream-ordered. Work enqueued on one stream runs in enqueue order. Work on
// two streams is unordered unless an event orders it (`record_event` on the producer,
// `stream_wait_event` on the consumer). `copy_async` returns before the copy is done;
// the bytes are readable at the destination once the stream has passed the copy
// (`stream_synchronize`, or an event recorded after it). The null stream handle is the
// backend's default stream, ordered like any other stream (no legacy implicit sync).
//
// Note [Peer access to mapped ranges]
// A range mapped with map() is accessible from the backend's own device only: on cuda
// cuMemSetAccess names who may touch a cuMemMap'd range, and cudaDeviceEnablePeerAccess
// (which PyTorch calls before cross-device work) covers cudaMalloc memory, not these
// ranges. Without more, a kernel on device B reading device A's expandable segment or
// pointer-stable range faults. enable_peer_access(B) on A's backend is the missing grant
// (PyTorch's allocator does the same in addPeerAccess). The shared half (backend.cpp)
// keeps the peer set and the list of live mappings under one mutex, so one piece of code
// decides who gets access; the implementations only grant one range (do_grant_peer_access):
//   - map() records the range and grants it the current peers; enable_peer_access adds
//     the peer and grants it every recorded range. Both do that under the mutex, so a
//     map racing an enable is granted by one of them (perhaps both: granting is
//     idempotent). A migration maps new backing through map(), so peers keep access;
//   - unmap() forgets its ranges before unmapping, so an enable never grants a range
//     being unmapped (they are recorded again if the unmap fails);
//   - a grant that fails in map() unmaps the range again (map failed, as a whole); one
//     that fails in enable_peer_access leaves the peer unrecorded (ranges granted before
//     the failure keep the access the caller asked for; calling again retries all);
//   - device_alloc memory is cudaMalloc memory: cudaDeviceEnablePeerAccess covers it.
// Lock order: the peer mutex is taken before any lock of an implementation.
//
// Thread-safety: every method may be called from any thread concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/export.h"

namespace tidepool {

// Device indices tidepool serves: 0..kMaxDevices-1 (the host backend emulates that many
// devices; on cuda it is also capped by the devices present).
inline constexpr int kMaxDevices = 16;

// Opaque handles. On the cuda backend `Stream::handle` is a cudaStream_t and
// `Event::handle` a cudaEvent_t; on the host backend they point at the backend's own
// objects. A null Stream is the default stream.
struct Stream {
  void* handle = nullptr;
  friend bool operator==(Stream a, Stream b) { return a.handle == b.handle; }
};
struct Event {
  void* handle = nullptr;
  explicit operator bool() const { return handle != nullptr; }
};

// Physical backing for a VA range (see map/unmap). On cuda a CUmemGenericAllocationHandle.
struct PhysicalHandle {
  std::uint64_t value = 0;
  explicit operator bool() const { return value != 0; }
};

enum class MemoryLocation : std::uint8_t { device, host };

enum class CopyKind : std::uint8_t {
  host_to_device,
  device_to_host,
  device_to_device,
  host_to_host,
};

enum class BackendKind : std::uint8_t { host, cuda };

struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// Thrown for failures other than running out of memory: a copy that failed, an invalid
// handle, a driver error. The message names the operation and the backend's error text;
// cuda_error() the CUDA error code behind it (a cudaError_t or CUresult value, which agree
// for the errors a call can meet after a kernel faulted: 700 an illegal address, 719 a
// launch failure, ...), 0 when none: the LD_PRELOAD shim answers the program with it.
class TIDEPOOL_API BackendError : public std::runtime_error {
 public:
  explicit BackendError(const std::string& what, int cuda_error = 0)
      : std::runtime_error(what), cuda_error_(cuda_error) {}
  explicit BackendError(const char* what, int cuda_error = 0)
      : std::runtime_error(what), cuda_error_(cuda_error) {}
  int cuda_error() const noexcept { return cuda_error_; }

 private:
  int cuda_error_ = 0;
};

// Fault injection for the reliability tests: the host backend consults it before each
// operation of the named kind; the cuda backend ignores it.
enum class FaultPoint : std::uint8_t {
  device_alloc,
  copy,
  host_register,
  map,
  create_physical,
  peer_access,  // granting a peer access to a mapped range
  count_  // number of points, not a point
};

class TIDEPOOL_API Backend {
 public:
  virtual ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  BackendKind kind() const { return kind_; }
  int device() const { return device_; }
  const char* name() const { return kind_ == BackendKind::cuda ? "cuda" : "host"; }

  // --- device memory ----------------------------------------------------------------
  // Pre: bytes > 0. Post: a pointer aligned to at least 256 bytes to `bytes` of device
  // memory, or nullptr when the device is out of memory (never throws for that).
  // Throws BackendError for any other failure.
  void* device_alloc(std::size_t bytes);
  // Pre: ptr came from device_alloc(bytes) of this backend and no stream still uses it.
  void device_free(void* ptr, std::size_t bytes);
  MemInfo mem_info();

  // --- device memory limit (torch.cuda.set_per_process_memory_fraction) -------------
  // At most `bytes` of device memory through this backend at a time: device_alloc and
  // device-located create_physical count against it, by everyone using this backend (the
  // caching allocator and the tiering layer's pointer-stable ranges alike). Over it they
  // answer out-of-memory, as the device would, so callers' OOM handling runs (the
  // allocator's: free cache, reclaim hooks, retry, a clear error). SIZE_MAX: no limit
  // (the default). A limit below what is in use frees nothing; allocations fail until
  // enough is given back.
  void set_device_limit(std::size_t bytes);
  std::size_t device_limit() const;
  // Device bytes allocated through this backend and not given back yet.
  std::size_t device_bytes_in_use() const;

  // --- streams and events -----------------------------------------------------------
  Stream create_stream();
  // Pre: no work pending on `s` that anyone waits for. Drains the stream first.
  void destroy_stream(Stream s);
  // Post: all work enqueued on `s` before the call has finished.
  void stream_synchronize(Stream s);
  // Post: every stream of this backend is idle.
  void device_synchronize();

  Event create_event();
  void destroy_event(Event e);
  // Post: `e` completes when `s` has finished everything enqueued before this call.
  // Re-recording an event replaces its previous completion point.
  void record_event(Event e, Stream s);
  // True once the point last recorded has passed (true for a never-recorded event).
  bool event_query(Event e);
  void event_synchronize(Event e);
  // Post: work enqueued on `s` after this call starts only after `e` has completed.
  void stream_wait_event(Stream s, Event e);
  // Milliseconds between two completed events (both recorded, both done).
  float event_elapsed_ms(Event start, Event end);

  // --- copies -------------------------------------------------------------------------
  // Pre: both ranges are valid for `bytes` and do not overlap. Enqueued on `s`.
  // Zero bytes is a no-op; null pointers or overlapping ranges are a BackendError.
  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream s);
  // Enqueues a byte fill on `s` (used by tests and by zero-initialised state).
  void memset_async(void* dst, int value, std::size_t bytes, Stream s);
  // Enqueues a host function on `s`; it runs after everything enqueued before it.
  // The callback must not call back into the backend for stream work. On the host
  // backend an exception it throws is rethrown by the next synchronize of that stream.
  void launch_host_func(Stream s, void (*fn)(void*), void* arg);

  // --- pinned host memory -----------------------------------------------------------
  // Page-locks [ptr, ptr+bytes) so copies from and to it are truly asynchronous.
  // Pre: page-aligned, not already registered. Throws BackendError on failure.
  void host_register(void* ptr, std::size_t bytes);
  void host_unregister(void* ptr);

  // --- virtual address ranges (pointer-stable migration, expandable segments) -------
  // Granularity of physical allocations and mappings (2 MiB on both backends).
  std::size_t granularity() const { return granularity_; }
  // Reserves `bytes` (a multiple of granularity()) of address space, no backing.
  void* reserve_address(std::size_t bytes);
  // Pre: exactly a range reserve_address returned, with nothing mapped in it any more.
  void release_address(void* va, std::size_t bytes);
  // Creates `bytes` (multiple of granularity) of physical memory in `where`. Device
  // backing counts against the device's capacity. Returns a null handle when out of
  // memory; throws BackendError on other failures.
  PhysicalHandle create_physical(std::size_t bytes, MemoryLocation where);
  // `bytes` as created. A mapping may outlive the handle (its memory stays until unmap,
  // as with cuMemRelease); device capacity is returned at once.
  void release_physical(PhysicalHandle h, std::size_t bytes);
  // Maps `h` at `va` (inside a reserved range, granularity-aligned) and makes it
  // readable and writable from the device and, for host backing, from the host.
  // Maps the first `bytes` of `h` (bytes <= its size); the range must not be mapped yet.
  void map(void* va, std::size_t bytes, PhysicalHandle h);
  // Pre: no stream still uses the range; it consists of whole mappings (one or more, as
  // with cuMemUnmap). The physical handle stays valid; the range stays reserved.
  void unmap(void* va, std::size_t bytes);

  // --- peer access to mapped ranges (Note [Peer access to mapped ranges]) -------------
  // Device `peer` gets read/write access to every range this backend has mapped (device
  // and host backing alike) and to every range it maps from now on, including the new
  // backing a migration maps at the same address. Idempotent. A bad peer (negative, this
  // backend's own device, one that does not exist, or one that cannot reach this device:
  // check_peer_access) is a BackendError and changes nothing.
  void enable_peer_access(int peer);
  // The peers enabled so far, ascending.
  std::vector<int> peers() const;
  // Whether device `peer` may read and write the mapped memory at `addr` (this backend's
  // own device always may). Pre: `addr` lies in a range mapped through map(); otherwise a
  // BackendError. For tests and diagnostics: it asks the driver on cuda.
  bool peer_has_access(const void* addr, int peer);

  // --- fault injection (host backend only) ------------------------------------------
  // The next `count` operations at `point` fail as the device would (out-of-memory for
  // allocations, BackendError otherwise). Ignored by the cuda backend.
  // A fault that throws (copy, host_register, map, peer_access) carries `cuda_error` as
  // its BackendError::cuda_error(), as a CUDA call's failure would.
  void inject_fault(FaultPoint point, int count = 1, int cuda_error = 0);

 protected:
  // Defined in backend.cpp: it also creates the fault-injection state.
  Backend(BackendKind kind, int device, std::size_t granularity);

  // Returns true (and consumes one) if a fault was injected at `point`.
  bool consume_fault(FaultPoint point);
  // The code inject_fault gave `point`'s faults (0 when none).
  int injected_fault_code(FaultPoint point) const;

 private:
  virtual void* do_device_alloc(std::size_t bytes) = 0;
  virtual void do_device_free(void* ptr, std::size_t bytes) = 0;
  virtual MemInfo do_mem_info() = 0;
  virtual Stream do_create_stream() = 0;
  virtual void do_destroy_stream(Stream s) = 0;
  virtual void do_stream_synchronize(Stream s) = 0;
  virtual void do_device_synchronize() = 0;
  virtual Event do_create_event() = 0;
  virtual void do_destroy_event(Event e) = 0;
  virtual void do_record_event(Event e, Stream s) = 0;
  virtual bool do_event_query(Event e) = 0;
  virtual void do_event_synchronize(Event e) = 0;
  virtual void do_stream_wait_event(Stream s, Event e) = 0;
  virtual float do_event_elapsed_ms(Event start, Event end) = 0;
  virtual void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                             Stream s) = 0;
  virtual void do_memset_async(void* dst, int value, std::size_t bytes, Stream s) = 0;
  virtual void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) = 0;
  virtual void do_host_register(void* ptr, std::size_t bytes) = 0;
  virtual void do_host_unregister(void* ptr) = 0;
  virtual void* do_reserve_address(std::size_t bytes) = 0;
  virtual void do_release_address(void* va, std::size_t bytes) = 0;
  virtual PhysicalHandle do_create_physical(std::size_t bytes, MemoryLocation where) = 0;
  virtual void do_release_physical(PhysicalHandle h, std::size_t bytes) = 0;
  virtual void do_map(void* va, std::size_t bytes, PhysicalHandle h) = 0;
  virtual void do_unmap(void* va, std::size_t bytes) = 0;
  // Grants each of `peers` (validated, never this device) access to [va, va+bytes),
  // which is exactly one range passed to a successful do_map and not unmapped since.
  virtual void do_grant_peer_access(void* va, std::size_t bytes, const std::vector<int>& peers) = 0;
  virtual bool do_peer_has_access(const void* addr, int peer) = 0;

  // Claims `bytes` against the device limit; false (nothing claimed) when over it.
  bool claim_device_bytes(std::size_t bytes);
  void unclaim_device_bytes(std::size_t bytes);

  BackendKind kind_;
  int device_;
  std::size_t granularity_;
  struct FaultState;
  std::shared_ptr<FaultState> faults_;
  struct DeviceLimit;
  std::unique_ptr<DeviceLimit> limit_;
  struct PeerState;
  std::unique_ptr<PeerState> peers_;
};

struct HostBackendOptions {
  // Device capacity emulated by the host backend (device_alloc + device physical).
  std::size_t capacity_bytes = std::size_t{8} << 30;
};

// Factories. `make_host_backend` always works; `make_cuda_backend` throws BackendError
// when tidepool was built without CUDA or the device does not exist.
TIDEPOOL_API std::unique_ptr<Backend> make_host_backend(int device = 0,
                                                        HostBackendOptions options = {});
TIDEPOOL_API std::unique_ptr<Backend> make_cuda_backend(int device);
// Number of CUDA devices usable now (0 without CUDA, a driver, or a GPU).
TIDEPOOL_API int cuda_device_count();
TIDEPOOL_API bool built_with_cuda();
// cuDeviceCanAccessPeer: whether device `peer` can access device `device`'s memory
// directly (false without CUDA or for devices that do not exist). Creates no context.
TIDEPOOL_API bool cuda_can_access_peer(int device, int peer);
// Throws BackendError unless device `peer` can be given access to device `device`'s
// memory on a backend of `kind`: both in 0..kMaxDevices-1 (cuda: devices present),
// different, and (cuda) cuDeviceCanAccessPeer says yes. Creates no backend, and on cuda
// no context: the registry validates with it for devices not in use yet.
TIDEPOOL_API void check_peer_access(BackendKind kind, int device, int peer);

}  // namespace tidepool
