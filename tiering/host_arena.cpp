// HostArena: pinned slabs sub-allocated by mimalloc exclusive arenas, direct pinned
// mappings for large requests, and the process-wide pinned budget; the pageable fallback
// is pageable_fallback.cpp.
// See host_arena.h for the design; the notes below explain the budget and the mimalloc
// details.
//
// Note [Slab alignment and the probe]
// mimalloc 2.0.9 requires an arena to start on a 32 MiB boundary and to be at least
// 32 MiB long; a misaligned region is accepted by mi_manage_os_memory_ex and then every
// allocation from it silently returns NULL (and may corrupt mimalloc's global state).
// Slabs are therefore mmap'ed 32 MiB too large and trimmed to the aligned part, and the
// first heap created for a slab makes a probe allocation that must land inside the slab.
//
// Note [No decommit of pinned pages]
// mi_manage_os_memory_ex(is_committed = true) makes mimalloc treat the arena as pinned:
// it never decommits or resets pages in it. That matters: MADV_DONTNEED on a registered
// page would silently detach it from the page the device DMAs to.
//
// Note [mimalloc is loaded RTLD_LOCAL]
// Debian's libmimalloc.so.2 is built to override malloc/free/operator new/delete. Were it
// a DT_NEEDED dependency of libtidepool.so, loading libtidepool (RTLD_GLOBAL, or before
// anything else) would hand the process two allocators, and memory from one gets freed by
// the other (this crashed python when triton's extension loaded after torch). So
// libtidepool does not link mimalloc: the first pinned slab dlopen()s it RTLD_LOCAL, whose
// symbols then bind to nobody but us, and the few mi_* functions used here are looked up
// with dlsym (typed from mimalloc.h by decltype). Not RTLD_DEEPBIND: that breaks ASan.
// Without mimalloc the slabs are unavailable (the error names the package) but direct
// pinned mappings and the pageable fallback, which use neither, keep working.
//
// Note [When mimalloc has no arena left]
// mimalloc manages at most 64 arenas per process (slabs of every HostArena, idle ones
// included), so with 64 MiB slabs about 4 GiB of small blocks fill them. Once
// mi_manage_os_memory_ex refuses a slab, no new slab is offered again (that would map
// and register 64 MiB per request only to unregister it), and a small block that fits
// in no existing slab becomes a direct pinned mapping, as large blocks are: still
// pinned, at the cost of one host_register per block (counted in
// HostArenaStats::direct_after_no_arena). Only when that fails too does it fall back to
// pageable memory.
//
// Note [A slab may not serve this thread]
// mimalloc gives each thread's heap whole segments of an arena (32 MiB in 2.0.9), so a
// 64 MiB slab serves at most two threads at once, however few bytes they hold: a slab
// whose segments other threads' heaps own returns NULL to this one. A slab taken from the
// idle pool (Note [Empty slabs are unpinned], or a destroyed arena's) can be such a slab,
// and so can any slab this arena has. So an allocation that no slab of the arena serves
// adds slabs until one does: idle ones first, then fresh ones, which always serve; each
// one added stays in the arena for the threads it can serve.
//
// Note [What an arena charges]
// An arena built without a budget of its own charges the process's pinned count (Note [One
// pinned budget per process] in pinned_budget.cpp) with what it registers: slabs and
// direct mappings, each charged before it is registered, given back when unregistered (a
// block's direct mapping freed, an empty slab released, the arena's idle slabs parked by
// its destructor) or when registering it failed. It checks the budget as it resolves it at
// each allocation (resolve_budget_locked), as the pools do at each charge. What a destroyed
// arena leaves registered (slabs and direct mappings with live blocks, a slab the backend
// would not unregister) stays charged. An arena given HostArenaOptions::pinned_budget_bytes
// checks its own registered bytes against that budget instead and charges nothing to the
// process's count. Both happen under the arena's mutex.
//
// Note [A budget smaller than a slab]
// A request below direct_threshold_bytes is served from slabs, and a slab is registered
// whole, so a budget (or what the other arenas left of the process's) smaller than one
// slab would send every small block to pageable memory although the budget has room: the
// usual trigger is respect_memlock_limit under an 8 MiB RLIMIT_MEMLOCK, against 64 MiB
// slabs. A smaller slab is no way out: mimalloc 2.0.9 needs at least 32 MiB (Note [Slab
// alignment and the probe]). So when the slab does not fit in the budget left, the block
// becomes a direct pinned mapping, as in Note [When mimalloc has no arena left]: page
// aligned (so 256-byte aligned), charged its pages, and outside every mimalloc arena.
// Only a block that does not fit either falls back, and the reason then says how much is
// registered and how much more the block needed. Counted in
// HostArenaStats::direct_budget_below_slab.
#include "tiering/host_arena.h"

