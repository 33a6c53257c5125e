// libtidepool_preload.so: LD_PRELOAD=libtidepool_preload.so routes any program's
// cudaMalloc/cudaFree through tidepool, with no code change and no Python.
//
// How it works:
//   - It defines cudaMalloc and cudaFree. Preloaded, these definitions come first in
//     the global symbol scope, so every dynamically linked caller (PyPI torch links
//     libcudart dynamically) reaches them instead of libcudart's.
//   - At start-up (a constructor, before main and before PyTorch reads its environment),
//     when PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF mention tidepool, and otherwise at
//     the first cudaMalloc, it loads libcudart and libtidepool and calls
//     tidepool_install_from_env: the same C++ parser as the Python hook claims the
//     tidepool keys and rewrites the variables for PyTorch. A bad key stops the program
//     with the parser's message (exit status 2). Preloading the shim is itself the request to use
//     tidepool, so backend:tidepool need not be named.
//   - cudaMalloc → tidepool_malloc on the current device (which routes optimizer state,
//     when a caller tags it, to pointer-stable ranges itself); the shim remembers each
//     pointer with its size and device, because cudaFree gives neither. cudaFree of a
//     remembered pointer synchronises the device first (cudaFree's own contract, which
//     callers rely on) and → tidepool_free; any other pointer goes to the real cudaFree.
//   - Note [re-entrancy]: libtidepool's cuda backend itself calls cudaMalloc/cudaFree,
//     which resolve to this shim too. A thread-local flag marks "inside tidepool"; calls
//     made then go straight to the real libcudart.
//
// Finding the real libcudart (it must be loaded before libtidepool, whose dependency
// on libcudart.so.13 is then satisfied by soname — one copy in the process):
//   1. one already loaded (a program linked against it);
//   2. $TIDEPOOL_CUDART;
//   3. PyPI's nvidia wheel beside the pip-installed package:
//      <site-packages>/tidepool/lib/ → <site-packages>/nvidia/cu13/lib/libcudart.so.13;
//   4. the running interpreter's site-packages (<prefix>/lib/python3.*/site-packages/...);
//   5. the loader's own search path (a CUDA toolkit in ld.so.conf).
// libtidepool: $TIDEPOOL_LIBRARY, then beside the shim, then the build tree's copy.
//
// tidepool.mode:pool has no meaning here (there are no regions without Python): the
// shim warns and serves every allocation.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <unordered_map>
#include <vector>

#define TIDEPOOL_PRELOAD_EXPORT __attribute__((visibility("default")))

namespace {

constexpr const char* kCudartSoname = "libcudart.so.13";

struct RealCudart {
  cudaError_t (*malloc)(void**, size_t) = nullptr;
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*get_device)(int*) = nullptr;
  cudaError_t (*set_device)(int) = nullptr;
  cudaError_t (*device_synchronize)() = nullptr;
};

struct TidepoolAbi {
  void* (*malloc)(ssize_t, int, void*) = nullptr;
  void (*free)(void*, size_t, int, void*) = nullptr;
  const char* (*last_error)() = nullptr;
  int (*install_from_env)(char*, size_t) = nullptr;
  int (*config_apply)(const char*, char*, size_t) = nullptr;
  size_t (*config_active_json)(char*, size_t) = nullptr;
};

struct Allocation {
  size_t size;
  int device;
};

struct Shim {
  std::once_flag once;
  bool ready = false;   // both libraries loaded, configuration applied
  bool verbose = false;  // tidepool.log:info or debug
  bool quiet = false;    // tidepool.log:off
  RealCudart cuda;
  TidepoolAbi tp;
  std::mutex mutex;  // guards `owned`
  std::unordered_map<void*, Allocation> owned;
};

Shim& shim() {
  static Shim* s = new Shim;  // never destroyed: cudaFree may run from late destructors
  return *s;
}

thread_local bool t_inside_tidepool = false;

