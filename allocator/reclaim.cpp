// Registry of reclaim hooks (see reclaim.h). The list is copied before the hooks run so a
// hook may register or unregister hooks, and no lock is held while hooks run.
#include "allocator/reclaim.h"

#include <cstdio>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

namespace tidepool {
namespace {

struct HookRegistry {
  std::mutex mutex;
  int next_id = 1;
  std::vector<std::pair<int, ReclaimHook>> hooks;
};

HookRegistry& hooks() {
  static HookRegistry* r = new HookRegistry();  // outlives static destructors
  return *r;
}

}  // namespace

int register_reclaim_hook(ReclaimHook hook) {
  if (!hook) throw std::invalid_argument("tidepool: register_reclaim_hook given an empty hook");
  HookRegistry& r = hooks();
  std::lock_guard lock(r.mutex);
  const int id = r.next_id++;
  r.hooks.emplace_back(id, std::move(hook));
  return id;
}

void unregister_reclaim_hook(int id) {
  HookRegistry& r = hooks();
  std::lock_guard lock(r.mutex);
  std::erase_if(r.hooks, [id](const auto& entry) { return entry.first == id; });
}

namespace detail {

// Note [Nested reclaim]
// A hook runs without the allocator's lock and may allocate (scratch memory to move state
// out). If that allocation runs out of memory too, asking the hooks again from inside the
// hook would call the same hook, which allocates again: a recursion that ends only when
// the stack does. So while this thread runs hooks, a nested OOM runs none: the nested
// request fails with OutOfMemoryError, which the hook may catch.
namespace {
constinit thread_local bool t_running_hooks = false;
}

ReclaimResult run_reclaim_hooks(int device, std::size_t bytes_needed) {
  if (t_running_hooks) return {};  // Note [Nested reclaim]
  t_running_hooks = true;
  struct Reset {
    ~Reset() { t_running_hooks = false; }
  } reset;
  std::vector<std::pair<int, ReclaimHook>> snapshot;
  {
    HookRegistry& r = hooks();
    std::lock_guard lock(r.mutex);
    snapshot = r.hooks;
  }
  ReclaimResult result;
  for (auto& [id, hook] : snapshot) {
    ++result.calls;
    try {
      result.bytes += hook(device, bytes_needed);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tidepool: reclaim hook %d threw during OOM handling: %s\n", id,
                   e.what());
    } catch (...) {
      std::fprintf(stderr, "tidepool: reclaim hook %d threw a non-standard exception\n", id);
    }
  }
  return result;
}

}  // namespace detail
}  // namespace tidepool