#include <dlfcn.h>
#include <mimalloc.h>  // types and prototypes only: see Note [mimalloc is loaded RTLD_LOCAL]
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "allocator/config.h"
#include "allocator/stats.h"
#include "allocator/warn_once.h"
#include "tiering/host_arena_internal.h"
#include "tiering/pinned_budget.h"
#include "tiering/teardown.h"

namespace tidepool {

using host_arena_detail::fallback_cause;
using host_arena_detail::FallbackCause;
using host_arena_detail::kBlockAlign;

namespace {

constexpr std::size_t kArenaAlign = std::size_t{32} << 20;  // mimalloc 2.0.9 segment size
constexpr std::size_t kPageBytes = 4096;
constexpr const char* kNoArenaLeft =
    "mi_manage_os_memory_ex refused a slab: mimalloc manages at most 64 arenas per process";

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// The mi_* functions this file uses, from a libmimalloc loaded RTLD_LOCAL.
struct MimallocApi {
  decltype(&::mi_manage_os_memory_ex) manage_os_memory_ex = nullptr;
  decltype(&::mi_heap_new_in_arena) heap_new_in_arena = nullptr;
  decltype(&::mi_heap_malloc) heap_malloc = nullptr;
  decltype(&::mi_heap_malloc_aligned) heap_malloc_aligned = nullptr;
  decltype(&::mi_heap_delete) heap_delete = nullptr;
  decltype(&::mi_free) free = nullptr;
  std::string error;  // non-empty: the library or a function is missing, and why
  // mi_manage_os_memory_ex refused a slab: this library's arenas are all in use (mimalloc
  // allows 64 per process), so later slabs are not mapped and registered just to be
  // refused too (Note [When mimalloc has no arena left]). Never freed, as the map.
  std::atomic<bool>* arenas_exhausted = new std::atomic<bool>(false);
};

template <typename Fn>
bool resolve(void* handle, const char* name, Fn* out, std::string* error) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr && error->empty()) *error = std::string("it lacks ") + name;
  return *out != nullptr;
}

MimallocApi load_mimalloc(const std::string& soname) {
  MimallocApi api;
  // Never dlclose()d: slabs are handed to mimalloc for the life of the process.
  void* handle = dlopen(soname.c_str(), RTLD_LOCAL | RTLD_NOW);
  std::string why;
  if (handle == nullptr) {
    const char* dl_error = dlerror();
    why = dl_error != nullptr ? dl_error : "dlopen failed";
  } else {
    resolve(handle, "mi_manage_os_memory_ex", &api.manage_os_memory_ex, &why);
    resolve(handle, "mi_heap_new_in_arena", &api.heap_new_in_arena, &why);
    resolve(handle, "mi_heap_malloc", &api.heap_malloc, &why);
    resolve(handle, "mi_heap_malloc_aligned", &api.heap_malloc_aligned, &why);
    resolve(handle, "mi_heap_delete", &api.heap_delete, &why);
    resolve(handle, "mi_free", &api.free, &why);
  }
  if (!why.empty()) {
    api.error = "mimalloc is unavailable for the pinned slabs: cannot use " + soname + " (" +
                why + "); install the libmimalloc2.0 package (mimalloc >= 2.0.9)";
  }
  return api;
}

// The library `soname`, loaded (or found missing) once per process. Never destroyed:
// slabs and thread heaps keep pointing into it.
const MimallocApi& mimalloc(const std::string& soname) {
  static std::mutex mutex;
  static auto* loaded = new std::map<std::string, MimallocApi>();
  std::lock_guard lock(mutex);
  auto it = loaded->find(soname);
  if (it == loaded->end()) it = loaded->emplace(soname, load_mimalloc(soname)).first;
  return it->second;  // std::map: references stay valid as entries are added
}

