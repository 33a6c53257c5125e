// libtidepool_preload.so: LD_PRELOAD=libtidepool_preload.so routes any program's
// cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync through tidepool, with no code
// change and no Python, and releases in tidepool each stream the program destroys.
//
// How it works:
//   - It defines those four functions and cudaStreamDestroy. Preloaded, these definitions come first in
//     the global symbol scope, so every dynamically linked caller (PyPI torch links
//     libcudart dynamically) reaches them instead of libcudart's.
//   - Note [two once-flags]: the real libcudart's functions (the forwarding target) are
//     resolved on their own once-flag, at the first call of either function, whatever
//     its argument: cudaFree(NULL), the classic first CUDA call that creates the
//     context, must reach CUDA even when tidepool itself is set up later. tidepool is set
//     up on a second once-flag:
//   - at start-up (a constructor, before main and before PyTorch reads its environment),
//     when PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF mention tidepool, and otherwise at
//     the first cudaMalloc, it loads libtidepool and calls tidepool_install_from_env: the
//     same C++ parser as the Python hook claims the tidepool keys and rewrites the
//     variables for PyTorch. A bad key stops the program with the parser's message (exit
//     status 2). Preloading the shim is itself the request to use tidepool, so
//     backend:tidepool need not be named.
//   - Note [runtime version]: tidepool serves allocations only when the process's CUDA
//     runtime (the forwarding target) has the major version tidepool was built for
//     (CUDART_VERSION): libtidepool is linked against that major's libcudart, and a
//     second runtime in the process would own memory and contexts of its own. Under any
//     other runtime (a CUDA 12 program that inherited LD_PRELOAD) libtidepool is never
//     loaded, every call is forwarded unchanged, and the shim says so once on stderr
//     (not under tidepool.log:off).
//   - cudaMalloc → tidepool_malloc on the current device (which routes optimizer state,
//     when a caller tags it, to pointer-stable ranges itself); the shim remembers each
//     pointer with its size and device, because cudaFree gives neither. cudaFree of a
//     remembered pointer synchronises the device first (cudaFree's own contract, which
//     callers rely on) and → tidepool_free; any other pointer goes to the real cudaFree.
//   - Note [stream-ordered calls]: cudaMallocAsync → tidepool_malloc on the stream's
//     device (cudaStreamGetDevice) and on that stream, so the memory counts in tidepool's
//     budget and stats; cudaFreeAsync of a remembered pointer (from either malloc: CUDA
//     lets cudaFreeAsync free cudaMalloc's memory, and cudaFree free cudaMallocAsync's)
//     → tidepool_free on the given stream without synchronising: tidepool's stream
//     contract (caching_allocator.h) holds the block back until that stream passes the
//     free (a cudaFree frees on the NULL stream, after its synchronisation). Any other
//     pointer goes to the real cudaFreeAsync, so no tidepool pointer reaches the runtime
//     through either free (Note [streams tidepool is given] for which stream tidepool
//     is told). Also forwarded unchanged:
//     cudaMallocAsync of 0 bytes (the runtime's answer), on a stream being captured
//     into a graph (the graph owns such an allocation, and its cudaFreeAsync is a free
//     node: tidepool must not hand the memory out at capture time), and
//     cudaMallocFromPoolAsync, which the shim does not define (its memory is the
//     caller's pool's).
//   - Note [streams tidepool is given]: tidepool keys its pools by stream handle, and
//     orders a free on another stream by recording an event on that stream with an event
//     of the block's device. Three kinds of handle do not fit: cudaStreamLegacy (0x1) is
//     the NULL stream under another name, so it is given as NULL, not a stream with pools
//     of its own; cudaStreamPerThread (0x2) is one handle for a different stream in each
//     thread, so tidepool never keys anything by it (memory freed on one thread's stream
//     would be another thread's at once, and an event recorded on 0x2 by another thread
//     lands on that thread's stream); and a stream of another device than the block's
//     (CUDA lets cudaFreeAsync free on any stream; the NULL handle too names the current
//     device's stream) cannot take an event of the block's device. So cudaMallocAsync on
//     either default handle allocates on NULL (memory free in NULL's order is free for the
//     per-thread stream too: a blocking stream, its later work waits for NULL's earlier
//     work), and cudaFreeAsync on the per-thread stream or on another device's stream
//     frees on a non-blocking stream the shim keeps for the block's device, after making
//     it wait for an event the shim recorded on the given stream (on that stream's
//     device, the current one for the special handles): tidepool holds the block back
//     until that stream has passed the free, as for any free on a stream other than the
//     allocating one. If that ordering fails, the free fails with the runtime's error and
//     the pointer stays the program's, to free again.
//   - Note [destroyed streams]: tidepool keys pools, fences and thread-cache lists by
//     stream handle, and CUDA may give a destroyed stream's handle to the next stream
//     created: tidepool would then treat memory freed on the dead stream as the new
//     stream's, reusable at once, while the old stream's last kernels may still run (and
//     before that it would record events on a dead handle). So cudaStreamDestroy first
//     releases the stream in tidepool (tidepool_release_stream on the stream's device,
//     cudaStreamGetDevice; Note [Released streams] in allocator/stream_ordering.cpp),
//     then forwards. The release waits for the stream only when tidepool holds
//     something for it (Note [Releasing a stream tidepool never saw]), so destroying a
//     stream tidepool never saw does not block, as cudaStreamDestroy does not. A failed
//     release (a handle already invalid) does not stop the destroy: the shim says so once
//     on stderr (not under tidepool.log:off) and forwards anyway. Forwarded with no
//     release: the NULL, legacy and per-thread handles (the runtime refuses them), calls
//     made inside tidepool, and every call while tidepool is not set up (it holds nothing
//     then; the destroy does not set it up) or does not serve (Note [runtime version]).
//   - Errors keep CUDA's meaning: cudaErrorMemoryAllocation for out-of-memory
//     (tidepool_last_error_is_out_of_memory) and for a size above tidepool's limit
//     (Note [sizes beyond any device]), cudaErrorInvalidValue for any other failure of
//     tidepool_malloc or tidepool_free (tidepool prints those itself).
//   - Note [sizes beyond any device]: tidepool_malloc rejects a size above 2^50
//     (kMaxRequest) as a bad request, not an out-of-memory, because for its callers
//     such a size is a bug (a negative size cast). The runtime has no such rule: it
//     answers cudaErrorMemoryAllocation for any size it cannot satisfy, and a program
//     under the shim must see the code it sees without it. The shim answers those sizes
//     itself, with the runtime's code and a message, before tidepool (and before the
//     cast to tidepool_malloc's ssize_t, which would make sizes above 2^63 negative).
//   - Note [re-entrancy]: libtidepool's cuda backend itself calls cudaMalloc/cudaFree,
//     which resolve to this shim too. A thread-local flag marks "inside tidepool"; calls
//     made then go straight to the real libcudart. Every scope that sets it restores the
//     value it found, so a nested call (tidepool's cudaFree inside its own malloc) does
//     not clear it for the rest of the outer call.
//
// Finding the real libcudart (it must be loaded before libtidepool, whose dependency
// on libcudart.so.<major> is then satisfied by soname — one copy in the process):
//   1. the next definition of cudaMalloc after the shim (dlsym(RTLD_NEXT)): the program's
//      own runtime, of whatever version, when it is in the global scope;
//   2. one of tidepool's major already loaded;
//   3. $TIDEPOOL_CUDART;
//   4. PyPI's nvidia wheel beside the pip-installed package:
//      <site-packages>/tidepool/lib/ → <site-packages>/nvidia/cu13/lib/libcudart.so.13;
//   5. the running interpreter's site-packages (<prefix>/lib/python3.*/site-packages/...);
//   6. the loader's own search path (a CUDA toolkit in ld.so.conf).
// libtidepool: $TIDEPOOL_LIBRARY, then beside the shim, then the build tree's copy.
//
// tidepool.mode:pool has no meaning here (there are no regions without Python): the
// shim warns and serves every allocation.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "allocator/size_classes.h"

