// The host tiers of the tiered store: pinned host memory and its pageable fallback.
//
// Pinned memory comes from slabs: anonymous mappings over-reserved and trimmed so they
// start 32 MiB-aligned, page-locked once through Backend::host_register (cudaHostRegister
// on the cuda backend: 44 ms/GiB against 393 ms/GiB for cudaHostAlloc), then handed to a
// mimalloc *exclusive* arena that only this tier's heaps allocate from. mimalloc is
// dlopen()ed RTLD_LOCAL on the first slab, never linked (Note [mimalloc is loaded
// RTLD_LOCAL] in host_arena.cpp): without it, slabs fall back like a spent budget. Requests of at
// least `direct_threshold_bytes` skip mimalloc and get a registered mapping of their own
// (mimalloc would round them up to whole 32 MiB arena blocks).
//
// The pinned budget bounds what is registered (slabs and direct mappings). The configured
// one (tidepool.pinned_budget, else a quarter of RAM) is one budget for the whole process,
// shared by every arena built without a budget of its own (each tiered store owns an arena)
// and by the host backings of the pointer-stable ranges (Note [One pinned budget per
// process] in pinned_budget.cpp). A small request whose slab does not fit in the budget
// left, but which fits itself, gets a direct mapping too (Note [A budget smaller than a
// slab] in host_arena.cpp).
//
// When the pinned budget is spent, or registration fails, allocations fall back to
// pageable host memory. The fallback is never silent: every block says its tier, the
// stats count fallback bytes and the reason, and the first fallback of an arena prints
// one warning line on stderr naming the cause (e.g. the RLIMIT_MEMLOCK cap), the budget
// that was asked for, how to raise the limit, and what it costs (copies at pageable
// speed, not asynchronous). Silenced by warn_on_pageable_fallback = false or the
// configuration key tidepool.log:off.
//
// Note [mimalloc arenas are forever]
// mimalloc 2.0.9 cannot forget an arena (and has at most 64 per process), so a slab,
// once managed, stays mapped for the life of the process. A HostArena that is destroyed
// unregisters its idle slabs and parks them in a process-wide pool that the next
// HostArena reuses. This also keeps the per-thread heaps valid: a thread's heap for an
// arena is created on first use and lives until the thread exits.
//
// Note [Empty slabs are unpinned]
// release_empty_slabs() (the empty-cache hook, tiering_registry.cpp, reaches it through
// every tiered store of the device) unregisters the slabs no block lives in and parks them
// in that process-wide pool, as the destructor does, so the pinned registration and the
// budget it held are given back; the next slab this or another arena needs is taken from
// the pool and registered again. The pages stay mapped and resident: mimalloc keeps its
// bookkeeping inside them, so they cannot be handed back to the OS (MADV_DONTNEED would
// zero it).
//
// Thread-safety: every method may be called from any thread concurrently; a block may be
// freed by a thread other than the one that allocated it. One mutex per arena guards its
// slabs, mappings and stats; the process-wide pinned charge is an atomic that arenas update
// under their own mutex, never under a common lock, and never waiting.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator/backend.h"
#include "allocator/export.h"

