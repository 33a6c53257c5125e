// Registries of reclaim hooks and empty-cache hooks (see reclaim.h). A list is copied
// before its hooks run so a hook may register or unregister hooks, and no lock is held
// while hooks run; an unregister waits for the calls of its hook in flight (Note
// [Unregistering a running hook]).
#include "allocator/reclaim.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tidepool {
namespace {

// Note [Unregistering a running hook]
// The runners call a copy of the list, with no lock held. So an unregister that only
// erased the entry would let a run that copied the list before it still call the hook
// after the unregister returned: after its owner had destroyed what it captured (a
// scoped hook's [&] lambda), a use after free. Each hook is therefore a slot that a run
// enters before the call and leaves after it: unregister marks the slot removed (no run
// enters it from then on) and waits until no other thread is inside. A hook that
// unregisters itself, from inside its own call, does not wait for that call. A caller of
// unregister must hold no lock the hook takes: the wait would not end.
template <class Hook>
class HookList {
 public:
  struct Slot {
    int id;
    Hook hook;
    int running = 0;       // threads inside the call, under mutex_
    bool removed = false;  // under mutex_
  };
  using Snapshot = std::vector<std::shared_ptr<Slot>>;

  // `what` names the list in messages ("reclaim hook").
  explicit HookList(const char* what) : what_(what) {}

  int add(Hook hook) {
    if (!hook) {
      throw std::invalid_argument(std::string("tidepool: register_") + what_ +
                                  " given an empty hook");
    }
    std::lock_guard lock(mutex_);
    const int id = next_id_++;
    auto slot = std::make_shared<Slot>(Slot{id, std::move(hook)});
    hooks_.push_back(std::move(slot));
    return id;
  }
  void remove(int id) {
    std::unique_lock lock(mutex_);
    auto it = std::find_if(hooks_.begin(), hooks_.end(),
                           [id](const std::shared_ptr<Slot>& slot) { return slot->id == id; });
    if (it == hooks_.end()) return;
    const std::shared_ptr<Slot> slot = *it;
    hooks_.erase(it);
    slot->removed = true;
    // Note [Unregistering a running hook]: the call this thread is inside, if any, is not
    // waited for.
    const int own = t_running_slot_ == slot.get() ? 1 : 0;
    left_.wait(lock, [&] { return slot->running <= own; });
  }
  Snapshot snapshot() {
    std::lock_guard lock(mutex_);
    return hooks_;
  }

  // Runs call(hook) for each hook of `snapshot` still registered; a hook that throws is
  // reported on stderr (`during`: what the allocator was doing) and the next one runs.
  template <class Call>
  void run_each(const Snapshot& snapshot, const char* during, Call&& call) {
    for (const std::shared_ptr<Slot>& slot : snapshot) {
      {
        std::lock_guard lock(mutex_);
        if (slot->removed) continue;
        slot->running++;
      }
      const Slot* outer = std::exchange(t_running_slot_, slot.get());
      try {
        call(slot->hook);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tidepool: %s %d threw during %s: %s\n", what_, slot->id, during,
                     e.what());
      } catch (...) {
        std::fprintf(stderr, "tidepool: %s %d threw a non-standard exception\n", what_,
                     slot->id);
      }
      t_running_slot_ = outer;
      {
        std::lock_guard lock(mutex_);
        slot->running--;
      }
      left_.notify_all();
    }
  }

 private:
  const char* what_;
  std::mutex mutex_;
  std::condition_variable left_;  // a run left a slot
  int next_id_ = 1;
  Snapshot hooks_;
  // The slot of this list whose call this thread is inside (one at most: a nested run
  // calls no hook, Note [Nested reclaim]).
  static inline thread_local const Slot* t_running_slot_ = nullptr;
};

// Never destroyed: hooks may be registered, unregistered and run during static destruction.
HookList<ReclaimHook>& reclaim_hooks() {
  static auto* list = new HookList<ReclaimHook>("reclaim hook");
  return *list;
}
HookList<EmptyCacheHook>& empty_cache_hooks() {
  static auto* list = new HookList<EmptyCacheHook>("empty-cache hook");
  return *list;
}

// Marks this thread as running hooks of one list until destroyed.
class RunningHooks {
 public:
  explicit RunningHooks(bool& flag) : flag_(flag) { flag_ = true; }
  ~RunningHooks() { flag_ = false; }
  RunningHooks(const RunningHooks&) = delete;
  RunningHooks& operator=(const RunningHooks&) = delete;

 private:
  bool& flag_;
};

}  // namespace

int register_reclaim_hook(ReclaimHook hook) { return reclaim_hooks().add(std::move(hook)); }

void unregister_reclaim_hook(int id) { reclaim_hooks().remove(id); }

int register_empty_cache_hook(EmptyCacheHook hook) {
  return empty_cache_hooks().add(std::move(hook));
}

void unregister_empty_cache_hook(int id) { empty_cache_hooks().remove(id); }

namespace detail {

// Note [Nested reclaim]
// A hook runs without the allocator's lock and may allocate (scratch memory to move state
// out). If that allocation runs out of memory too, asking the hooks again from inside the
// hook would call the same hook, which allocates again: a recursion that ends only when
// the stack does. So while this thread runs hooks, a nested OOM runs none: the nested
// request fails with OutOfMemoryError, which the hook may catch.
namespace {
constinit thread_local bool t_running_reclaim_hooks = false;
constinit thread_local bool t_running_empty_cache_hooks = false;
}  // namespace

ReclaimResult run_reclaim_hooks(int device, std::size_t bytes_needed) {
  if (t_running_reclaim_hooks) return {};  // Note [Nested reclaim]
  const RunningHooks running(t_running_reclaim_hooks);
  HookList<ReclaimHook>& list = reclaim_hooks();
  const HookList<ReclaimHook>::Snapshot snapshot = list.snapshot();
  ReclaimResult result;
  list.run_each(snapshot, "OOM handling", [&](ReclaimHook& hook) {
    ++result.calls;
    result.bytes += hook(device, bytes_needed);
  });
  return result;
}

// Note [Empty-cache hooks]
// torch.cuda.empty_cache() means "give back everything tidepool only caches", and not all
// of that is the allocator's: the tiering layer keeps the host backings of state moved
// back to the device for the next move to the host (Note [Spare host backings] in
// tiering/vmm_backings.cpp), pinned host memory up to the size of that state. The allocator
// cannot call the tiering layer, so the tiering layer registers an empty-cache hook, as
// it registers its reclaim hook.
// The C ABI runs the hooks, not CachingAllocator::empty_cache: the tiering layer itself
// empties the allocator's cache to make room on the device (a fresh range that found it
// full, Note [State pushed out under pressure] in tiering/tiering_registry.cpp), and
// there its spares are of use, since the moves to the host that follow take them. It runs
// them before emptying the allocator's cache, so that device memory a hook frees through
// the allocator goes back to the device in the same call.
// A hook that calls tidepool_empty_cache itself empties the allocator's cache but runs no
// hooks again (as Note [Nested reclaim]): it would call itself without end.
std::size_t run_empty_cache_hooks(int device) {
  if (t_running_empty_cache_hooks) return 0;  // Note [Empty-cache hooks]
  const RunningHooks running(t_running_empty_cache_hooks);
  HookList<EmptyCacheHook>& list = empty_cache_hooks();
  const HookList<EmptyCacheHook>::Snapshot snapshot = list.snapshot();
  std::size_t calls = 0;
  list.run_each(snapshot, "empty_cache", [&](EmptyCacheHook& hook) {
    ++calls;
    hook(device);
  });
  return calls;
}

}  // namespace detail
}  // namespace tidepool
