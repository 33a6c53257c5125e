// The cuda backend: the backend seam on the CUDA runtime API (memory, streams, events,
// copies, pinned host memory) and the driver's virtual memory management API (address
// reservations, physical allocations on the device or on a host NUMA node, mappings).
//
// Rules every method follows:
//   - each call first makes this backend's device current (DeviceGuard) and restores the
//     caller's device afterwards, so a backend for device 1 can be used from a thread
//     whose current device is 0, and PyTorch's notion of the current device is untouched;
//   - every return code is checked; a failure is a BackendError naming the call, the
//     device and the CUDA error text, and the runtime's (non-sticky) last error is cleared
//     so it does not surface later in somebody else's check;
//   - running out of memory is not an error: device_alloc returns nullptr and
//     create_physical a null handle, as backend.h promises;
//   - fault injection is ignored (backend.h): faults are only emulated by the host backend.
//
// The driver API is not linked: its entry points are fetched at run time through
// cudaGetDriverEntryPointByVersion (as PyTorch does). libtidepool then has no NEEDED
// libcuda.so.1, so it loads, and the host backend works, on a machine with the toolkit
// but no driver (CI), and it always uses the driver the CUDA runtime itself uses.
//
// Note [libtidepool's own calls under the shim]
// The LD_PRELOAD shim (preload/) interposes cudaMalloc, cudaFree, cudaStreamDestroy and
// cudaGetLastError in the whole process, libtidepool included. The calls libtidepool makes
// while the shim serves a program's call are marked by the shim's re-entrancy guard; but
// libtidepool is also entered directly (its C ABI, tidepool.optim, a tiered store), and
// then its cudaFree went into the shim, which asked libtidepool whether it holds that
// pointer, under the allocator lock the same thread held: a deadlock. (Its cudaMalloc was
// served by tidepool itself, under that lock; its cudaGetLastError took the program's held
// error.) So this backend makes those calls in the runtime itself: the functions are looked
// up in libcudart by handle, which interposition does not reach, and are the plain symbols
// only where that lookup fails (no shim can be in the way of a runtime it cannot find).
//
// Streams are created non-blocking, so the null stream (the legacy default stream) does
// not implicitly synchronise with them and behaves like any other stream, as the seam's
// Note [Stream semantics] requires.
//
// Note [Copies across host-NUMA mappings]
// A pointer-stable range is one reservation backed by several physical allocations (its
// chunks), some on the device and some host-NUMA memory, which the driver's pointer query
// types as host memory (CU_MEMORYTYPE_HOST, as open-mpi/ompi#12751 found). The H200 run of
// 2026-12-04 verified copies within one host-NUMA allocation and copies across device
// allocations; the one test whose copies ran from one host-NUMA allocation into the next,
// and across a device and a host-NUMA allocation
// (VmmMigrationTest.BudgetCanSplitARangeBetweenDeviceAndHost), died of a segmentation
// fault with nothing else to go on. A driver that takes a host-typed copy's pages from
// the allocation at its start would read past that allocation's end, which fits; it is
// not known. So this backend remembers its host-NUMA mappings and cuts a copy at their
// edges (copy_split.h): each cudaMemcpyAsync lies within one host-NUMA allocation or
// outside all of them, the kinds of copy the run verified. Copies that touch no host-NUMA
// mapping (the allocator's memory, device-backed chunks) cost one relaxed atomic load.
// tests/allocator/gpu_test_backend.cpp (CudaSpanningCopy) and the VmmSpanningCopyTest
// suite make each kind of spanning copy in a test of its own, to say which one failed.
// Those pieces go as cudaMemcpyDefault, the kind the driver infers from the pointers
// (every address is unified on the 64-bit platforms CUDA 13 supports): the caller's kind
// says device for both sides of a pointer-stable range's chunk copy, and host-NUMA memory
// is host memory to the driver, and a kind that contradicts the pointers is undefined
// behaviour (review finding; whether it is what failed on 2026-12-04 is not known).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "allocator/backend.h"
#include "allocator/backends/copy_split.h"