namespace tidepool {

enum class HostTier : std::uint8_t { pinned, pageable };
TIDEPOOL_API const char* host_tier_name(HostTier tier);

// Thrown when host memory cannot be provided (bad size, budget spent with the fallback
// disabled, the OS refused, mimalloc's arena misbehaved). The message says which.
class TIDEPOOL_API HostArenaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct HostArenaOptions {
  // Size of one mimalloc slab: a positive multiple of 32 MiB.
  std::size_t slab_bytes = std::size_t{64} << 20;
  // Requests this large or larger get a registered mapping of their own.
  std::size_t direct_threshold_bytes = std::size_t{4} << 20;
  // Pinned bytes this arena may register (slabs + direct mappings), its own: no other
  // arena's registrations count against it. 0 means: the configured
  // tidepool.pinned_budget (allocator/tier_routing.h) when there is one, else a quarter of
  // physical memory; that budget is the process's, shared with every other arena built
  // with 0 (Note [One pinned budget per process] in pinned_budget.cpp).
  std::size_t pinned_budget_bytes = 0;
  // Cap the budget at RLIMIT_MEMLOCK when that limit is finite. Off by default: neither
  // backend pins through mlock (cudaHostRegister pins in the driver, which RLIMIT_MEMLOCK
  // does not bound; the host backend only records registrations), so on a machine with the
  // usual 8 MiB limit the cap sent all but 8 MiB of the state to pageable memory, which
  // the GPU copies at a fraction of the pinned rate without overlap (a suspect for the
  // tiered optimizer steps at 1/15 of the link on the H200, 2026-12-04). For a backend that
  // pins with mlock.
  bool respect_memlock_limit = false;
  // Serve from pageable memory when pinned memory is unavailable (else throw).
  bool allow_pageable_fallback = true;
  // Print one "tidepool: ..." line on stderr at this arena's first pageable fallback
  // (see above). The configuration key tidepool.log:off (allocator/config.h) silences it
  // too, once applied (tidepool::install_from_env, or the Python package at import: a
  // C++ program that calls neither applies no configuration, whatever the environment
  // says). Stats count it either way.
  bool warn_on_pageable_fallback = true;
  // The mimalloc the slabs use, dlopen()ed RTLD_LOCAL on the first slab. When it cannot
  // be loaded, slab-sized requests fall back (or throw) with a reason naming it.
  std::string mimalloc_library = "libmimalloc.so.2";
};

// One host allocation. Hand the whole block back to deallocate().
struct HostBlock {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  HostTier tier = HostTier::pinned;
  explicit operator bool() const { return ptr != nullptr; }
};

struct HostArenaStats {
  std::size_t pinned_budget_bytes = 0;
  std::size_t pinned_budget_requested_bytes = 0;  // before the RLIMIT_MEMLOCK cap
  bool budget_capped_by_memlock = false;
  bool budget_from_config = false;  // tidepool.pinned_budget set it (no explicit option)
  // The budget is the process's, shared with the other arenas built without a budget of
  // their own (from the configuration or the default); false for an explicit one.
  bool budget_shared = false;
  std::size_t pinned_registered_bytes = 0;  // slabs + direct mappings now registered
  std::size_t slab_count = 0;
  std::size_t direct_count = 0;
  // Small blocks mapped directly because mimalloc had no arena left for another slab
  // (Note [When mimalloc has no arena left] in host_arena.cpp).
  std::uint64_t direct_after_no_arena = 0;
  // Small blocks mapped directly because the budget left was less than a slab (Note [A
  // budget smaller than a slab] in host_arena.cpp).
  std::uint64_t direct_budget_below_slab = 0;
  std::size_t pinned_in_use_bytes = 0;
  std::size_t pinned_peak_bytes = 0;
  std::uint64_t pinned_allocs = 0;
  std::size_t pageable_in_use_bytes = 0;
  std::size_t pageable_peak_bytes = 0;
  std::uint64_t pageable_allocs = 0;        // fallbacks, by any reason
  std::uint64_t fallback_budget = 0;         // ... because the pinned budget was spent
  std::uint64_t fallback_register_failed = 0;  // ... because host_register failed
  std::uint64_t fallback_no_mimalloc = 0;      // ... because libmimalloc could not be loaded
  std::uint64_t fallback_other = 0;  // ... for another reason (mmap of a slab failed, ...)
  std::uint64_t register_failures = 0;
  // Slabs release_empty_slabs() unregistered, and those the backend would not unregister
  // (they stay registered, in this arena).
  std::uint64_t slabs_released = 0;
  std::uint64_t slab_release_failures = 0;
  // Mappings the backend would not unregister when they were let go (a freed block's direct
  // mapping, or a slab mimalloc would not take): kept mapped, registered and charged (a
  // mapping unmapped while registered left the driver's registration of its addresses
  // behind), given back by a later release_empty_slabs or the arena's destructor.
  std::uint64_t direct_release_failures = 0;
  std::size_t direct_held_after_failure_bytes = 0;
  std::string last_fallback_reason;
  bool fallback_warned = false;  // the stderr warning was printed (once per arena)
};

class TIDEPOOL_API HostArena {
 public:
  // Validates the options (throws HostArenaError naming the bad one). Maps nothing yet.
  HostArena(Backend& backend, HostArenaOptions options = {});
  // Pre: every block was deallocated. Blocks still live are leaked, with their slab or
  // direct mapping, which stay mapped, registered and charged to the budget (a copy may
  // still touch them: ~TieredStore skips deallocate when the device cannot be
  // synchronized). Never throws: a backend failure is reported on stderr (teardown.h).
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Pre: bytes > 0. Post: a 256-byte aligned block of at least `bytes`, pinned when the
  // budget and the backend allow, else pageable (if allowed). Throws HostArenaError.
  HostBlock allocate(std::size_t bytes);
  // A pinned block of `bytes`, or an empty block when the budget or the backend cannot
  // pin one now: never the pageable fallback, so nothing is counted or said as one. The
  // tiered store moves a pageable block into pinned memory with it (Note [Pageable blocks
  // are promoted] in host_promotion.cpp). A refusal says whether the budget was what
  // stopped it (then asking again maps and registers nothing until it has room). Throws
  // HostArenaError (a bad size; mimalloc misbehaving) or std::bad_alloc, as allocate does.
  struct PinnedAttempt {
    HostBlock block;
    bool budget_spent = false;  // no block: the pinned budget had no room for it
  };
  PinnedAttempt try_allocate_pinned(std::size_t bytes);
  // Pre: `block` came from allocate() or try_allocate_pinned() of this arena and is freed
  // once.
  void deallocate(const HostBlock& block);
  // Changes each time pinned room may have been made: a pinned block of this arena freed,
  // or pinned bytes given back to its budget or to the process's. A try_allocate_pinned
  // that failed is worth asking again only once this changed.
  std::uint64_t pinned_room_epoch() const noexcept;