#define TIDEPOOL_PRELOAD_EXPORT __attribute__((visibility("default")))

namespace {

// The CUDA major tidepool (and so libtidepool's libcudart dependency) was built for.
constexpr int kCudaMajor = CUDART_VERSION / 1000;

const std::string& cudart_soname() {
  static const std::string name = "libcudart.so." + std::to_string(kCudaMajor);
  return name;
}

// PyPI's wheel directory for that major: nvidia/cu13/lib.
const std::string& nvidia_wheel_lib() {
  static const std::string dir = "nvidia/cu" + std::to_string(kCudaMajor) + "/lib/";
  return dir;
}

struct RealCudart {
  cudaError_t (*malloc)(void**, size_t) = nullptr;
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*get_device)(int*) = nullptr;
  cudaError_t (*set_device)(int) = nullptr;
  cudaError_t (*device_synchronize)() = nullptr;
  cudaError_t (*runtime_get_version)(int*) = nullptr;
  // Note [stream-ordered calls]; bound apart (see resolve_cudart): older runtimes lack them.
  cudaError_t (*malloc_async)(void**, size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*stream_get_device)(cudaStream_t, int*) = nullptr;
  cudaError_t (*stream_is_capturing)(cudaStream_t, cudaStreamCaptureStatus*) = nullptr;
  cudaError_t (*stream_destroy)(cudaStream_t) = nullptr;  // Note [destroyed streams]
  // Note [streams tidepool is given].
  cudaError_t (*stream_create_with_flags)(cudaStream_t*, unsigned) = nullptr;
  cudaError_t (*event_create_with_flags)(cudaEvent_t*, unsigned) = nullptr;
  cudaError_t (*event_record)(cudaEvent_t, cudaStream_t) = nullptr;
  cudaError_t (*stream_wait_event)(cudaStream_t, cudaEvent_t, unsigned) = nullptr;
  cudaError_t (*event_destroy)(cudaEvent_t) = nullptr;
};