namespace tidepool {
namespace {

constexpr std::size_t kMinGranularity = std::size_t{2} << 20;  // the seam promises 2 MiB

// The driver functions this backend calls, resolved once.
#define TIDEPOOL_DRIVER_FUNCTIONS(X)                                                     \
  X(cuDeviceGet) X(cuDeviceGetAttribute) X(cuGetErrorName) X(cuGetErrorString)           \
  X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree)             \
  X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)              \
  X(cuMemGetAllocationPropertiesFromHandle) X(cuMemGetAccess) X(cuDeviceCanAccessPeer)       \
  X(cuCtxGetCurrent)

struct DriverApi {
#define TIDEPOOL_DECLARE(name) decltype(&::name) name = nullptr;
  TIDEPOOL_DRIVER_FUNCTIONS(TIDEPOOL_DECLARE)
#undef TIDEPOOL_DECLARE
};

// The ABI version of the entry points requested: CUDA 12.0, which has every function
// above with the signature cuda.h declares.
constexpr unsigned kDriverAbiVersion = 12000;

// Note [libtidepool's own calls under the shim].
struct OwnRuntimeCalls {
  cudaError_t (*malloc)(void**, size_t) = &cudaMalloc;
  cudaError_t (*free)(void*) = &cudaFree;
  cudaError_t (*stream_destroy)(cudaStream_t) = &cudaStreamDestroy;
  cudaError_t (*get_last_error)() = &cudaGetLastError;
};

const OwnRuntimeCalls& runtime() {
  static const OwnRuntimeCalls calls = [] {
    OwnRuntimeCalls c;
    // cudaGetErrorString is not interposed: its address is in the runtime libtidepool uses.
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&cudaGetErrorString), &info) == 0 ||
        info.dli_fname == nullptr) {
      return c;
    }
    void* cudart = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);  // kept: never closed
    if (cudart == nullptr) return c;
    const auto bind = [cudart](const char* name, auto& fn) {
      if (void* f = dlsym(cudart, name)) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(f);
      }
    };
    bind("cudaMalloc", c.malloc);
    bind("cudaFree", c.free);
    bind("cudaStreamDestroy", c.stream_destroy);
    bind("cudaGetLastError", c.get_last_error);
    return c;
  }();
  return calls;
}

const DriverApi& driver() {
  // A throw leaves the static uninitialised, so a later call tries again.
  static const DriverApi api = [] {
    DriverApi loaded;
    auto load = [](const char* symbol, void** fn) {
      cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t err = cudaGetDriverEntryPointByVersion(
          symbol, fn, kDriverAbiVersion, cudaEnableDefault, &status);
      if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || *fn == nullptr) {
        (void)runtime().get_last_error();
        throw BackendError(std::string("tidepool cuda backend: cannot load the driver function ") +
                           symbol + " (" + cudaGetErrorString(err) +
                           "); is the NVIDIA driver too old or missing?");
      }
    };
#define TIDEPOOL_LOAD(name) load(#name, reinterpret_cast<void**>(&loaded.name));
    TIDEPOOL_DRIVER_FUNCTIONS(TIDEPOOL_LOAD)
#undef TIDEPOOL_LOAD
    return loaded;
  }();
  return api;
}

std::string error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

std::string error_text(CUresult res) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver().cuGetErrorName(res, &name) != CUDA_SUCCESS || name == nullptr)
    name = "CUDA_ERROR_?";
  if (driver().cuGetErrorString(res, &text) != CUDA_SUCCESS || text == nullptr)
    text = "unknown error";
  return std::string(name) + " (" + std::to_string(static_cast<int>(res)) + "): " + text;
}

// `code`: the CUDA error code, kept in the BackendError for the LD_PRELOAD shim's answer.
[[noreturn]] void fail_call(int device, const char* call, const std::string& text,
                            int code = 0) {
  throw BackendError("tidepool cuda backend (device " + std::to_string(device) + "): " + call +
                         " failed: " + text,
                     code);
}

void check(int device, cudaError_t err, const char* call) {
  if (err == cudaSuccess) return;
  (void)runtime().get_last_error();  // clear the non-sticky last error; we report it ourselves
  fail_call(device, call, error_text(err), static_cast<int>(err));
}