struct InsideTidepool {
  InsideTidepool() { t_inside_tidepool = true; }
  ~InsideTidepool() { t_inside_tidepool = false; }
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

void* open_cudart(std::string& tried) {
  if (void* h = dlopen(kCudartSoname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) return h;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TIDEPOOL_CUDART")) candidates.emplace_back(env);
  const std::string here = directory_of_this_library();
  if (!here.empty()) candidates.push_back(here + "/../../nvidia/cu13/lib/" + kCudartSoname);
  const std::string prefix = executable_prefix();
  if (!prefix.empty()) {
    for (const std::string& p :
         glob_paths(prefix + "/lib/python3*/site-packages/nvidia/cu13/lib/" + kCudartSoname)) {
      candidates.push_back(p);
    }
  }
  candidates.emplace_back(kCudartSoname);
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

template <typename Fn>
bool bind(void* handle, const char* name, Fn& out, std::string& missing) {
  out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (out == nullptr) missing += std::string(" ") + name;
  return out != nullptr;
}

// Loads both libraries and applies the configuration. Exits the process on a bad
// configuration (the clear start-up error the keys promise); on a missing library it
// says why and leaves every call to the real libcudart.
void initialise() {
  Shim& s = shim();
  InsideTidepool inside;  // libtidepool's own start-up may touch CUDA
  std::string tried;
  void* cudart = open_cudart(tried);
  if (cudart == nullptr) {
    say("cannot find libcudart; tidepool is off. Tried:", tried);
    return;
  }
  std::string missing;
  bind(cudart, "cudaMalloc", s.cuda.malloc, missing);
  bind(cudart, "cudaFree", s.cuda.free, missing);
  bind(cudart, "cudaGetDevice", s.cuda.get_device, missing);
  bind(cudart, "cudaSetDevice", s.cuda.set_device, missing);
  bind(cudart, "cudaDeviceSynchronize", s.cuda.device_synchronize, missing);
  if (!missing.empty()) {
    say("libcudart lacks:", missing);
    return;
  }
  void* lib = open_tidepool(tried);
  if (lib == nullptr) {
    say("cannot load libtidepool; tidepool is off. Tried:", tried);
    return;
  }
  bind(lib, "tidepool_malloc", s.tp.malloc, missing);
  bind(lib, "tidepool_free", s.tp.free, missing);
  bind(lib, "tidepool_last_error", s.tp.last_error, missing);
  bind(lib, "tidepool_install_from_env", s.tp.install_from_env, missing);
  bind(lib, "tidepool_config_apply", s.tp.config_apply, missing);
  bind(lib, "tidepool_config_active_json", s.tp.config_active_json, missing);
  if (!missing.empty()) {
    say("libtidepool lacks:", missing);
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
// Otherwise nothing is loaded until the first cudaMalloc, so the many processes that
// inherit LD_PRELOAD and never touch CUDA (shells, compilers) pay nothing.
__attribute__((constructor)) void preload_start() {
  if (environment_names_tidepool()) ready();
}

// The real cudaFree for pointers the shim does not own (and before it is ready).
cudaError_t forward_free(void* ptr) {
  Shim& s = shim();
  if (s.cuda.free == nullptr) return cudaErrorInitializationError;
  InsideTidepool inside;
  return s.cuda.free(ptr);
}

}  // namespace

extern "C" {

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaMalloc(void** dev_ptr, size_t size) {
  if (dev_ptr == nullptr) return cudaErrorInvalidValue;
  Shim& s = shim();
  if (t_inside_tidepool || !ready()) {
    if (s.cuda.malloc == nullptr) return cudaErrorInitializationError;
    return s.cuda.malloc(dev_ptr, size);
  }
  if (size == 0) {
    *dev_ptr = nullptr;
    return cudaSuccess;
  }
  int device = 0;
  if (const cudaError_t e = s.cuda.get_device(&device); e != cudaSuccess) return e;
  void* ptr = nullptr;
  {
    InsideTidepool inside;
    ptr = s.tp.malloc(static_cast<ssize_t>(size), device, nullptr);
  }
  if (ptr == nullptr) {
    if (!s.quiet) say("cudaMalloc: ", s.tp.last_error());
    *dev_ptr = nullptr;
    return cudaErrorMemoryAllocation;
  }
  {
    std::lock_guard lock(s.mutex);
    s.owned[ptr] = Allocation{size, device};
  }
  *dev_ptr = ptr;
  return cudaSuccess;
}

TIDEPOOL_PRELOAD_EXPORT cudaError_t cudaFree(void* dev_ptr) {
  Shim& s = shim();
  // cudaFree(nullptr) is the classic "initialise the context" call: always CUDA's.
  if (dev_ptr == nullptr || t_inside_tidepool || !ready()) return forward_free(dev_ptr);
  Allocation a{};
  {
    std::lock_guard lock(s.mutex);
    const auto it = s.owned.find(dev_ptr);
    if (it == s.owned.end()) return forward_free(dev_ptr);
    a = it->second;
    s.owned.erase(it);
  }
  // cudaFree waits for the device; callers free memory kernels just used on that promise.
  int current = a.device;
  s.cuda.get_device(&current);
  if (current != a.device) s.cuda.set_device(a.device);
  const cudaError_t synced = s.cuda.device_synchronize();
  if (current != a.device) s.cuda.set_device(current);
  InsideTidepool inside;
  s.tp.free(dev_ptr, a.size, a.device, nullptr);
  return synced;
}

}  // extern "C"