// Note [Pinned memory is not forked]: a child gets none of the arena's mappings. Pinned
// pages are ones the GPU may be copying to or from: on kernels that copy pinned anonymous
// pages into the child at fork (5.9 on), every fork of the training process (a DataLoader
// starting its workers, each epoch unless they persist) would copy all the tiered state's
// host memory, tens of GiB; on older pinning the parent's next write to such a page would
// move it away from the memory the GPU uses. No child may use tidepool's memory anyway
// (Note [Forked child] in allocator/fork_guard.h). A failure only costs the fork's copy.
void exclude_from_fork(void* p, std::size_t bytes) { (void)madvise(p, bytes, MADV_DONTFORK); }

// Maps `bytes` of fresh anonymous memory starting on an `align` boundary, or nullptr.
void* map_aligned(std::size_t bytes, std::size_t align) {
  const std::size_t reserve = bytes + align;
  void* raw = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + align - 1) / align * align;
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t end = start + reserve;
  if (end > aligned + bytes)
    munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  exclude_from_fork(reinterpret_cast<void*>(aligned), bytes);
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

const char* host_tier_name(HostTier tier) {
  return tier == HostTier::pinned ? "pinned" : "pageable";
}

// ---- the process-wide slab pool -------------------------------------------------------
// See Note [mimalloc arenas are forever].

struct HostArena::Slab {
  char* base = nullptr;
  std::size_t bytes = 0;
  mi_arena_id_t arena_id = 0;
  const MimallocApi* mi = nullptr;  // the library that manages this slab
  std::size_t live_blocks = 0;  // guarded by the owning HostArena's mutex
  bool ever_used = false;       // a probe may fail on a used slab only because it is full
  Slab* next_in_pool = nullptr;  // in the idle or abandoned pool: guarded by pool_mutex()
  bool contains(const void* p) const {
    const char* c = static_cast<const char*>(p);
    return c >= base && c < base + bytes;
  }
};

namespace {

std::mutex& pool_mutex() {
  static std::mutex m;
  return m;
}
// The process-wide pools of slabs no arena holds, linked through Slab::next_in_pool (under
// pool_mutex()): giving slabs back allocates nothing. With vectors, an arena's destructor
// (or release_empty_slabs) that could not grow one under memory pressure lost the slabs,
// registered memory and mimalloc arenas included. Never destroyed: slabs outlive statics.
HostArena::Slab*& idle_slabs() {
  static HostArena::Slab* head = nullptr;
  return head;
}
// Slabs no arena may reuse (live blocks leaked by their owner, or still registered with
// a backend that failed to unregister them). Kept reachable; never destroyed.
HostArena::Slab*& abandoned_slabs() {
  static HostArena::Slab* head = nullptr;
  return head;
}
void push_slab(HostArena::Slab*& head, HostArena::Slab* slab) noexcept {
  slab->next_in_pool = head;
  head = slab;
}
// Pushes every slab of the list starting at `list` onto `head`'s.
void push_slabs(HostArena::Slab*& head, HostArena::Slab* list) noexcept {
  while (list != nullptr) {
    HostArena::Slab* next = list->next_in_pool;
    push_slab(head, list);
    list = next;
  }
}
// Unlinks and returns an idle slab of `bytes` managed by `mi`; nullptr if none.
HostArena::Slab* take_idle_slab(std::size_t bytes, const MimallocApi* mi) noexcept {
  for (HostArena::Slab** link = &idle_slabs(); *link != nullptr; link = &(*link)->next_in_pool) {
    HostArena::Slab* slab = *link;
    if (slab->bytes == bytes && slab->mi == mi) {
      *link = slab->next_in_pool;
      slab->next_in_pool = nullptr;
      return slab;
    }
  }
  return nullptr;
}

// This thread's heap for a slab's arena, created (and probed) on first use.
// Returns nullptr after throwing is impossible; throws HostArenaError on a failed probe.
mi_heap_t* thread_heap(const HostArena::Slab& slab) {
  // Keyed by the mimalloc library too: arena ids are numbered by each loaded copy of it
  // (HostArenaOptions::mimalloc_library), so two libraries' first arenas share an id, and
  // one library's heap handed to the other would corrupt both.
  using HeapKey = std::pair<const MimallocApi*, mi_arena_id_t>;
  thread_local std::map<HeapKey, mi_heap_t*> heaps;
  const HeapKey key{slab.mi, slab.arena_id};
  auto it = heaps.find(key);
  if (it != heaps.end()) return it->second;
  const MimallocApi& mi = *slab.mi;
  mi_heap_t* heap = mi.heap_new_in_arena(slab.arena_id);
  if (heap == nullptr) {
    throw HostArenaError("host arena: mi_heap_new_in_arena failed for the pinned slab at " +
                         std::to_string(reinterpret_cast<std::uintptr_t>(slab.base)));
  }
  // Note [Slab alignment and the probe]. A full slab also returns NULL, so the probe
  // only fails the set-up on a slab nothing was ever allocated from.
  void* probe = mi.heap_malloc(heap, 64);
  if (probe == nullptr && !slab.ever_used) {
    mi.heap_delete(heap);
    throw HostArenaError(
        "host arena: mimalloc returned NULL from a fresh exclusive arena (slab " +
        std::to_string(slab.bytes >> 20) + " MiB); the region must be 32 MiB-aligned and "
        "at least 32 MiB (mimalloc 2.0.9 fails silently otherwise)");
  }
  if (probe != nullptr && !slab.contains(probe)) {
    mi.free(probe);
    mi.heap_delete(heap);
    throw HostArenaError("host arena: mimalloc allocated outside the exclusive arena");
  }
  if (probe != nullptr) mi.free(probe);
  heaps.emplace(key, heap);
  return heap;
}

}  // namespace

