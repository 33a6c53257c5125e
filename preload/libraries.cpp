// The LD_PRELOAD shim's set-up (libtidepool_preload.so; the interposed functions are in
// tidepool_preload.cpp): finding, loading and binding the real libcudart (the forwarding
// target) and libtidepool, and setting tidepool up from the environment.
//
//   - Note [two once-flags]: the real libcudart's functions (the forwarding target) are
//     resolved on their own once-flag, at the first call of either function, whatever
//     its argument: cudaFree(NULL), the classic first CUDA call that creates the
//     context, must reach CUDA even when tidepool itself is set up later. tidepool is set
//     up on a second once-flag:
//     at start-up (a constructor, before main and before PyTorch reads its environment),
//     when PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF mention tidepool, and otherwise at
//     the first cudaMalloc, it loads libtidepool and calls
//     tidepool_install_from_env_for_preload: the same C++ parser as the Python hook
//     claims the tidepool keys and rewrites the variables for PyTorch (any PyTorch
//     backend:X is fine under the shim, which serves the calls that allocator makes:
//     Note [one backend] in allocator/config.cpp). A bad key stops the program with the
//     parser's message (exit status 2). Preloading the shim is itself the request to use
//     tidepool, so backend:tidepool need not be named.
//   - Note [runtime version]: tidepool serves allocations only when the process's CUDA
//     runtime (the forwarding target) has the major version tidepool was built for
//     (CUDART_VERSION): libtidepool is linked against that major's libcudart, and a
//     second runtime in the process would own memory and contexts of its own. Under any
//     other runtime (a CUDA 12 program that inherited LD_PRELOAD) libtidepool is never
//     loaded, every call is forwarded unchanged, and the shim says so once on stderr
//     (not under tidepool.log:off).
//
// Finding the real libcudart (it must be loaded before libtidepool, whose dependency
// on libcudart.so.<major> is then satisfied by soname — one copy in the process):
//   1. the next definition of cudaMalloc after the shim (dlsym(RTLD_NEXT)): the program's
//      own runtime, of whatever version, when it is in the global scope;
//   2. one already loaded in any scope, of whatever version: a library that defines
//      cudaMalloc and cudaRuntimeGetVersion itself (a program that dlopen()ed its runtime
//      RTLD_LOCAL; a second runtime loaded beside it would own memory of its own);
//   3. $TIDEPOOL_CUDART;
//   4. PyPI's nvidia wheel beside the pip-installed package:
//      <site-packages>/tidepool/lib/ → <site-packages>/nvidia/cu13/lib/libcudart.so.13;
//   5. the site-packages of the running interpreter, of $VIRTUAL_ENV and of $CONDA_PREFIX
//      (<prefix>/lib/python3.*/site-packages/...);
//   6. the loader's own search path (a CUDA toolkit in ld.so.conf).
//
// Note [a runtime found late]: when tidepool is set up before main (the variables name
// it), a Python program has not loaded its runtime yet, and none of 3-6 may find one (a
// virtual environment the shim does not know of, no toolkit in ld.so.conf). tidepool is
// then off, but the program's CUDA must still work: a forwarded call that finds no
// function looks again, with steps 1 and 2 alone, for a runtime loaded since, and forwards
// to the first found from then on (published once through Shim::late_cudart; found with no
// lock, so a fork cannot inherit one held). It is said once, with how to have tidepool
// serve (TIDEPOOL_CUDART).
// libtidepool: $TIDEPOOL_LIBRARY, then beside the shim, then the build tree's copy.
//
// tidepool.mode:pool has no meaning here (there are no regions without Python): the
// shim warns and serves every allocation.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>
#include <link.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "preload/shim.h"

namespace tidepool_preload {

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

// Every loaded library's path, in load order (the program itself, "", left out).
std::vector<std::string> loaded_libraries() {
  std::vector<std::string> paths;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (info->dlpi_name != nullptr && *info->dlpi_name != '\0') {
          static_cast<std::vector<std::string>*>(out)->emplace_back(info->dlpi_name);
        }
        return 0;
      },
      &paths);
  return paths;
}