struct TidepoolAbi {
  void* (*malloc)(ssize_t, int, void*) = nullptr;
  void (*free)(void*, size_t, int, void*) = nullptr;
  const char* (*last_error)() = nullptr;
  void (*clear_error)() = nullptr;
  int (*last_error_is_out_of_memory)() = nullptr;
  int (*install_from_env)(char*, size_t) = nullptr;
  int (*config_apply)(const char*, char*, size_t) = nullptr;
  size_t (*config_active_json)(char*, size_t) = nullptr;
  int (*release_stream)(int, void*) = nullptr;
};

struct Allocation {
  size_t size;
  int device;
};

struct Shim {
  std::once_flag cuda_once;  // resolves `cuda` (Note [two once-flags])
  bool serve = false;        // the runtime has tidepool's major (Note [runtime version])
  std::once_flag once;       // sets up tidepool
  bool ready = false;   // both libraries loaded, configuration applied
  bool verbose = false;  // tidepool.log:info or debug
  bool quiet = false;    // tidepool.log:off
  // `ready`, readable without setting tidepool up (Note [destroyed streams]).
  std::atomic<bool> serving{false};
  std::atomic<bool> said_release_failed{false};
  RealCudart cuda;
  TidepoolAbi tp;
  std::mutex mutex;  // guards `owned`
  std::unordered_map<void*, Allocation> owned;
  // Per device, the stream cross-stream frees are ordered on (Note [streams tidepool is
  // given]); created at the first such free, never destroyed. A lock of its own: it is
  // held across CUDA calls, which must not wait for `owned`.
  std::mutex ordering_mutex;
  std::unordered_map<int, cudaStream_t> ordering_streams;
};

Shim& shim() {
  static Shim* s = new Shim;  // never destroyed: cudaFree may run from late destructors
  return *s;
}

thread_local bool t_inside_tidepool = false;

// Note [re-entrancy]: restores the value it found, not false, so that the end of a
// nested call leaves the outer one still "inside".
class InsideTidepool {
 public:
  InsideTidepool() : previous_(t_inside_tidepool) { t_inside_tidepool = true; }
  ~InsideTidepool() { t_inside_tidepool = previous_; }
  InsideTidepool(const InsideTidepool&) = delete;
  InsideTidepool& operator=(const InsideTidepool&) = delete;

 private:
  bool previous_;
};

void say(const char* what, const std::string& message) {
  std::fprintf(stderr, "tidepool preload: %s%s\n", what, message.c_str());
}

std::string directory_of_this_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&directory_of_this_library), &info) == 0 ||
      info.dli_fname == nullptr) {
    return {};
  }
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