// ---- construction -----------------------------------------------------------------------

HostArena::HostArena(Backend& backend, HostArenaOptions options)
    : backend_(backend), options_(options) {
  if (options_.slab_bytes == 0 || options_.slab_bytes % kArenaAlign != 0) {
    throw HostArenaError("host arena: slab_bytes (" + std::to_string(options_.slab_bytes) +
                         ") must be a positive multiple of 32 MiB");
  }
  if (options_.direct_threshold_bytes == 0 ||
      options_.direct_threshold_bytes > options_.slab_bytes / 2) {
    throw HostArenaError("host arena: direct_threshold_bytes must be in (0, slab_bytes/2]");
  }
  resolve_budget_locked();  // nobody else can see the arena yet
}

std::size_t HostArena::pinned_budget_bytes() const {
  std::lock_guard lock(mutex_);
  return budget_;
}

// An explicit budget wins; else tidepool.pinned_budget; else a quarter of RAM. A
// configured 0 means: no pinned memory, all of it pageable. All but the explicit one are
// the process's (Note [What an arena charges]), and read again at each allocation, as a
// VmmPool reads it at each charge: a configuration applied after the arena was built
// (install_from_env after the stores exist) holds for it too.
void HostArena::resolve_budget_locked() {
  if (options_.pinned_budget_bytes != 0) {
    budget_ = options_.pinned_budget_bytes;
  } else {
    const ProcessPinnedBudget process = process_pinned_budget();
    budget_ = process.bytes;
    stats_.budget_from_config = process.from_config;
    stats_.budget_shared = true;
  }
  stats_.pinned_budget_requested_bytes = budget_;
  stats_.budget_capped_by_memlock = false;
  if (options_.respect_memlock_limit) {
    rlimit limit{};
    if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
        limit.rlim_cur < budget_) {
      budget_ = static_cast<std::size_t>(limit.rlim_cur);
      stats_.budget_capped_by_memlock = true;
    }
  }
  stats_.pinned_budget_bytes = budget_;
}