// A CUDA runtime already loaded in any scope (step 2): the first library that defines
// cudaMalloc itself (not through a dependency, not an interposer like this shim) and has
// cudaRuntimeGetVersion. dlopen is called outside dl_iterate_phdr, which holds the
// loader's lock.
void* loaded_cudart() {
  for (const std::string& path : loaded_libraries()) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) continue;
    void* malloc_fn = dlsym(h, "cudaMalloc");
    Dl_info info{};
    if (malloc_fn != nullptr && dlsym(h, "cudaRuntimeGetVersion") != nullptr &&
        dladdr(malloc_fn, &info) != 0 && info.dli_fname != nullptr && path == info.dli_fname &&
        malloc_fn != dlsym(RTLD_DEFAULT, "cudaMalloc")) {  // the shim's, or an interposer's
      return h;
    }
    dlclose(h);
  }
  return nullptr;
}

// Steps 1 and 2: a runtime the process has loaded already, or null.
void* cudart_already_loaded() {
  if (void* h = next_cudart()) return h;
  return loaded_cudart();
}

// The path of the library that defines `fn`, or "" (for the messages naming a runtime).
std::string library_of(void* fn) {
  Dl_info info{};
  if (fn == nullptr || dladdr(fn, &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

void* open_cudart(std::string& tried) {
  if (void* h = cudart_already_loaded()) return h;
  const std::string& soname = cudart_soname();
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TIDEPOOL_CUDART")) candidates.emplace_back(env);
  const std::string here = directory_of_this_library();
  if (!here.empty()) candidates.push_back(here + "/../../" + nvidia_wheel_lib() + soname);
  std::vector<std::string> prefixes = {executable_prefix()};
  for (const char* name : {"VIRTUAL_ENV", "CONDA_PREFIX"}) {
    if (const char* env = std::getenv(name)) prefixes.emplace_back(env);
  }
  for (const std::string& prefix : prefixes) {
    if (prefix.empty()) continue;
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
    "cudaMalloc/cudaFree, cudaMallocAsync/cudaFreeAsync (and their _ptsz forms), "
    "cudaStreamDestroy, cudaIpcGetMemHandle, cudaDeviceReset, the other allocations "
    "(cudaMallocPitch, ...), the memory-pool calls and cudaDeviceEnablePeerAccess the "
    "shim watches, and cudaMemGetInfo";

// tidepool.log:off read from the variables themselves, for the one message given before
// libtidepool (whose parser knows the keys) is loaded, or when it never is.
bool environment_says_log_off() {
  for (const char* name :
       {"TIDEPOOL_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::strstr(value, "tidepool.log:off") != nullptr) return true;
  }
  return false;
}

// The runtime's functions every forwarded call may need; the names `cudart` lacks.
std::string bind_basic(void* cudart, RealCudart& c) {
  return bind_all(cudart, symbol("cudaMalloc", c.malloc), symbol("cudaFree", c.free),
                  symbol("cudaGetDevice", c.get_device), symbol("cudaSetDevice", c.set_device),
                  symbol("cudaDeviceSynchronize", c.device_synchronize),
                  symbol("cudaRuntimeGetVersion", c.runtime_get_version),
                  symbol("cudaGetLastError", c.get_last_error),
                  symbol("cudaPeekAtLastError", c.peek_at_last_error));
}

// The stream-ordered calls exist from CUDA 11.2 (cudaStreamGetDevice from 12.8): a runtime
// of another major may lack them (the program then never calls them), one of tidepool's
// major has them all. The names `cudart` lacks.
std::string bind_stream_ordered(void* cudart, RealCudart& c) {
  return bind_all(
      cudart, symbol("cudaMallocAsync", c.malloc_async), symbol("cudaFreeAsync", c.free_async),
      symbol("cudaStreamGetDevice", c.stream_get_device),
      symbol("cudaStreamIsCapturing", c.stream_is_capturing),
      symbol("cudaStreamCreateWithFlags", c.stream_create_with_flags),
      symbol("cudaEventCreateWithFlags", c.event_create_with_flags),
      symbol("cudaEventRecord", c.event_record),
      symbol("cudaStreamWaitEvent", c.stream_wait_event),
      symbol("cudaEventDestroy", c.event_destroy), symbol("cudaEventQuery", c.event_query),
      symbol("cudaStreamSynchronize", c.stream_synchronize));
}

// Forwarded whatever the runtime (a null one answers cudaErrorInitializationError); their
// absence does not turn tidepool off (a program calls the _ptsz forms only when its
// runtime has them).
void bind_optional(void* cudart, RealCudart& c) {
  bind_all(cudart, symbol("cudaStreamDestroy", c.stream_destroy),
           symbol("cudaIpcGetMemHandle", c.ipc_get_mem_handle),
           symbol("cudaDeviceReset", c.device_reset),
           symbol("cudaMallocAsync_ptsz", c.malloc_async_ptsz),
           symbol("cudaFreeAsync_ptsz", c.free_async_ptsz),
           // Note [calls the shim watches] (watched_calls.cpp).
           symbol("cudaMallocPitch", c.malloc_pitch), symbol("cudaMalloc3D", c.malloc_3d),
           symbol("cudaMallocManaged", c.malloc_managed),
           symbol("cudaMallocArray", c.malloc_array),
           symbol("cudaMalloc3DArray", c.malloc_3d_array),
           symbol("cudaMallocFromPoolAsync", c.malloc_from_pool_async),
           symbol("cudaMallocFromPoolAsync_ptsz", c.malloc_from_pool_async_ptsz),
           symbol("cudaDeviceSetMemPool", c.device_set_mem_pool),
           symbol("cudaDeviceGetDefaultMemPool", c.device_get_default_mem_pool),
           symbol("cudaMemPoolSetAccess", c.mem_pool_set_access),
           symbol("cudaDeviceEnablePeerAccess", c.device_enable_peer_access),
           symbol("cudaGetDeviceCount", c.get_device_count),
           symbol("cudaMemGetInfo", c.mem_get_info));
}

// Resolves the forwarding target (Note [two once-flags]) and decides whether tidepool may
// serve under it (Note [runtime version]). On failure it says why; the functions it could
// not bind stay null and their forwarded calls answer cudaErrorInitializationError, or go
// to a runtime loaded since when none was found (Note [a runtime found late]).
void resolve_cudart() {
  Shim& s = shim();
  RealCudart& c = s.cuda;
  void* cudart = open_or_say(open_cudart,
                             "cannot find libcudart (TIDEPOOL_CUDART names it); tidepool is "
                             "off, and the runtime the program loads gets every call. Tried:");
  if (cudart == nullptr) {
    s.cudart_missing = true;
    return;
  }
  if (const std::string missing = bind_basic(cudart, c); !missing.empty()) {
    say("libcudart lacks (tidepool is off):", missing);
    return;
  }
  const std::string missing_stream_ordered = bind_stream_ordered(cudart, c);
  bind_optional(cudart, c);
  int version = 0;
  if (const cudaError_t e = s.cuda.runtime_get_version(&version); e != cudaSuccess) {
    say("cudaRuntimeGetVersion failed; tidepool is off: error ", std::to_string(e));
    return;
  }
  if (version / 1000 != kCudaMajor) {
    if (!environment_says_log_off()) {
      say("", "the process's CUDA runtime " + library_of(reinterpret_cast<void*>(s.cuda.malloc)) +
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
                     symbol("tidepool_last_error_cuda_code", t.last_error_cuda_code),
                     symbol("tidepool_install_from_env_for_preload", t.install_from_env),
                     symbol("tidepool_config_apply", t.config_apply),
                     symbol("tidepool_config_active_json", t.config_active_json),
                     symbol("tidepool_release_stream", t.release_stream),
                     symbol("tidepool_holds_address", t.holds_address),
                     symbol("tidepool_device_holds_address", t.device_holds_address),
                     symbol("tidepool_in_forked_child", t.in_forked_child),
                     symbol("tidepool_empty_cache", t.empty_cache),
                     symbol("tidepool_enable_peer_access", t.enable_peer_access),
                     symbol("tidepool_get_stats_v1", t.get_stats_v1))) {
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
  // Note [device memory only]: what cudaMalloc hands out must be device memory. tidepool's
  // host backend, chosen by name (tidepool.device_backend:host, or TIDEPOOL_BACKEND=host
  // under device_backend:auto), hands out host memory, which the shim returned with
  // cudaSuccess: on a machine with a GPU, a kernel given it faulted (review finding). So
  // where the runtime sees a CUDA device the shim is then off (the runtime gets every
  // call); where it sees none (a test machine, the stand-in runtime of the shim's tests),
  // no kernel can run, and the host backend serves, as the tests need. "auto" is not
  // resolved here: that would start CUDA before main (a parent that forks GPU workers
  // must not), and it picks the host backend only where no device exists anyway.
  const char* named_backend = std::getenv("TIDEPOOL_BACKEND");
  const bool host_named =
      json.find("\"device_backend\":\"host\"") != std::string::npos ||
      (json.find("\"device_backend\":\"auto\"") != std::string::npos &&
       named_backend != nullptr && std::strcmp(named_backend, "host") == 0);
  if (host_named) {
    int devices = 0;
    {
      ProgramLastError keep;  // the count's "no device" is not the program's error
      if (s.cuda.get_device_count == nullptr || s.cuda.get_device_count(&devices) != cudaSuccess)
        devices = 0;
    }
    if (devices > 0) {
      if (!s.quiet) {
        say("", "tidepool's host backend (tidepool.device_backend:host or TIDEPOOL_BACKEND="
                "host) cannot serve cudaMalloc, which must return device memory; tidepool is "
                "off and the runtime gets every call");
      }
      return;
    }
  }
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

// Whether PyTorch's variables name tidepool (tidepool keys PyTorch would reject).
bool pytorch_variables_name_tidepool() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::strstr(value, "tidepool") != nullptr) return true;
  }
  return false;
}

// Before main when PyTorch's variables name tidepool: PyTorch must find them rewritten.
// Otherwise nothing is loaded until the first allocation (or free of a non-NULL pointer),
// so the many processes that inherit LD_PRELOAD and never touch CUDA (shells, compilers)
// pay nothing. That includes every child of a process the shim serves: they inherit the
// claimed keys in TIDEPOOL_ALLOC_CONF only (Note [inherited configuration] in
// allocator/config.cpp), which need no rewriting, and the set-up at a child's first
// allocation applies them. (Set up here for them too, each shell and compiler a
// torch.compile run starts loaded libcudart and libtidepool, and said so under
// tidepool.log:info.)
__attribute__((constructor)) void preload_start() {
  register_fork_handlers();  // Note [Forked child under the shim]: before any set-up
  if (pytorch_variables_name_tidepool()) ready();
}

// Note [a program the shim cannot see]
// LD_PRELOAD interposes only calls that the loader binds, and a program linked with the
// static CUDA runtime (nvcc's and CMake's default) has its cudaMalloc inside the
// executable: no call of its reaches the shim, and tidepool serves nothing, without a word
// (under tidepool.log:info the set-up even said "active"). So at exit, when no CUDA call
// ever reached the shim (the runtime was never resolved: every interposed function
// resolves it first), the process used CUDA (libcuda is loaded) and no shared runtime is
// loaded at all, the shim says so and what to change (not under tidepool.log:off). A
// process with a shared runtime loaded, in any scope, is left alone: its calls through
// the loader do reach the shim (the preloaded library comes first in every lookup), so
// making none means it allocated without the runtime (the driver API, another
// allocator), or called the runtime through dlsym of its handle, which the shim cannot
// tell apart (review finding: telling all of them to load the runtime RTLD_GLOBAL was
// wrong for most). Nor is one that never loaded libcuda (the shells and compilers that
// inherit LD_PRELOAD).
bool library_loaded(const char* prefix);  // a library whose file name starts so is loaded

bool libcuda_loaded() { return library_loaded("libcuda.so"); }

// Note [PyTorch's expandable segments under the shim]: with expandable_segments:True in the
// variable PyTorch reads, PyTorch maps its memory with the driver's cuMemCreate, which no
// shim sees: tidepool serves nothing PyTorch allocates. Named next to tidepool's keys that
// is refused at set-up (exit status 2); without them (LD_PRELOAD alone) nothing was said,
// and the run went on without tidepool (review finding). So at exit, in a process that
// loaded PyTorch's CUDA library, the shim says so.
bool library_loaded(const char* prefix) {
  const std::size_t length = std::strlen(prefix);
  for (const std::string& path : loaded_libraries()) {
    const size_t slash = path.rfind('/');
    if (path.compare(slash == std::string::npos ? 0 : slash + 1, length, prefix) == 0) {
      return true;
    }
  }
  return false;
}

bool pytorch_reads_expandable_segments() {
  const char* older = std::getenv("PYTORCH_CUDA_ALLOC_CONF");  // read whenever it is set
  const char* value = older != nullptr ? older : std::getenv("PYTORCH_ALLOC_CONF");
  return value != nullptr && std::strstr(value, "expandable_segments:True") != nullptr;
}

__attribute__((destructor)) void preload_exit() {
  const Shim& s = shim();
  if (environment_says_log_off() || !libcuda_loaded()) return;
  if (pytorch_reads_expandable_segments() && library_loaded("libc10_cuda.so")) {
    say("", "PyTorch's expandable_segments:True made PyTorch map its memory with the driver's "
            "cuMemCreate, which the shim does not see: tidepool served none of PyTorch's "
            "allocations. Leave expandable_segments out (tidepool's own segments are "
            "expandable)");
    return;
  }
  if (s.cuda_resolved.load(std::memory_order_acquire)) return;
  if (void* runtime = cudart_already_loaded()) {
    dlclose(runtime);
    return;
  }
  say("", "no CUDA call reached the shim, and tidepool served none of this process's "
          "allocations: it used CUDA (libcuda is loaded) without a shared CUDA runtime. A "
          "program linked with the static runtime (nvcc's default, -cudart static; CMake's "
          "CUDA_RUNTIME_LIBRARY Static), or one that uses the driver API alone, cannot be "
          "interposed: link it with -cudart shared (CMake: CUDA_RUNTIME_LIBRARY Shared)");
}

// Note [Forked child under the shim]: set while this thread holds Shim::setup_mutex, so
// that the set-up's own nested calls (initialise resolves the runtime) do not take it
// again: a plain mutex, which a fork handler can let go in the child.
constinit thread_local bool t_in_setup = false;

class SetUpScope {
 public:
  SetUpScope() : owner_(!t_in_setup) {
    if (owner_) {
      shim().setup_mutex.lock();
      t_in_setup = true;
    }
  }
  ~SetUpScope() {
    if (owner_) {
      t_in_setup = false;
      shim().setup_mutex.unlock();
    }
  }
  SetUpScope(const SetUpScope&) = delete;
  SetUpScope& operator=(const SetUpScope&) = delete;

 private:
  bool owner_;
};

}  // namespace

const RealCudart* cudart_found_late() {
  Shim& s = shim();
  if (!s.cudart_missing) return nullptr;
  if (const RealCudart* found = s.late_cudart.load(std::memory_order_acquire)) return found;
  void* cudart = cudart_already_loaded();
  if (cudart == nullptr) return nullptr;
  auto* found = new RealCudart;
  bind_basic(cudart, *found);
  bind_stream_ordered(cudart, *found);
  bind_optional(cudart, *found);
  const RealCudart* published = nullptr;
  if (!s.late_cudart.compare_exchange_strong(published, found, std::memory_order_acq_rel)) {
    delete found;  // another thread's is the one
    dlclose(cudart);
    return published;
  }
  if (!environment_says_log_off()) {
    say("", "the program loaded its CUDA runtime " +
                library_of(reinterpret_cast<void*>(found->malloc)) +
                " after tidepool was set up without one; tidepool is off, and every call goes "
                "to that runtime unchanged (TIDEPOOL_CUDART=<that path> lets tidepool serve)");
  }
  return found;
}

void resolve_cudart_once() {
  Shim& s = shim();
  if (s.cuda_resolved.load(std::memory_order_acquire)) return;
  SetUpScope setting_up;
  std::call_once(s.cuda_once, resolve_cudart);
  s.cuda_resolved.store(true, std::memory_order_release);
}

bool ready() {
  Shim& s = shim();
  if (!s.set_up.load(std::memory_order_acquire)) {
    SetUpScope setting_up;
    std::call_once(s.once, initialise);
    s.set_up.store(true, std::memory_order_release);
  }
  return s.ready;
}

Shim& shim() {
  static Shim* s = new Shim;  // never destroyed: cudaFree may run from late destructors
  return *s;
}

void say(const char* what, const std::string& message) {
  std::fprintf(stderr, "tidepool preload: %s%s\n", what, message.c_str());
}

}  // namespace tidepool_preload