  // Note [Empty slabs are unpinned]. Returns the bytes unregistered. Never throws: a slab
  // the backend would not unregister is kept as it was and counted (slab_release_failures).
  // Also tries again the freed direct mappings the backend would not unregister then
  // (Note [A registration that would not go] in host_arena.cpp).
  std::size_t release_empty_slabs() noexcept;

  HostArenaStats stats() const;
  // The budget as the last allocation resolved it (Note [What an arena charges]).
  std::size_t pinned_budget_bytes() const;
  Backend& backend() const { return backend_; }

  struct Slab;  // defined in host_arena.cpp

 private:
  // Size checks shared by allocate and try_allocate_pinned (HostArenaError).
  static void check_request(std::size_t bytes);
  // Pinned memory for `bytes` and its stats, or nullptr with why_not set.
  void* allocate_pinned_locked(std::size_t bytes, std::string* why_not);
  void* allocate_in_slabs(std::size_t bytes);                 // nullptr: slabs are full
  void* allocate_in_slab(Slab& slab, std::size_t bytes);     // nullptr: this one is full
  Slab* add_slab(std::size_t bytes, std::string* why_not);    // nullptr: why_not says
  void* allocate_direct_pinned(std::size_t bytes, std::string* why_not);
  // Unregisters, unmaps and uncharges a freed direct mapping; false (nothing changed) when
  // the backend would not unregister it (Note [A registration that would not go]).
  bool release_direct_locked(void* p, std::size_t mapped) noexcept;
  // release_direct_locked, or, when the backend would not unregister it, keeps the mapping
  // in unreleased_direct_ (pre: room reserved there) and counts it.
  void release_or_keep_locked(void* p, std::size_t mapped) noexcept;
  HostBlock allocate_pageable(std::size_t bytes, const std::string& reason);
  bool register_range(void* ptr, std::size_t bytes, std::string* why_not);
  // Takes `bytes` of the budget before they are registered (false: why_not says the budget
  // is spent), and gives them back once unregistered or when registering failed.
  bool charge(std::size_t bytes, std::string* why_not);
  // Sets budget_ (and the stats that describe it) from the options and the configuration.
  void resolve_budget_locked();
  void uncharge(std::size_t bytes) noexcept;

  Backend& backend_;
  HostArenaOptions options_;
  std::size_t budget_ = 0;
  mutable std::mutex mutex_;
  std::vector<Slab*> slabs_;  // owned by the process-wide slab pool
  std::unordered_map<void*, std::size_t> direct_;  // direct mappings: ptr -> mapped bytes
  // Note [A registration that would not go]: freed direct mappings still registered.
  std::vector<std::pair<void*, std::size_t>> unreleased_direct_;
  HostArenaStats stats_;
  // Pinned blocks freed and bytes uncharged by this arena (pinned_room_epoch).
  std::atomic<std::uint64_t> pinned_frees_{0};
};

}  // namespace tidepool