// Never throws (teardown.h). A slab that still has live blocks, or that the backend would
// not unregister, can be handed to no other arena: it goes to the abandoned list, still
// mapped and reachable (so it is a known leak, not a lost pointer). Every direct mapping
// left holds a live block (deallocate erases the others): it is leaked too, mapped and
// registered, for a copy may still touch it (~TieredStore leaves blocks live when it cannot
// synchronize the device). What stays registered stays charged (Note [What an arena
// charges]); the slabs parked in the pool give their charge back.
HostArena::~HostArena() {
  Teardown teardown("host arena");
  // Linked through the slabs themselves (this arena's alone until they reach a pool), so
  // that nothing here allocates.
  Slab* reusable = nullptr;
  Slab* abandoned = nullptr;
  for (Slab* slab : slabs_) {
    if (slab->live_blocks == 0 &&
        teardown.attempt("unregistering a slab", [&] { backend_.host_unregister(slab->base); })) {
      uncharge(slab->bytes);
      push_slab(reusable, slab);
    } else {
      push_slab(abandoned, slab);
    }
  }
  // Note [A registration that would not go]: a last try; one that still fails stays
  // mapped, registered and charged.
  for (const auto& [p, mapped] : unreleased_direct_) {
    if (teardown.attempt("unregistering a freed mapping", [&] { backend_.host_unregister(p); })) {
      munmap(p, mapped);
      uncharge(mapped);
    }
  }
  std::lock_guard pool_lock(pool_mutex());
  push_slabs(idle_slabs(), reusable);
  push_slabs(abandoned_slabs(), abandoned);
}

// ---- allocation ---------------------------------------------------------------------------

void HostArena::check_request(std::size_t bytes) {
  if (bytes == 0) throw HostArenaError("host arena: allocate(0)");
  if (bytes > (std::size_t{1} << 46)) {
    throw HostArenaError("host arena: absurd size " + std::to_string(bytes));
  }
}

HostBlock HostArena::allocate(std::size_t bytes) {
  check_request(bytes);
  std::lock_guard lock(mutex_);
  std::string why_not;
  if (void* p = allocate_pinned_locked(bytes, &why_not)) {
    return HostBlock{p, bytes, HostTier::pinned};
  }
  if (!options_.allow_pageable_fallback) {
    throw HostArenaError("host arena: cannot provide " + std::to_string(bytes) +
                         " pinned bytes (" + why_not + ") and the pageable fallback is off");
  }
  return allocate_pageable(bytes, why_not);
}

HostArena::PinnedAttempt HostArena::try_allocate_pinned(std::size_t bytes) {
  check_request(bytes);
  std::lock_guard lock(mutex_);
  std::string why_not;
  if (void* p = allocate_pinned_locked(bytes, &why_not)) {
    return PinnedAttempt{HostBlock{p, bytes, HostTier::pinned}, false};
  }
  return PinnedAttempt{HostBlock{}, fallback_cause(why_not) == FallbackCause::budget_spent};
}

std::uint64_t HostArena::pinned_room_epoch() const noexcept {
  // Both counts only grow, so their sum changes whenever either does.
  return pinned_frees_.load(std::memory_order_relaxed) + process_pinned_uncharges();
}

void* HostArena::allocate_pinned_locked(std::size_t bytes, std::string* why_not) {
  if (stats_.budget_shared) resolve_budget_locked();
  void* p = nullptr;
  if (bytes >= options_.direct_threshold_bytes) {
    p = allocate_direct_pinned(bytes, why_not);
  } else {
    p = allocate_in_slabs(bytes);
    // Note [A slab may not serve this thread]: slabs are added until one serves, or none
    // can be had (each added slab is registered, so the budget bounds this).
    while (p == nullptr) {
      Slab* slab = add_slab(options_.slab_bytes, why_not);
      if (slab == nullptr) {
        // Note [When mimalloc has no arena left], Note [A budget smaller than a slab]: the
        // block may still be pinned on its own.
        const bool no_arena = *why_not == kNoArenaLeft;
        if (no_arena || fallback_cause(*why_not) == FallbackCause::budget_spent) {
          p = allocate_direct_pinned(bytes, why_not);
          if (p != nullptr) {
            (no_arena ? stats_.direct_after_no_arena : stats_.direct_budget_below_slab)++;
          }
        }
        break;
      }
      p = allocate_in_slab(*slab, bytes);
    }
  }
  if (p == nullptr) return nullptr;
  stats_.pinned_in_use_bytes += bytes;
  stats_.pinned_peak_bytes = std::max(stats_.pinned_peak_bytes, stats_.pinned_in_use_bytes);
  stats_.pinned_allocs++;
  return p;
}