void check(int device, CUresult res, const char* call) {
  if (res != CUDA_SUCCESS) fail_call(device, call, error_text(res), static_cast<int>(res));
}

enum class ApiLevel { runtime, driver };

// Makes `device` current for the guard's lifetime and restores the previous device.
// For runtime calls the device is only switched when it differs (the runtime makes its
// primary context current by itself; event_query is on the allocator's hot path). Before
// driver (cuMem*) calls cudaSetDevice is called even when the device is already current:
// it also makes the primary context current on this thread, which the driver needs.
// A thread with no context current (one that never chose a device: cudaGetDevice says 0,
// e.g. the VMM moves' helper threads) is not "restored" to device 0: since CUDA 12
// cudaSetDevice creates that device's primary context, hundreds of MB on a GPU the
// process may never use (one rank per GPU without CUDA_VISIBLE_DEVICES). The thread keeps
// `device` current instead, as PyTorch's MaybeSetDevice does.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device, ApiLevel level = ApiLevel::runtime) : device_(device) {
    check(device, cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      CUcontext current = nullptr;
      restore_ = driver().cuCtxGetCurrent(&current) == CUDA_SUCCESS && current != nullptr;
    }
    if (previous_ != device || level == ApiLevel::driver)
      check(device, cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    // Best effort in a destructor; a failure must not stay behind as the program's last
    // error.
    if (restore_ && cudaSetDevice(previous_) != cudaSuccess) (void)runtime().get_last_error();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
  bool restore_ = false;
};

cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }
cudaEvent_t to_cuda(Event e) { return static_cast<cudaEvent_t>(e.handle); }
CUdeviceptr to_cu(void* p) { return reinterpret_cast<CUdeviceptr>(p); }

cudaMemcpyKind to_cuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::host_to_device: return cudaMemcpyHostToDevice;
    case CopyKind::device_to_host: return cudaMemcpyDeviceToHost;
    case CopyKind::device_to_device: return cudaMemcpyDeviceToDevice;
    case CopyKind::host_to_host: return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;  // unreachable: Backend::copy_async rejects unknown kinds
}

// The allocation properties of physical memory in `where` for `device`.
CUmemAllocationProp physical_props(int device, MemoryLocation where, int host_numa_id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  if (where == MemoryLocation::device) {
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
  } else {
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = host_numa_id;
  }
  return prop;
}

// The host NUMA node closest to the device (0 where the system has no NUMA).
int host_numa_node(int device) {
  CUdevice dev = 0;
  check(device, driver().cuDeviceGet(&dev, device), "cuDeviceGet");
  int node = -1;
  if (driver().cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) != CUDA_SUCCESS)
    node = -1;
  return node < 0 ? 0 : node;
}

bool supports_host_numa_vmm(int device) {
  CUdevice dev = 0;
  check(device, driver().cuDeviceGet(&dev, device), "cuDeviceGet");
  int supported = 0;
  if (driver().cuDeviceGetAttribute(&supported,
                           CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                           dev) != CUDA_SUCCESS)
    return false;
  return supported != 0;
}