std::vector<std::string> glob_paths(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (glob(pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  globfree(&g);
  return out;
}

// The prefix of the running executable: /usr/bin/python3 -> /usr.
std::string executable_prefix() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  std::string path(buf, static_cast<size_t>(n));
  for (int up = 0; up < 2; ++up) {
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return {};
    path.resize(slash);
  }
  return path;
}

// The library that defines the next cudaMalloc after the shim's own, when one is in the
// global scope: the runtime the program itself was linked with, whichever its version.
void* next_cudart() {
  void* next = dlsym(RTLD_NEXT, "cudaMalloc");
  if (next == nullptr) return nullptr;
  Dl_info info{};
  if (dladdr(next, &info) == 0 || info.dli_fname == nullptr || *info.dli_fname == '\0') {
    return nullptr;
  }
  return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);  // already loaded: a handle only
}

void* open_cudart(std::string& tried) {
  if (void* h = next_cudart()) return h;
  const std::string& soname = cudart_soname();
  if (void* h = dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) return h;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TIDEPOOL_CUDART")) candidates.emplace_back(env);
  const std::string here = directory_of_this_library();
  if (!here.empty()) candidates.push_back(here + "/../../" + nvidia_wheel_lib() + soname);
  const std::string prefix = executable_prefix();
  if (!prefix.empty()) {
    for (const std::string& p :
         glob_paths(prefix + "/lib/python3*/site-packages/" + nvidia_wheel_lib() + soname)) {
      candidates.push_back(p);
    }
  }
  candidates.emplace_back(soname);
  for (const std::string& path : candidates) {
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
    tried += "\n  " + path + ": " + dlerror();
  }
  return nullptr;
}

void* open_tidepool(std::string& tried) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TIDEPOOL_LIBRARY")) candidates.emplace_back(env);
  const std::string here = directory_of_this_library();
  if (!here.empty()) {
    candidates.push_back(here + "/libtidepool.so.0");
    candidates.push_back(here + "/libtidepool.so");
  }
#ifdef TIDEPOOL_PRELOAD_BUILD_LIBRARY
  candidates.emplace_back(TIDEPOOL_PRELOAD_BUILD_LIBRARY);
#endif
  candidates.emplace_back("libtidepool.so.0");
  for (const std::string& path : candidates) {
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
    tried += "\n  " + path + ": " + dlerror();
  }
  return nullptr;
}

// A function to look up by name, and where its address goes.
template <typename Fn>
struct Symbol {
  const char* name;
  Fn& out;
};

template <typename Fn>
Symbol<Fn> symbol(const char* name, Fn& out) {
  return Symbol<Fn>{name, out};
}

// Binds every symbol it can; the names of those `handle` lacks (" a b"), or "".
template <typename... Fns>
std::string bind_all(void* handle, Symbol<Fns>... symbols) {
  std::string missing;
  const auto bind = [&](auto symbol) {
    symbol.out = reinterpret_cast<std::remove_reference_t<decltype(symbol.out)>>(
        dlsym(handle, symbol.name));
    if (symbol.out == nullptr) missing += std::string(" ") + symbol.name;
  };
  (bind(symbols), ...);
  return missing;
}

// bind_all for functions tidepool cannot serve without: says which `library` lacks.
template <typename... Fns>
bool bind_required(void* handle, const char* library, Symbol<Fns>... symbols) {
  const std::string missing = bind_all(handle, symbols...);
  if (!missing.empty()) say((std::string(library) + " lacks (tidepool is off):").c_str(), missing);
  return missing.empty();
}

// Opens a library with `open`, saying `failure` and where it looked when it cannot.
void* open_or_say(void* (*open)(std::string& tried), const char* failure) {
  std::string tried;
  void* handle = open(tried);
  if (handle == nullptr) say(failure, tried);
  return handle;
}

// The functions the shim defines, as the messages name them.
constexpr const char* kInterposed =
    "cudaMalloc/cudaFree, cudaMallocAsync/cudaFreeAsync and cudaStreamDestroy";