void* HostArena::allocate_in_slabs(std::size_t bytes) {
  // Newest slab first: older ones are the likeliest to be full.
  for (auto it = slabs_.rbegin(); it != slabs_.rend(); ++it) {
    if (void* p = allocate_in_slab(**it, bytes)) return p;
  }
  return nullptr;
}

// Note [mimalloc 2.0.9 and sizes that are multiples of the alignment]
// mi_heap_malloc_aligned(heap, n, 256) with n a multiple of 256 (up to mimalloc's medium
// object size) skips its aligning path on the assumption that such a size class is aligned
// by itself, which a page whose blocks start 128 bytes past a 256-byte boundary is not:
// with TIDEPOOL_TEST_SEED=2026, test_host_arena got a 256-byte block at an address ≡ 128
// (mod 256). So the address is checked, and a misaligned block is freed and asked for again
// with n + 1 bytes, which takes the path that over-allocates and aligns. (The check goes
// through an empty asm: mimalloc.h declares the function alloc_align, so the compiler may
// otherwise fold `p % 256` to 0.)
void* HostArena::allocate_in_slab(Slab& slab, std::size_t bytes) {
  const auto misaligned = [](void* p) {
    auto address = reinterpret_cast<std::uintptr_t>(p);
    asm volatile("" : "+r"(address));
    return address % kBlockAlign != 0;
  };
  void* p = slab.mi->heap_malloc_aligned(thread_heap(slab), bytes, kBlockAlign);
  if (p != nullptr && misaligned(p)) {
    slab.mi->free(p);
    p = slab.mi->heap_malloc_aligned(thread_heap(slab), bytes + 1, kBlockAlign);
    if (p != nullptr && misaligned(p)) {
      slab.mi->free(p);
      throw HostArenaError("host arena: mimalloc returned a block of " + std::to_string(bytes) +
                           " bytes that is not 256-byte aligned, twice");
    }
  }
  if (p == nullptr) return nullptr;
  if (!slab.contains(p)) {
    slab.mi->free(p);
    throw HostArenaError("host arena: mimalloc returned memory outside its exclusive arena");
  }
  slab.live_blocks++;
  slab.ever_used = true;
  return p;
}

bool HostArena::register_range(void* ptr, std::size_t bytes, std::string* why_not) {
  try {
    backend_.host_register(ptr, bytes);
    return true;
  } catch (const BackendError& e) {
    stats_.register_failures++;
    *why_not = std::string("host_register failed: ") + e.what();
    return false;
  }
}

// Under mutex_. The arena's registered bytes count the charge at once, so that an arena of
// its own budget checks the next charge against them; a shared one checks the process's
// count, which other arenas change meanwhile, hence the compare-and-swap.
bool HostArena::charge(std::size_t bytes, std::string* why_not) {
  const std::size_t own = stats_.pinned_registered_bytes;
  if (!stats_.budget_shared) {
    if (bytes > budget_ || own > budget_ - bytes) {
      *why_not = "pinned budget of " + std::to_string(budget_) + " bytes spent: " +
                 std::to_string(own) + " registered, " + std::to_string(bytes) + " more needed";
      return false;
    }
  } else {
    std::size_t now = 0;
    if (!charge_process_pinned(bytes, budget_, &now)) {
      *why_not = "pinned budget of " + std::to_string(budget_) +
                 " bytes (one for the process) spent: " + std::to_string(now) +
                 " pinned by all its arenas and pointer-stable ranges (" + std::to_string(own) +
                 " by this arena), " + std::to_string(bytes) + " more needed";
      return false;
    }
  }
  stats_.pinned_registered_bytes += bytes;
  return true;
}

// Under mutex_ (or in the destructor). Pre: `bytes` were charged and are no longer
// registered.
void HostArena::uncharge(std::size_t bytes) noexcept {
  stats_.pinned_registered_bytes -= bytes;
  pinned_frees_.fetch_add(1, std::memory_order_relaxed);
  if (stats_.budget_shared) uncharge_process_pinned(bytes);
}