// The largest minimum granularity of device and host-NUMA physical memory (both powers
// of two, so the largest is a multiple of the others), and never below 2 MiB.
std::size_t query_granularity(int device) {
  DeviceGuard guard(device, ApiLevel::driver);
  std::size_t granularity = kMinGranularity;
  const CUmemAllocationProp device_prop = physical_props(device, MemoryLocation::device, 0);
  std::size_t g = 0;
  check(device,
        driver().cuMemGetAllocationGranularity(&g, &device_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity(device)");
  granularity = std::max(granularity, g);
  if (supports_host_numa_vmm(device)) {
    const CUmemAllocationProp host_prop =
        physical_props(device, MemoryLocation::host, host_numa_node(device));
    if (driver().cuMemGetAllocationGranularity(&g, &host_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
        CUDA_SUCCESS)
      granularity = std::max(granularity, g);
  }
  return granularity;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device)
      : Backend(BackendKind::cuda, device, query_granularity(device)),
        host_numa_id_(host_numa_node(device)),
        host_numa_supported_(supports_host_numa_vmm(device)) {}

 private:
  void check(cudaError_t err, const char* call) const { tidepool::check(device(), err, call); }
  void check(CUresult res, const char* call) const { tidepool::check(device(), res, call); }

  // --- device memory ---
  void* do_device_alloc(std::size_t bytes) override {
    DeviceGuard guard(device());
    void* ptr = nullptr;
    const cudaError_t err = runtime().malloc(&ptr, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)runtime().get_last_error();  // out of memory is an answer, not a sticky error
      return nullptr;
    }
    check(err, "cudaMalloc");
    return ptr;
  }
  void do_device_free(void* ptr, std::size_t) override {
    DeviceGuard guard(device());
    check(runtime().free(ptr), "cudaFree");
  }
  MemInfo do_mem_info() override {
    DeviceGuard guard(device());
    MemInfo info;
    check(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
    return info;
  }

  // --- streams and events ---
  Stream do_create_stream() override {
    DeviceGuard guard(device());
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return Stream{s};
  }
  void do_destroy_stream(Stream s) override {
    DeviceGuard guard(device());
    check(cudaStreamSynchronize(to_cuda(s)), "cudaStreamSynchronize");
    check(runtime().stream_destroy(to_cuda(s)), "cudaStreamDestroy");
  }
  void do_stream_synchronize(Stream s) override {
    DeviceGuard guard(device());
    check(cudaStreamSynchronize(to_cuda(s)), "cudaStreamSynchronize");
  }
  void do_device_synchronize() override {
    DeviceGuard guard(device());
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  Event do_create_event() override {
    DeviceGuard guard(device());
    cudaEvent_t e = nullptr;
    // Default flags: timing stays enabled because event_elapsed_ms must work.
    check(cudaEventCreate(&e), "cudaEventCreate");
    return Event{e};
  }
  void do_destroy_event(Event e) override {
    DeviceGuard guard(device());
    check(cudaEventDestroy(to_cuda(e)), "cudaEventDestroy");
  }
  void do_record_event(Event e, Stream s) override {
    DeviceGuard guard(device());
    check(cudaEventRecord(to_cuda(e), to_cuda(s)), "cudaEventRecord");
  }
  bool do_event_query(Event e) override {
    DeviceGuard guard(device());
    const cudaError_t err = cudaEventQuery(to_cuda(e));
    if (err == cudaErrorNotReady) {
      (void)runtime().get_last_error();  // "not ready" is an answer, not an error
      return false;
    }
    check(err, "cudaEventQuery");
    return true;
  }
  void do_event_synchronize(Event e) override {
    DeviceGuard guard(device());
    check(cudaEventSynchronize(to_cuda(e)), "cudaEventSynchronize");
  }
  void do_stream_wait_event(Stream s, Event e) override {
    DeviceGuard guard(device());
    check(cudaStreamWaitEvent(to_cuda(s), to_cuda(e), 0), "cudaStreamWaitEvent");
  }
  float do_event_elapsed_ms(Event start, Event end) override {
    DeviceGuard guard(device());
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, to_cuda(start), to_cuda(end)), "cudaEventElapsedTime");
    return ms;
  }

  // --- copies ---
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                     Stream s) override {
    DeviceGuard guard(device());
    if (host_mapping_count_.load(std::memory_order_relaxed) == 0) {
      check(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), to_cuda(s)), "cudaMemcpyAsync");
      return;
    }
    std::vector<std::size_t> ends;  // Note [Copies across host-NUMA mappings]
    {
      std::lock_guard lock(vm_mutex_);
      ends = backend_detail::copy_piece_ends(host_mappings_, reinterpret_cast<std::uintptr_t>(dst),
                                             reinterpret_cast<std::uintptr_t>(src), bytes);
    }
    std::size_t from = 0;
    for (const std::size_t to : ends) {
      check(cudaMemcpyAsync(static_cast<char*>(dst) + from, static_cast<const char*>(src) + from,
                            to - from, cudaMemcpyDefault, to_cuda(s)),
            "cudaMemcpyAsync");
      from = to;
    }
  }
  void do_memset_async(void* dst, int value, std::size_t bytes, Stream s) override {
    DeviceGuard guard(device());
    check(cudaMemsetAsync(dst, value, bytes, to_cuda(s)), "cudaMemsetAsync");
  }
  void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) override {
    DeviceGuard guard(device());
    check(cudaLaunchHostFunc(to_cuda(s), fn, arg), "cudaLaunchHostFunc");
  }

  // --- pinned host memory ---
  void do_host_register(void* ptr, std::size_t bytes) override {
    DeviceGuard guard(device());
    check(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault), "cudaHostRegister");
  }
  void do_host_unregister(void* ptr) override {
    DeviceGuard guard(device());
    check(cudaHostUnregister(ptr), "cudaHostUnregister");
  }

  // --- virtual address ranges ---
  void* do_reserve_address(std::size_t bytes) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    CUdeviceptr va = 0;
    check(driver().cuMemAddressReserve(&va, bytes, granularity(), 0, 0), "cuMemAddressReserve");
    return reinterpret_cast<void*>(va);
  }
  void do_release_address(void* va, std::size_t bytes) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    check(driver().cuMemAddressFree(to_cu(va), bytes), "cuMemAddressFree");
  }
  PhysicalHandle do_create_physical(std::size_t bytes, MemoryLocation where) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    if (where == MemoryLocation::host && !host_numa_supported_)
      fail_call(device(), "cuMemCreate(host NUMA)",
                "this device or driver does not support host-NUMA physical memory "
                "(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)");
    const CUmemAllocationProp prop = physical_props(device(), where, host_numa_id_);
    CUmemGenericAllocationHandle handle = 0;
    const CUresult res = driver().cuMemCreate(&handle, bytes, &prop, 0);
    if (res == CUDA_ERROR_OUT_OF_MEMORY) return PhysicalHandle{};
    check(res, where == MemoryLocation::device ? "cuMemCreate(device)" : "cuMemCreate(host NUMA)");
    if (where == MemoryLocation::host) {
      try {
        std::lock_guard lock(vm_mutex_);
        host_handles_.insert(static_cast<std::uint64_t>(handle));
      } catch (...) {  // std::bad_alloc: give it back rather than lose track of its kind
        (void)driver().cuMemRelease(handle);
        throw;
      }
    }
    return PhysicalHandle{static_cast<std::uint64_t>(handle)};
  }
  void do_release_physical(PhysicalHandle h, std::size_t) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    // Forgotten before the release, as in Backend::release_physical: a helper thread's
    // cuMemCreate may get the same handle value as soon as it is released.
    bool host = false;
    {
      std::lock_guard lock(vm_mutex_);
      host = host_handles_.erase(h.value) != 0;
    }
    const CUresult res = driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(h.value));
    if (res != CUDA_SUCCESS && host) {
      std::lock_guard lock(vm_mutex_);
      host_handles_.insert(h.value);
    }
    check(res, "cuMemRelease");
  }
  void do_map(void* va, std::size_t bytes, PhysicalHandle h) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    const auto handle = static_cast<CUmemGenericAllocationHandle>(h.value);
    // Every handle comes from do_create_physical, which remembers the host-NUMA ones: no
    // driver query per map.
    bool host_backed = false;
    {
      std::lock_guard lock(vm_mutex_);
      host_backed = host_handles_.contains(h.value);
    }
    check(driver().cuMemMap(to_cu(va), bytes, 0, handle, 0), "cuMemMap");
    // A new mapping has no access at all: grant the device read/write, and the host too
    // when the backing is host memory (the CPU may then touch migrated state directly).
    CUmemAccessDesc access[2]{};
    access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[0].location.id = device();
    access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    std::size_t count = 1;
    if (host_backed) {
      access[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      access[1].location.id = host_numa_id_;  // ignored by the driver for HOST_NUMA
      access[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      count = 2;
    }
    CUresult res = driver().cuMemSetAccess(to_cu(va), bytes, access, count);
    if (res != CUDA_SUCCESS && count == 2) {
      // Host access to host-NUMA backing is optional (not every driver grants it); the
      // device access is what the seam requires. Said once: the driver types this memory
      // as host memory, and a path of its that touches it from the CPU would then fault.
      if (!host_access_refusal_said_.exchange(true)) {
        std::fprintf(stderr,
                     "tidepool cuda backend (device %d): cuMemSetAccess refused host access to "
                     "host-NUMA memory (%s); it stays device-accessible only. Said once.\n",
                     device(), error_text(res).c_str());
      }
      res = driver().cuMemSetAccess(to_cu(va), bytes, access, 1);
    }
    if (res != CUDA_SUCCESS) {
      (void)driver().cuMemUnmap(to_cu(va), bytes);  // leave the range as it was: reserved, unmapped
      check(res, "cuMemSetAccess");
    }
    if (host_backed) {
      try {
        std::lock_guard lock(vm_mutex_);
        host_mappings_[reinterpret_cast<std::uintptr_t>(va)] = bytes;
        host_mapping_count_.store(host_mappings_.size(), std::memory_order_relaxed);
      } catch (...) {  // std::bad_alloc: unmapped again, as a failed map leaves it
        (void)driver().cuMemUnmap(to_cu(va), bytes);
        throw;
      }
    }
  }
  void do_unmap(void* va, std::size_t bytes) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    check(driver().cuMemUnmap(to_cu(va), bytes), "cuMemUnmap");
    const auto start = reinterpret_cast<std::uintptr_t>(va);
    std::lock_guard lock(vm_mutex_);
    host_mappings_.erase(host_mappings_.lower_bound(start),
                         host_mappings_.lower_bound(start + bytes));
    host_mapping_count_.store(host_mappings_.size(), std::memory_order_relaxed);
  }

  // --- peer access (Note [Peer access to mapped ranges] in backend.h) ---
  void do_grant_peer_access(void* va, std::size_t bytes, const std::vector<int>& peers) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    std::vector<CUmemAccessDesc> access(peers.size());
    for (std::size_t i = 0; i < peers.size(); ++i) {
      access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access[i].location.id = peers[i];
      access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    check(driver().cuMemSetAccess(to_cu(va), bytes, access.data(), access.size()),
          "cuMemSetAccess(peers)");
  }
  bool do_peer_has_access(const void* addr, int peer) override {
    DeviceGuard guard(device(), ApiLevel::driver);
    CUmemLocation location{};
    location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = peer;
    unsigned long long flags = 0;
    check(driver().cuMemGetAccess(&flags, &location, reinterpret_cast<CUdeviceptr>(addr)),
          "cuMemGetAccess");
    return flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  const int host_numa_id_;
  const bool host_numa_supported_;
  // Note [Copies across host-NUMA mappings]: the host-NUMA handles created and not
  // released, and the ranges they are mapped at (start -> bytes), under vm_mutex_.
  mutable std::mutex vm_mutex_;
  std::unordered_set<std::uint64_t> host_handles_;
  backend_detail::MappingMap host_mappings_;
  std::atomic<std::size_t> host_mapping_count_{0};
  std::atomic<bool> host_access_refusal_said_{false};
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  const int count = cuda_device_count();
  if (device < 0 || device >= count)
    throw BackendError("tidepool cuda backend: device " + std::to_string(device) +
                       " does not exist (" + std::to_string(count) + " CUDA device(s) usable)");
  return std::make_unique<CudaBackend>(device);
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)runtime().get_last_error();  // no driver or no GPU: that is a count of zero
    return 0;
  }
  return count;
}

bool built_with_cuda() { return true; }

bool cuda_can_access_peer(int device, int peer) {
  const int count = cuda_device_count();
  if (device < 0 || device >= count || peer < 0 || peer >= count) return false;
  // Device handles and attributes only: no context is created on either device.
  CUdevice owner = 0;
  CUdevice accessor = 0;
  check(device, driver().cuDeviceGet(&owner, device), "cuDeviceGet");
  check(peer, driver().cuDeviceGet(&accessor, peer), "cuDeviceGet");
  int can = 0;
  check(device, driver().cuDeviceCanAccessPeer(&can, accessor, owner), "cuDeviceCanAccessPeer");
  return can != 0;
}

}  // namespace tidepool