// tidepool.log:off read from the variables themselves, for the one message given before
// libtidepool (whose parser knows the keys) is loaded, or when it never is.
bool environment_says_log_off() {
  for (const char* name : {"TIDEPOOL_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::strstr(value, "tidepool.log:off") != nullptr) return true;
  }
  return false;
}

// Resolves the forwarding target (Note [two once-flags]) and decides whether tidepool may
// serve under it (Note [runtime version]). On failure it says why; the functions it could
// not bind stay null and their forwarded calls answer cudaErrorInitializationError.
void resolve_cudart() {
  Shim& s = shim();
  RealCudart& c = s.cuda;
  void* cudart = open_or_say(open_cudart, "cannot find libcudart; tidepool is off. Tried:");
  if (cudart == nullptr ||
      !bind_required(cudart, "libcudart", symbol("cudaMalloc", c.malloc),
                     symbol("cudaFree", c.free), symbol("cudaGetDevice", c.get_device),
                     symbol("cudaSetDevice", c.set_device),
                     symbol("cudaDeviceSynchronize", c.device_synchronize),
                     symbol("cudaRuntimeGetVersion", c.runtime_get_version))) {
    return;
  }
  // The stream-ordered calls exist from CUDA 11.2 (cudaStreamGetDevice from 12.8): a
  // runtime of another major may lack them (the program then never calls them), one of
  // tidepool's major has them all.
  const std::string missing_stream_ordered = bind_all(
      cudart, symbol("cudaMallocAsync", c.malloc_async), symbol("cudaFreeAsync", c.free_async),
      symbol("cudaStreamGetDevice", c.stream_get_device),
      symbol("cudaStreamIsCapturing", c.stream_is_capturing),
      symbol("cudaStreamCreateWithFlags", c.stream_create_with_flags),
      symbol("cudaEventCreateWithFlags", c.event_create_with_flags),
      symbol("cudaEventRecord", c.event_record),
      symbol("cudaStreamWaitEvent", c.stream_wait_event),
      symbol("cudaEventDestroy", c.event_destroy));
  // Forwarded whatever the runtime (a null one answers cudaErrorInitializationError); its
  // absence does not turn tidepool off.
  bind_all(cudart, symbol("cudaStreamDestroy", c.stream_destroy));
  int version = 0;
  if (const cudaError_t e = s.cuda.runtime_get_version(&version); e != cudaSuccess) {
    say("cudaRuntimeGetVersion failed; tidepool is off: error ", std::to_string(e));
    return;
  }
  if (version / 1000 != kCudaMajor) {
    if (!environment_says_log_off()) {
      Dl_info info{};
      const bool named = dladdr(reinterpret_cast<void*>(s.cuda.malloc), &info) != 0 &&
                         info.dli_fname != nullptr;
      say("", "the process's CUDA runtime " + std::string(named ? info.dli_fname : "") +
                  " is version " + std::to_string(version / 1000) + "." +
                  std::to_string(version % 1000 / 10) + ", but tidepool was built for CUDA " +
                  std::to_string(kCudaMajor) +
                  "; tidepool is off: every " + kInterposed +
                  " goes to that runtime unchanged, and the allocator variables are not "
                  "claimed");
    }
    return;
  }
  if (!missing_stream_ordered.empty()) {
    say("libcudart lacks (tidepool is off):", missing_stream_ordered);  // after the version
    return;
  }
  s.serve = true;
}

void resolve_cudart_once() {
  Shim& s = shim();
  std::call_once(s.cuda_once, resolve_cudart);
}

// Loads libtidepool and applies the configuration, once the runtime allows it. Exits the
// process on a bad configuration (the clear start-up error the keys promise); on a
// missing library it says why and leaves every call to the real libcudart.
void initialise() {
  Shim& s = shim();
  InsideTidepool inside;  // libtidepool's own start-up may touch CUDA
  resolve_cudart_once();
  if (!s.serve) return;  // resolve_cudart said why
  TidepoolAbi& t = s.tp;
  void* lib = open_or_say(open_tidepool, "cannot load libtidepool; tidepool is off. Tried:");
  if (lib == nullptr ||
      !bind_required(lib, "libtidepool", symbol("tidepool_malloc", t.malloc),
                     symbol("tidepool_free", t.free), symbol("tidepool_last_error", t.last_error),
                     symbol("tidepool_clear_error", t.clear_error),
                     symbol("tidepool_last_error_is_out_of_memory", t.last_error_is_out_of_memory),
                     symbol("tidepool_install_from_env", t.install_from_env),
                     symbol("tidepool_config_apply", t.config_apply),
                     symbol("tidepool_config_active_json", t.config_active_json),
                     symbol("tidepool_release_stream", t.release_stream))) {
    return;
  }
  char error[2048] = "";
  int named = s.tp.install_from_env(error, sizeof error);
  if (named == 0) named = s.tp.config_apply("backend:tidepool", error, sizeof error) == 0 ? 1 : -1;
  if (named < 0) {
    say("", error);
    std::_Exit(2);
  }
  // The JSON is config_to_json's fixed format (allocator/config.cpp).
  std::string json(s.tp.config_active_json(nullptr, 0) + 1, '\0');
  s.tp.config_active_json(json.data(), json.size());
  s.quiet = json.find("\"log\":\"off\"") != std::string::npos;
  s.verbose = json.find("\"log\":\"info\"") != std::string::npos ||
              json.find("\"log\":\"debug\"") != std::string::npos;
  if (json.find("\"mode\":\"pool\"") != std::string::npos && !s.quiet) {
    say("", "tidepool.mode:pool needs the Python package; under LD_PRELOAD every cudaMalloc "
            "goes through tidepool");
  }
  if (s.verbose) say("active: ", json.c_str());
  s.ready = true;
  s.serving.store(true, std::memory_order_release);
}

bool ready() {
  Shim& s = shim();
  std::call_once(s.once, initialise);
  return s.ready;
}

bool environment_names_tidepool() {
  const char* inherited = std::getenv("TIDEPOOL_ALLOC_CONF");
  if (inherited != nullptr && *inherited != '\0') return true;
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::strstr(value, "tidepool") != nullptr) return true;
  }
  return false;
}