// Every way out after charge() without a slab gives the charge back.
HostArena::Slab* HostArena::add_slab(std::size_t bytes, std::string* why_not) {
  const MimallocApi& mi = mimalloc(options_.mimalloc_library);
  if (!mi.error.empty()) {
    *why_not = mi.error;
    return nullptr;
  }
  // Both before the charge, so that nothing after them allocates except the backend's
  // registration (whose std::bad_alloc gives back what was taken): the push_back below
  // cannot throw, and a fresh slab's record exists before mimalloc gets its memory as an
  // arena, which it never gives back.
  slabs_.reserve(slabs_.size() + 1);
  auto record = std::make_unique<Slab>();
  if (!charge(bytes, why_not)) return nullptr;
  Slab* slab = nullptr;
  {
    std::lock_guard pool_lock(pool_mutex());
    slab = take_idle_slab(bytes, &mi);
  }
  if (slab != nullptr) {
    // Not registered (false, or std::bad_alloc): the slab goes back to the pool.
    const auto back_to_pool = [&] {
      std::lock_guard pool_lock(pool_mutex());
      push_slab(idle_slabs(), slab);
      uncharge(bytes);
    };
    bool registered = false;
    try {
      registered = register_range(slab->base, slab->bytes, why_not);
    } catch (...) {
      back_to_pool();
      throw;
    }
    if (!registered) {
      back_to_pool();
      return nullptr;
    }
  } else {
    if (mi.arenas_exhausted->load()) {
      uncharge(bytes);
      *why_not = kNoArenaLeft;
      return nullptr;
    }
    try {  // the one allocation a failed hand-over to mimalloc below may need; with room
           // kept for every direct block (allocate_direct_pinned)
      unreleased_direct_.reserve(unreleased_direct_.size() + direct_.size() + 1);
    } catch (...) {  // std::bad_alloc
      uncharge(bytes);
      throw;
    }
    void* base = map_aligned(bytes, kArenaAlign);
    if (base == nullptr) {
      uncharge(bytes);
      *why_not = "mmap of a " + std::to_string(bytes >> 20) + " MiB slab failed: " +
                 std::strerror(errno);
      return nullptr;
    }
    // Not registered (false, or std::bad_alloc): the mapping goes.
    const auto unmap = [&] {
      munmap(base, bytes);
      uncharge(bytes);
    };
    bool registered = false;
    try {
      registered = register_range(base, bytes, why_not);
    } catch (...) {
      unmap();
      throw;
    }
    if (!registered) {
      unmap();
      return nullptr;
    }
    mi_arena_id_t id = 0;
    // Fresh anonymous memory is zero; committed (Note [No decommit of pinned pages]).
    if (!mi.manage_os_memory_ex(base, bytes, /*is_committed=*/true, /*is_large=*/false,
                                /*is_zero=*/true, /*numa_node=*/-1, /*exclusive=*/true, &id)) {
      release_or_keep_locked(base, bytes);  // room reserved before it was mapped
      mi.arenas_exhausted->store(true);
      *why_not = kNoArenaLeft;
      return nullptr;
    }
    *record = Slab{static_cast<char*>(base), bytes, id, &mi, 0, false};
    slab = record.release();
  }
  slabs_.push_back(slab);
  stats_.slab_count++;
  return slab;
}

// Every way out after charge() without a mapping gives the charge back. The entry is made
// before the registration: its node is the one allocation that may throw.
void* HostArena::allocate_direct_pinned(std::size_t bytes, std::string* why_not) {
  const std::size_t mapped = round_up(bytes, kPageBytes);
  if (!charge(mapped, why_not)) return nullptr;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    uncharge(mapped);
    *why_not = std::string("mmap failed: ") + std::strerror(errno);
    return nullptr;
  }
  exclude_from_fork(p, mapped);
  try {
    // Room in unreleased_direct_ for every direct block and this one, so that freeing one
    // never allocates (Note [A registration that would not go]): a free that threw would
    // leave the caller's block half given back.
    unreleased_direct_.reserve(unreleased_direct_.size() + direct_.size() + 1);
    direct_.emplace(p, mapped);
  } catch (...) {  // std::bad_alloc
    munmap(p, mapped);
    uncharge(mapped);
    throw;
  }
  const auto unmap = [&] {
    direct_.erase(p);
    munmap(p, mapped);
    uncharge(mapped);
  };
  bool registered = false;
  try {
    registered = register_range(p, mapped, why_not);
  } catch (...) {  // std::bad_alloc: in the backend's bookkeeping, or for why_not's text
    unmap();
    throw;
  }
  if (!registered) {
    unmap();
    return nullptr;
  }
  stats_.direct_count++;
  return p;
}

void HostArena::deallocate(const HostBlock& block) {
  if (!block) return;
  std::lock_guard lock(mutex_);
  if (block.tier == HostTier::pageable) {
    if (block.bytes > stats_.pageable_in_use_bytes) {
      throw HostArenaError("host arena: deallocate of a pageable block it did not hand out");
    }
    std::free(block.ptr);
    stats_.pageable_in_use_bytes -= block.bytes;
    return;
  }
  if (auto it = direct_.find(block.ptr); it != direct_.end()) {
    const std::size_t mapped = it->second;
    // No allocation: room in unreleased_direct_ for this block was made when it was
    // handed out (allocate_direct_pinned), so a free of a block the arena owns cannot fail.
    direct_.erase(it);
    stats_.direct_count--;
    stats_.pinned_in_use_bytes -= block.bytes;
    release_or_keep_locked(block.ptr, mapped);
    pinned_frees_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  auto slab = std::find_if(slabs_.begin(), slabs_.end(),
                           [&](Slab* s) { return s->contains(block.ptr); });
  if (slab == slabs_.end()) {
    throw HostArenaError("host arena: deallocate of a pointer it does not own");
  }
  (*slab)->mi->free(block.ptr);
  (*slab)->live_blocks--;
  stats_.pinned_in_use_bytes -= block.bytes;
  pinned_frees_.fetch_add(1, std::memory_order_relaxed);
}

// Note [A registration that would not go]
// A mapping unmapped while the backend still has it registered is no longer ours, but the
// driver's registration of its addresses stays: the next mapping there cannot be
// registered (it would fall back to pageable memory), and the pages stay pinned though
// the budget counts them free. So a direct mapping the backend would not unregister is
// kept as a slab is (mapped, registered, charged), in unreleased_direct_, and
// release_empty_slabs tries again; one still there when the arena goes is leaked,
// charged, as its live direct mappings are (Note [What an arena charges]). The list always
// has room for every live direct mapping (made when each is handed out), so a free never
// allocates and never fails for want of heap (review finding: its reserve could throw once
// the list held one, and a tiered store's destroy then kept a handle whose dirty device
// copy it had already dropped).
bool HostArena::release_direct_locked(void* p, std::size_t mapped) noexcept {
  try {
    backend_.host_unregister(p);
  } catch (...) {  // BackendError
    return false;
  }
  munmap(p, mapped);
  uncharge(mapped);
  return true;
}

void HostArena::release_or_keep_locked(void* p, std::size_t mapped) noexcept {
  if (release_direct_locked(p, mapped)) return;
  unreleased_direct_.emplace_back(p, mapped);  // the caller reserved the room
  stats_.direct_release_failures++;
  stats_.direct_held_after_failure_bytes += mapped;
}

std::size_t HostArena::release_empty_slabs() noexcept {
  std::lock_guard lock(mutex_);
  std::size_t released = 0;
  for (auto it = unreleased_direct_.begin(); it != unreleased_direct_.end();) {
    if (!release_direct_locked(it->first, it->second)) {
      ++it;
      continue;
    }
    stats_.direct_held_after_failure_bytes -= it->second;
    released += it->second;
    it = unreleased_direct_.erase(it);
  }
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    Slab* slab = *it;
    if (slab->live_blocks != 0) {
      ++it;
      continue;
    }
    try {
      backend_.host_unregister(slab->base);
      std::lock_guard pool_lock(pool_mutex());
      push_slab(idle_slabs(), slab);
    } catch (...) {  // BackendError: the slab stays registered, and ours
      stats_.slab_release_failures++;
      ++it;
      continue;
    }
    it = slabs_.erase(it);
    uncharge(slab->bytes);
    stats_.slab_count--;
    stats_.slabs_released++;
    released += slab->bytes;
  }
  return released;
}

HostArenaStats HostArena::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace tidepool