// Before main when the variables name tidepool: PyTorch must find them rewritten.
// Otherwise nothing is loaded until the first allocation (or free of a non-NULL pointer),
// so the many processes that inherit LD_PRELOAD and never touch CUDA (shells, compilers)
// pay nothing.
__attribute__((constructor)) void preload_start() {
  if (environment_names_tidepool()) ready();
}

// The real runtime's function `fn`, for calls tidepool does not serve (its own, pointers
// it does not own, or all of them when it is off). Resolves the target first: the call
// may be the process's first (cudaFree(NULL) before tidepool is set up, Note [two
// once-flags]).
template <typename Fn, typename... Args>
cudaError_t forward(Fn RealCudart::*fn, Args... args) {
  Shim& s = shim();
  resolve_cudart_once();
  const Fn real = s.cuda.*fn;
  if (real == nullptr) return cudaErrorInitializationError;
  InsideTidepool inside;
  return real(args...);
}

// Serves an allocation through tidepool on `device` and `stream` (cudaMalloc: the NULL
// stream). `call` names the CUDA function in messages.
cudaError_t serve_malloc(const char* call, void** dev_ptr, size_t size, int device,
                         cudaStream_t stream) {
  Shim& s = shim();
  *dev_ptr = nullptr;
  if (size > tidepool::kMaxRequest) {  // Note [sizes beyond any device]
    if (!s.quiet) {
      say(call, std::string(": ") + std::to_string(size) +
                    " bytes is more than any device holds (tidepool's limit is 2^50 bytes)");
    }
    return cudaErrorMemoryAllocation;
  }
  void* ptr = nullptr;
  {
    InsideTidepool inside;
    ptr = s.tp.malloc(static_cast<ssize_t>(size), device, stream);
  }
  if (ptr == nullptr) {
    // Only a real out-of-memory is cudaErrorMemoryAllocation: callers free caches and
    // retry on it, which would hide a bad request. Anything else (a device tidepool
    // cannot serve) is a bad request, whose message libtidepool has already printed.
    if (s.tp.last_error_is_out_of_memory() == 0) return cudaErrorInvalidValue;
    if (!s.quiet) say(call, std::string(": ") + s.tp.last_error());
    return cudaErrorMemoryAllocation;
  }
  {
    std::lock_guard lock(s.mutex);
    s.owned[ptr] = Allocation{size, device};
  }
  *dev_ptr = ptr;
  return cudaSuccess;
}

// Removes `ptr` from the shim's table; false when the shim did not hand it out.
bool take_owned(void* ptr, Allocation& out) {
  Shim& s = shim();
  std::lock_guard lock(s.mutex);
  const auto it = s.owned.find(ptr);
  if (it == s.owned.end()) return false;
  out = it->second;
  s.owned.erase(it);
  return true;
}

// Puts back what take_owned removed, when the free fails before reaching tidepool: the
// pointer is still the program's, to free again.
void restore_owned(void* ptr, const Allocation& a) {
  Shim& s = shim();
  std::lock_guard lock(s.mutex);
  s.owned.emplace(ptr, a);
}

// Makes `device` current for a scope, then the program's device again.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    Shim& s = shim();
    error_ = s.cuda.get_device(&previous_);
    if (error_ == cudaSuccess && previous_ != device) {
      error_ = s.cuda.set_device(device);
      switched_ = error_ == cudaSuccess;
    }
  }
  ~CurrentDevice() {
    if (switched_) shim().cuda.set_device(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
};

// The stream tidepool is told for an allocation on `stream` (Note [streams tidepool is
// given]).
cudaStream_t allocation_stream(cudaStream_t stream) {
  return stream == cudaStreamLegacy || stream == cudaStreamPerThread ? nullptr : stream;
}

// The shim's own stream on `device` (Note [streams tidepool is given]).
cudaError_t ordering_stream(int device, cudaStream_t& out) {
  Shim& s = shim();
  std::lock_guard lock(s.ordering_mutex);
  if (const auto it = s.ordering_streams.find(device); it != s.ordering_streams.end()) {
    out = it->second;
    return cudaSuccess;
  }
  CurrentDevice on(device);
  if (on.error() != cudaSuccess) return on.error();
  cudaStream_t created = nullptr;
  if (const cudaError_t e = s.cuda.stream_create_with_flags(&created, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return e;
  }
  s.ordering_streams.emplace(device, created);
  out = created;
  return cudaSuccess;
}

// Makes `order` wait until `stream` (of `stream_device`) has passed what is queued on it.
cudaError_t wait_for_stream(cudaStream_t order, cudaStream_t stream, int stream_device) {
  Shim& s = shim();
  // An event is recorded on a stream of its own device; the NULL and per-thread handles
  // name the current device's streams.
  CurrentDevice on(stream_device);
  if (on.error() != cudaSuccess) return on.error();
  cudaEvent_t passed = nullptr;
  cudaError_t e = s.cuda.event_create_with_flags(&passed, cudaEventDisableTiming);
  if (e != cudaSuccess) return e;
  e = s.cuda.event_record(passed, stream);
  if (e == cudaSuccess) e = s.cuda.stream_wait_event(order, passed, 0);
  // The wait keeps what it needs: destroying the event does not disturb it.
  const cudaError_t destroyed = s.cuda.event_destroy(passed);
  return e != cudaSuccess ? e : destroyed;
}

// The stream tidepool frees a block of `block_device` on for a cudaFreeAsync on `stream`
// (Note [streams tidepool is given]).
cudaError_t free_stream(cudaStream_t stream, int block_device, cudaStream_t& out) {
  Shim& s = shim();
  int stream_device = 0;
  if (const cudaError_t e = s.cuda.stream_get_device(stream, &stream_device); e != cudaSuccess) {
    return e;
  }
  if (stream_device == block_device && stream != cudaStreamPerThread) {
    out = allocation_stream(stream);
    return cudaSuccess;
  }
  cudaStream_t order = nullptr;
  if (const cudaError_t e = ordering_stream(block_device, order); e != cudaSuccess) return e;
  if (const cudaError_t e = wait_for_stream(order, stream, stream_device); e != cudaSuccess) {
    return e;
  }
  out = order;
  return cudaSuccess;
}

// Gives a pointer the shim handed out back to tidepool, freed on `stream`.
cudaError_t serve_free(void* ptr, const Allocation& a, cudaStream_t stream) {
  Shim& s = shim();
  InsideTidepool inside;
  // tidepool_free returns nothing: a failure (tidepool no longer owns the pointer, freed
  // behind the shim's back) shows only in the thread's last error, which libtidepool
  // has also printed.
  s.tp.clear_error();
  s.tp.free(ptr, a.size, a.device, stream);
  return *s.tp.last_error() == '\0' ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMalloc(void** dev_ptr, size_t size) {
  if (dev_ptr == nullptr) return cudaErrorInvalidValue;
  Shim& s = shim();
  if (t_inside_tidepool || !ready()) return forward(&RealCudart::malloc, dev_ptr, size);
  if (size == 0) {
    *dev_ptr = nullptr;
    return cudaSuccess;
  }
  int device = 0;
  if (const cudaError_t e = s.cuda.get_device(&device); e != cudaSuccess) return e;
  return serve_malloc("cudaMalloc", dev_ptr, size, device, nullptr);
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaFree(void* dev_ptr) {
  Shim& s = shim();
  // cudaFree(nullptr) is the classic "initialise the context" call: always CUDA's, and it
  // does not set tidepool up (forward resolves the real cudaFree itself).
  if (dev_ptr == nullptr || t_inside_tidepool || !ready()) {
    return forward(&RealCudart::free, dev_ptr);
  }
  Allocation a{};
  if (!take_owned(dev_ptr, a)) return forward(&RealCudart::free, dev_ptr);
  // cudaFree waits for the device; callers free memory kernels just used on that promise.
  cudaError_t synced = cudaSuccess;
  {
    CurrentDevice on(a.device);
    if (on.error() != cudaSuccess) {  // nothing waited for: the block is not freed
      restore_owned(dev_ptr, a);
      return on.error();
    }
    synced = s.cuda.device_synchronize();
  }
  const cudaError_t freed = serve_free(dev_ptr, a, nullptr);
  return synced != cudaSuccess ? synced : freed;
}

// Note [stream-ordered calls].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMallocAsync(void** dev_ptr, size_t size,
                                                    cudaStream_t stream) {
  if (dev_ptr == nullptr) return cudaErrorInvalidValue;
  Shim& s = shim();
  if (t_inside_tidepool || size == 0 || !ready()) {
    return forward(&RealCudart::malloc_async, dev_ptr, size, stream);
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (const cudaError_t e = s.cuda.stream_is_capturing(stream, &capture); e != cudaSuccess) {
    return e;
  }
  if (capture != cudaStreamCaptureStatusNone) {
    return forward(&RealCudart::malloc_async, dev_ptr, size, stream);
  }
  int device = 0;
  if (const cudaError_t e = s.cuda.stream_get_device(stream, &device); e != cudaSuccess) return e;
  return serve_malloc("cudaMallocAsync", dev_ptr, size, device, allocation_stream(stream));
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaFreeAsync(void* dev_ptr, cudaStream_t stream) {
  Allocation a{};
  if (dev_ptr == nullptr || t_inside_tidepool || !ready() || !take_owned(dev_ptr, a)) {
    return forward(&RealCudart::free_async, dev_ptr, stream);
  }
  cudaStream_t stream_for_tidepool = nullptr;
  if (const cudaError_t e = free_stream(stream, a.device, stream_for_tidepool); e != cudaSuccess) {
    restore_owned(dev_ptr, a);
    return e;
  }
  return serve_free(dev_ptr, a, stream_for_tidepool);
}

// Note [destroyed streams].
TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Shim& s = shim();
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread ||
      t_inside_tidepool || !s.serving.load(std::memory_order_acquire)) {
    return forward(&RealCudart::stream_destroy, stream);
  }
  std::string failure;
  int device = 0;
  if (const cudaError_t e = s.cuda.stream_get_device(stream, &device); e != cudaSuccess) {
    failure = "cudaStreamGetDevice failed (error " + std::to_string(e) + ")";
  } else {
    InsideTidepool inside;
    s.tp.clear_error();
    if (s.tp.release_stream(device, stream) != 0) failure = s.tp.last_error();
  }
  if (!failure.empty() && !s.quiet && !s.said_release_failed.exchange(true)) {
    say("cudaStreamDestroy: ",
        "could not release the stream in tidepool first (" + failure +
            "); destroying it anyway. tidepool may order memory freed on it wrongly if "
            "its handle is reused (said once)");
  }
  return forward(&RealCudart::stream_destroy, stream);
}

}  // extern "C"
