// Pointer-stable migration: memory that PyTorch (or anyone) holds by pointer moves
// between device memory and host memory while the pointer stays the same.
//
// A VmmPool allocation is a reserved virtual range backed, through the seam's VA API, by
// physical chunks of whole 2 MiB granules (at most chunk_granules per chunk, so a move is
// a few large copies rather than hundreds of small ones). migrate(ptr, to) moves every
// chunk not already in `to`:
//   1. wait until the streams that used the range (record_use) have passed their work;
//   2. find physical memory in `to` for each chunk (a spare host backing a move to the
//      device left, else a new one, created by helper threads while earlier chunks copy),
//      map it at a scratch range, copy the chunk there, batch_chunks chunks per wait;
//   3. unmap the chunk at the original address and map the new backing in its place;
//   4. keep the old backing as a spare (host backings, up to a limit) or release it.
// (Note [Migration batches] and Note [Spare host backings] in vmm_backings.cpp.)
// The virtual address never changes. A failure at any step (no memory in `to`, a copy
// or map that fails) undoes that step for the chunks not yet swapped and throws
// TieringError; chunks swapped before the failure stay moved, and every byte stays
// readable at the same address. A backing whose release fails is kept and released at a
// later call (Note [Deferred releases] in vmm_backings.cpp): no physical memory is lost
// or released twice.
//
// Note [VMM device budget]
// Moving state to the device (a prefetch before the optimizer step) respects a device
// budget for the pool: by default tidepool.state_budget (allocator/tier_routing.h) when
// the configuration enables tidepool, else none. A migration to the device moves a
// chunk only if the pool's device-backed bytes stay within the budget with it; a chunk
// that would exceed it stays on the host (still readable at the same address, over the
// link), a later smaller one may still fit, and the result says how many bytes stayed.
// Prefetching never exceeds the budget; a budget of 0 moves nothing.
// Allocation is not limited by the budget (new state is created where it is asked for);
// only migration towards the device is. But where the budget is shared and an allocation
// on the device would pass it, the device's tiered stores are first asked to give room
// back (their released handles, furthest next use first; Note [Shared state budget] in
// device_budget_ledger.h), so that new state pushes out state no step holds before the
// device goes over; the allocation then goes ahead whatever they gave. Only what the
// stores cannot give (acquired handles) and the pool's own ranges can take the device
// past the budget.
// The configured budget is the device's: a pool that takes it shares it with the
// device's tiered stores built from the configuration, so that the chunks it keeps on the
// device and their handles together stay within it (Note [Shared state budget] in
// device_budget_ledger.h). A migration takes free room only: it never makes a store
// evict, and no store evicts a range.
//
// On the cuda backend `to == host` is CU_MEM_LOCATION_TYPE_HOST_NUMA memory the GPU
// reaches over the link; on the host backend memfd_create + mmap(MAP_FIXED), so this
// logic runs in CI. Host backings are pinned memory, so they are charged to the pinned
// budget, by default the process's (tidepool.pinned_budget, else a quarter of RAM), which
// the tiered stores' host arenas share: a move to the host stops where the budget has no
// room, the rest of the range staying on the device (Note [Pinned host backings] in
// vmm_backings.cpp).
//
// A stream record_use names stays a user of the range until release_stream: every later
// migrate and the deallocate wait for the work queued on it then (PyTorch's contract: a
// block's stream, and those record_stream names, use it for as long as it lives).
// release_stream waits only for a stream some range names; any other costs nothing.
//
// Thread-safety: every method may be called from any thread concurrently. A migration may
// create new backings on helper threads of its own (VmmPoolOptions::creation_threads);
// they call only create_backing (Backend::create_physical, a host backing charged to the
// pinned budget first: an atomic count, and the configuration's lock to read the budget)
// and have ended when it returns.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "allocator/backend.h"
#include "allocator/export.h"
#include "tiering/device_budget_ledger.h"

namespace tidepool {

class Teardown;

struct VmmStats {
  std::uint64_t ranges = 0;
  std::uint64_t device_backed_bytes = 0;
  std::uint64_t host_backed_bytes = 0;
  std::uint64_t migrations_to_host = 0;    // chunks moved
  std::uint64_t migrations_to_device = 0;
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_to_device = 0;
  double migration_ms = 0;  // wall time inside migrate(), waits for users excluded
  // Migrations of a range that threw: a migrate() call, or the range of a migrate_tag()
  // it stopped at, counted once whether the pool declined it (a chunk not mapped back
  // yet: Note [Deferred releases] in vmm_backings.cpp), the streams that used the range
  // could not be waited for, or a step failed after other chunks had moved. Not counted:
  // bad input (a pointer the pool does not own) and a move the device budget or the
  // pinned budget cut short (budget_stops, pinned_budget_stops), none of which is the
  // pool's failure.
  std::uint64_t failed_migrations = 0;
  // Note [VMM device budget]
  bool has_device_budget = false;
  std::uint64_t device_budget_bytes = 0;  // when has_device_budget
  std::uint64_t budget_stops = 0;         // migrations to the device it cut short
  std::uint64_t bytes_left_on_host = 0;   // bytes those migrations left on the host
  // The budget is the device's, shared with its tiered stores built from the
  // configuration (Note [Shared state budget]), which hold budget_peer_bytes of it now.
  bool budget_shared = false;
  std::uint64_t budget_peer_bytes = 0;
  // Allocations on the device that asked those stores for room, and the bytes the stores
  // gave back for them (Note [VMM device budget]).
  std::uint64_t budget_room_requests = 0;
  std::uint64_t budget_room_given_bytes = 0;
  // Note [Deferred releases] in vmm_backings.cpp: backings no longer in use whose release
  // failed, retried at every later call.
  std::uint64_t deferred_releases = 0;
  std::uint64_t deferred_release_bytes = 0;
  // Note [A lost use stream] in vmm_migration.cpp: waits for a range's users that
  // synchronized the device because a recorded stream was destroyed unreleased.
  std::uint64_t lost_stream_syncs = 0;
  // Where migration time goes (Note [Migration batches] in vmm_moves.cpp). The phases
  // overlap (backings are created by helper threads while earlier chunks copy), so they
  // need not add up to migration_ms.
  std::uint64_t migration_batches = 0;   // copy batches, one stream synchronize each
  std::uint64_t migration_backend_calls = 0;  // creates, maps, unmaps, copies, syncs,
                                              // releases
  std::uint64_t backings_created = 0;    // new physical backings migrations created
  std::uint64_t spare_host_reuses = 0;   // spare host backings migrations took instead
  double create_ms = 0;       // creating backings, summed over the threads creating them
  double create_wait_ms = 0;  // migrations waiting for a backing still being created
  double copy_wait_ms = 0;    // migrations waiting for their batches' copies
  double remap_ms = 0;        // map and unmap calls (scratch range and the ranges)
  double release_ms = 0;      // releasing old backings not kept as spares
  // Note [Spare host backings] in vmm_backings.cpp: host backings kept for the next move to
  // the host.
  std::uint64_t spare_host_backings = 0;
  std::uint64_t spare_host_bytes = 0;
  // Note [Pinned host backings] in vmm_backings.cpp: the pinned budget the host backings are
  // charged to (the process's unless VmmPoolOptions::pinned_budget_bytes gave the pool one
  // of its own), the bytes the pool has charged to it now (host backings mapped, spare,
  // created ahead of a move, or waiting for a deferred release), the moves to the host it
  // cut short and the bytes those left on the device, and the chunks it found no pinned
  // room for (those moves' and allocations', once retried).
  bool pinned_budget_shared = false;
  std::uint64_t pinned_budget_bytes = 0;
  std::uint64_t pinned_bytes = 0;
  std::uint64_t pinned_budget_stops = 0;
  std::uint64_t bytes_left_on_device = 0;
  std::uint64_t pinned_budget_refusals = 0;
};

struct VmmPoolOptions {
  // Note [VMM device budget]. kDeviceBudgetFromConfig: tidepool.state_budget, read at
  // each migration (the configuration may be applied after the pool exists), and shared
  // with the device's tiered stores (its device-backed bytes are charged to the device's
  // ledger from the start, so that stores built later see them); kNoDeviceBudget:
  // unlimited; any other value is the budget in bytes, the pool's alone.
  static constexpr std::size_t kDeviceBudgetFromConfig = static_cast<std::size_t>(-1);
  static constexpr std::size_t kNoDeviceBudget = static_cast<std::size_t>(-2);
  std::size_t device_budget_bytes = kDeviceBudgetFromConfig;
  // Note [Spare host backings] in vmm_backings.cpp: the most bytes of host backing kept for
  // the next migration to the host (never more than the pool's device-backed bytes, the
  // most such a migration can use). kSpareHostUpToDevice: that bound only; 0: none kept.
  static constexpr std::size_t kSpareHostUpToDevice = static_cast<std::size_t>(-1);
  std::size_t spare_host_bytes = kSpareHostUpToDevice;
  // Note [Migration batches] in vmm_moves.cpp: threads that create a migration's new
  // backings while its earlier chunks copy (0 or 1: the migrating thread creates each one
  // when it needs it).
  unsigned creation_threads = 4;
  // Note [Migration batches]: chunks copied between two waits for the migration stream
  // (at least 1); the scratch range holds that many chunks.
  std::size_t batch_chunks = 8;
  // Granules per chunk (at least 1): the unit a migration moves and the device budget
  // counts. Tests make it small, so that a range of several chunks is a few MiB.
  static constexpr std::size_t kDefaultChunkGranules = 32;  // 64 MiB at 2 MiB granularity
  std::size_t chunk_granules = kDefaultChunkGranules;
  // Note [Pinned host backings] in vmm_backings.cpp: the most bytes of host backing the pool
  // may hold. kProcessPinnedBudget: the process's pinned budget (tidepool.pinned_budget,
  // else a quarter of RAM), read at each charge and shared with the host arenas and the
  // other pools that use it; any other value is the budget in bytes, the pool's alone.
  static constexpr std::size_t kProcessPinnedBudget = static_cast<std::size_t>(-1);
  std::size_t pinned_budget_bytes = kProcessPinnedBudget;
};

// What a migration did.
struct MigrationResult {
  std::size_t ranges = 0;       // ranges visited
  std::size_t bytes_moved = 0;  // backing moved to the target
  // Bytes that stayed where they were: towards the device, those the device budget (or the
  // device's memory) had no room for; towards the host, those the pinned budget had no
  // room for (Note [Pinned host backings] in vmm_backings.cpp).
  std::size_t bytes_left = 0;

  // Adds up the results of several ranges (migrate_tag, migrate_ranges_holding).
  MigrationResult& operator+=(const MigrationResult& other) {
    ranges += other.ranges;
    bytes_moved += other.bytes_moved;
    bytes_left += other.bytes_left;
    return *this;
  }
};

class TIDEPOOL_API VmmPool {
 public:
  // Granules per chunk unless VmmPoolOptions::chunk_granules says otherwise.
  static constexpr std::size_t kChunkGranules = VmmPoolOptions::kDefaultChunkGranules;
  // The largest range allocate takes (64 TiB, beyond any device and host); a larger
  // request is refused as absurd (a negative size cast to unsigned, most likely).
  static constexpr std::size_t kMaxRangeBytes = std::size_t{1} << 46;

  explicit VmmPool(Backend& backend, VmmPoolOptions options = {});
  // Frees every range still allocated. Never throws (teardown.h): a backend failure is
  // reported on stderr and what can be released still is; a range that work may still
  // use, or that stays partly mapped, is kept instead (Note [Ranges kept at teardown] in
  // vmm_migration.cpp).
  ~VmmPool();
  VmmPool(const VmmPool&) = delete;
  VmmPool& operator=(const VmmPool&) = delete;

  // A range of at least `bytes` (rounded up to whole granules) backed in `where`.
  // Returns nullptr when `where` is out of memory (the host is when the pinned budget has
  // no room for the range); throws TieringError for bad input
  // (bytes == 0) and BackendError-caused failures (as TieringError).
  void* allocate(std::size_t bytes, int tag, MemoryLocation where = MemoryLocation::device);
  // A range of at least `bytes` placed chunk by chunk as a prefetch would place it: on the
  // device while the device budget has free room for the chunk, and on the host past it
  // or when the device has no memory for it; all on the device when there is no budget;
  // a chunk the host has no room for (the pinned budget spent) on the device past the
  // budget (Note [New state where the budget puts it] in vmm_migration.cpp). Returns
  // nullptr only when neither has memory for a chunk; throws as allocate().
  void* allocate_within_budget(std::size_t bytes, int tag);
  // Waits for the streams recorded as users (record_use), then unmaps and releases the
  // range. Pre: ptr came from allocate(). Throws TieringError for a pointer the pool does
  // not own, and when an unmap fails: the range then stays allocated, less what was
  // already unmapped, and a later deallocate goes on from there.
  void deallocate(void* ptr);

  // Notes that work on `stream` uses the range holding `ptr`; every later migrate() and
  // deallocate() waits for the work queued on it by then, until release_stream(stream)
  // (a stream destroyed without it is waited for once by a device synchronization, then
  // forgotten: Note [A lost use stream] in vmm_migration.cpp).
  void record_use(const void* ptr, Stream stream);
  // `stream` is about to be destroyed. When a range names it as a user (record_use):
  // waits for its work, then forgets it on every range (a later migrate or deallocate
  // would otherwise wait on a dead handle), and returns true; a wait that fails (a stream
  // the backend no longer knows) throws BackendError before anything changed. A stream no
  // range names returns false at once, with no backend call (Note [Releasing a stream no
  // range used] in vmm_migration.cpp).
  bool release_stream(Stream stream);
  // Moves the range holding `ptr` to `to`, keeping its address: to the host as much as
  // the pinned budget allows (Note [Pinned host backings] in vmm_backings.cpp); to the device
  // as much as the device budget allows (Note [VMM device budget]).
  // Throws TieringError (unknown pointer, a failed step; data stays readable at the same
  // address, or again from the next call when a failed remap could map neither backing
  // there: Note [Deferred releases] in vmm_backings.cpp).
  // With `range_id` (range_id(ptr) when the caller listed it; 0: any): a range freed since
  // (its address maybe taken by a new range, whose owner places it) is not moved, and an
  // empty result comes back, no error.
  MigrationResult migrate(const void* ptr, MemoryLocation to, std::uint64_t range_id = 0);
  // migrate() for every range with `tag`, in allocation order, oldest first: towards the
  // device as much as fits the budget, so a budget-limited prefetch brings back the
  // state allocated first (for an optimizer, its first parameters, which its step uses
  // first); the rest is counted in bytes_left. Ranges freed meanwhile are skipped; one
  // allocated meanwhile is not visited. The C ABI's evict and prefetch by tag use it.
  MigrationResult migrate_tag(int tag, MemoryLocation to);
  // migrate() for the ranges holding `ptrs`, in the order the pointers come: each range
  // once (views and interior pointers of one range name it again), towards the device as
  // much as fits the budget, so a budget-limited prefetch of one optimizer's state brings
  // back what its step uses first. A pointer no range holds (nullptr, ordinary device
  // memory) is skipped. Ranges freed meanwhile are not visited, nor one allocated meanwhile
  // at a named address (each pointer names the range that held it when the call began).
  // The C ABI's prefetch and evict by pointers use it.
  MigrationResult migrate_ranges_holding(std::span<const void* const> ptrs, MemoryLocation to);
  // The base addresses of the ranges with `tag` that have device-backed chunks and hold
  // none of `except`, in allocation order, oldest first: what is on the device beyond
  // the ranges the caller names (the Python hooks learn from it, after a step, the state
  // an optimizer keeps outside optimizer.state: Note [state outside optimizer.state]).
  // With `ids`, their range_id()s (as many, under the same lock), for migrate.
  std::vector<void*> device_backed_ranges(int tag, std::span<const void* const> except,
                                          std::vector<std::uint64_t>* ids = nullptr) const;
  // The device budget in force now (nullopt: none). Note [VMM device budget].
  std::optional<std::size_t> device_budget_bytes() const;

  bool owns(const void* ptr) const;
  // The identity of the range holding `ptr`: its allocation sequence number, which no
  // other range of this pool is given (a base address may be taken again once its range
  // is freed); 0 if no range holds `ptr`.
  std::uint64_t range_id(const void* ptr) const;
  // range_id of each of `ptrs` into `ids` (as many), under one lock: the Python hooks ask
  // for every state tensor of the optimizers at once, after each step.
  void range_ids(std::span<const void* const> ptrs, std::span<std::uint64_t> ids) const;
  // Base address and rounded size of the range holding `ptr` (nullptr/0 if none).
  void* base_of(const void* ptr) const;
  std::size_t size_of(const void* ptr) const;
  // Bytes of the range holding `ptr` backed in `where`.
  std::size_t bytes_in(const void* ptr, MemoryLocation where) const;

  VmmStats stats() const;
  Backend& backend() const { return backend_; }
  // Releases the spare host backings now (Note [Spare host backings] in vmm_backings.cpp):
  // the next migration to the host creates what it needs. Never throws: a release that
  // fails is deferred (Note [Deferred releases]). tidepool_empty_cache calls it for the
  // tiering registry's pool (Note [empty_cache releases the spares] there).
  void release_spare_host_backings();

 private:
  struct Chunk {
    std::size_t offset;
    std::size_t bytes;
    PhysicalHandle physical;
    MemoryLocation where;
    // False after a failed migration could not map either backing back (Note [Deferred
    // releases]): `physical` holds the data and repair_locked maps it again.
    bool mapped = true;
  };
  struct DeferredRelease {
    PhysicalHandle physical;
    std::size_t bytes;
    MemoryLocation where;  // a host backing stays charged until it is released
  };
  // A new physical backing, null when its location had no memory for it or, for a host
  // backing, the pinned budget had no room (pinned_budget_spent).
  struct NewBacking {
    PhysicalHandle handle;
    bool pinned_budget_spent = false;
  };
  // A backing mapped at the scratch range, at `offset` (Note [Migration batches]).
  struct ScratchSlot {
    std::size_t offset;
    std::size_t bytes;
  };
  class BackingSupply;  // vmm_backing_supply.h
  struct Range {
    char* base = nullptr;
    std::size_t bytes = 0;
    int tag = 0;
    std::uint64_t sequence = 0;  // allocation order (migrate_tag)
    std::vector<Chunk> chunks;
    std::vector<Stream> use_streams;
  };

  Range* find_locked(const void* ptr);
  const Range* find_locked(const void* ptr) const;
  // Throws TieringError when a wait fails; a stream that can no longer take an event
  // (destroyed) is waited for by a device synchronization (Note [A lost use stream]).
  void wait_for_users_locked(Range& r);
  void synchronize_for_lost_stream_locked(Stream lost, const BackendError& record_error);
  // Note [Migration batches]: moves the chunks plan[i] of `r` (indices into r.chunks, in
  // order) to `to`; `moved` counts those swapped so far (they are swapped in plan order).
  // It stops, without an error, at the first chunk the device has no memory for (Note [A
  // device with no room for a prefetch]) or, towards the host, the pinned budget has no
  // room for (Note [Pinned host backings]): plan[moved, end) stay.
  void move_planned_locked(Range& r, const std::vector<std::size_t>& plan, MemoryLocation to,
                           std::size_t& moved, MigrationResult& result, BackingSupply* supply);
  // For a call moving `ranges` to the host: a supply creating the host backings their
  // chunks need beyond the spares, ahead of the moves; null when it would not help (fewer
  // than two to create, or no helper threads).
  std::unique_ptr<BackingSupply> host_supply_locked(const std::vector<const Range*>& ranges);
  // Hands back what `supply` made and no move took (Note [Spare host backings]), and adds
  // its figures to the stats.
  void finish_supply_locked(BackingSupply& supply);
  // Runs `moves` (which locks per range), then finishes `supply` (if any) under the lock,
  // also when `moves` throws: a multi-range migration's backings all go back or are kept.
  MigrationResult with_supply(std::unique_ptr<BackingSupply>& supply,
                              const std::function<MigrationResult()>& moves);
  // Of chunk `sizes` about to move to the host, those the spares do not cover.
  std::vector<std::size_t> sizes_beyond_spares_locked(const std::vector<std::size_t>& sizes) const;
  // The chunks plan[begin, end) of `r`, one batch; `moved`
  // counts the planned chunks swapped so far (they are swapped in plan order). False when
  // the device had no memory for one of them, or the pinned budget no room: the batch's
  // chunks before it moved, and no later one is to be tried.
  bool move_batch_locked(Range& r, const std::vector<std::size_t>& plan, std::size_t begin,
                         std::size_t end, MemoryLocation to, BackingSupply& supply,
                         std::size_t& moved, MigrationResult& result);
  // The chunk's new backing, copied and mapped at the scratch slot `slot`, in its place.
  void swap_chunk_locked(Range& r, Chunk& c, PhysicalHandle fresh, std::size_t slot,
                         MemoryLocation to);
  // Where allocate_range puts a range's chunks.
  enum class Placement { device, host, within_budget };
  void* allocate_range(std::size_t bytes, int tag, Placement placement);
  // Note [Pinned host backings]: every backing the pool creates and releases goes through
  // these two, which charge host ones to the pinned budget first and give the charge back
  // once released. create_backing may run without the lock (BackingSupply's helpers);
  // release_backing throws the backend's error, the charge then kept.
  NewBacking create_backing(std::size_t bytes, MemoryLocation where);
  void release_backing(PhysicalHandle physical, std::size_t bytes, MemoryLocation where);
  bool charge_pinned(std::size_t bytes);
  // After create_backing (or a supply) refused a host backing for the budget: releases
  // spares (of other sizes) for room when they make enough, tries once more, and counts
  // the refusal (pinned_budget_refusals) if that is refused too.
  NewBacking retry_refused_host_backing_locked(std::size_t bytes);
  void uncharge_pinned(std::size_t bytes) noexcept;
  // The budget is the process's (not one of the pool's own), and the bytes charged
  // against it now: the process's count, or the pool's.
  bool pinned_budget_shared() const;
  std::size_t pinned_bytes_against_budget() const;
  std::size_t pinned_budget_now() const;
  // Said once per pool: a move to the host, or new state, found the pinned budget spent.
  void warn_pinned_budget_spent_locked(std::size_t bytes);
  // Note [Spare host backings].
  PhysicalHandle take_spare_locked(std::size_t bytes);
  void keep_or_release_locked(PhysicalHandle old, std::size_t bytes, MemoryLocation where);
  std::size_t spare_limit_locked() const;
  void trim_spares_locked() noexcept;
  // Releases spares, largest first, until at most `limit` bytes of them are left.
  void release_spares_beyond_locked(std::size_t limit) noexcept;
  // Pre: a spare is kept. Releases the largest; returns its bytes, or 0 when its release
  // was deferred (it stays charged until then).
  std::size_t release_largest_spare_locked();
  // The budget a migration towards `to` observes: the device budget, none towards the host.
  // Called without the lock.
  std::optional<std::size_t> budget_towards(MemoryLocation to) const;
  // Note [VMM device budget]: room for `bytes` more device-backed bytes within `budget`
  // (nullopt: none), the pool's own or, shared, all the ledger's participants'; taken
  // (charged to the ledger) when true. `taken` is the room this move took already for
  // chunks not swapped yet (a budget of the pool's own counts it; the ledger holds it).
  // give_device_room_locked: device-backed bytes gone.
  bool take_device_room_locked(std::size_t bytes, std::optional<std::size_t> budget,
                               std::size_t taken = 0);
  // Note [VMM device budget]: before an allocation of `bytes` on the device, asks the
  // stores sharing the budget to give back what the ledger lacks for it, and returns the
  // bytes they gave (nullopt: nothing was asked). Called without the lock
  // (Seat::ask_peers locks the stores).
  std::optional<std::size_t> ask_stores_for_room(std::size_t bytes);
  void give_device_room_locked(std::size_t bytes) noexcept;
  // Counts a migration that throws (VmmStats::failed_migrations) around move_range_locked.
  // `supply`: backings created ahead for the moves of this call (Note [Migration
  // batches]), or null: the move makes its own.
  MigrationResult migrate_locked(Range& r, MemoryLocation to, std::optional<std::size_t> budget,
                                 BackingSupply* supply = nullptr);
  MigrationResult move_range_locked(Range& r, MemoryLocation to,
                                    std::optional<std::size_t> budget, BackingSupply* supply);
  // Unmaps the range's chunks and releases their backings and its address. Without a
  // teardown, throws at the first failed unmap or address release; with one, records each
  // failure and goes on, and returns false when a chunk stayed mapped (the address is then
  // kept: Note [Ranges kept at teardown]).
  bool release_range_locked(Range& r, Teardown* teardown = nullptr);
  // Note [Deferred releases].
  void release_or_defer_locked(PhysicalHandle physical, std::size_t bytes,
                               MemoryLocation where);
  void repair_locked();
  // Unmaps every backing mapped at the scratch range (throws at the first that fails; the
  // rest stay listed for repair_locked), or the one at `offset`.
  void unmap_scratch_locked();
  void unmap_scratch_slot_locked(std::size_t offset);

  Backend& backend_;
  VmmPoolOptions options_;
  Stream stream_;
  Event sync_event_;
  bool warned_lost_stream_ = false;  // Note [A lost use stream]
  std::size_t chunk_bytes_ = 0;  // granularity * options_.chunk_granules
  std::size_t batch_chunks_ = 1;  // options_.batch_chunks, at least 1
  void* scratch_ = nullptr;  // reserved VA of batch_chunks_ chunks, where backings are filled
  std::size_t scratch_bytes_ = 0;
  std::vector<ScratchSlot> scratch_mapped_;  // backings mapped at scratch_ now
  // Note [Spare host backings]: by size.
  std::multimap<std::size_t, PhysicalHandle> spares_;
  std::size_t spare_bytes_ = 0;
  // Note [Deferred releases].
  std::vector<DeferredRelease> deferred_releases_;
  std::size_t unmapped_chunks_ = 0;  // chunks with mapped == false, in all ranges
  mutable std::mutex mutex_;
  std::map<const char*, Range> ranges_;  // by base address
  std::uint64_t next_sequence_ = 1;  // 0 is range_id's "no range"
  VmmStats stats_;
  // The pool's seat in the device's ledger with a budget from the configuration (Note
  // [Shared state budget]), else null. It charges stats_.device_backed_bytes.
  std::unique_ptr<DeviceBudgetLedger::Seat> shared_;
  // Note [Pinned host backings]: what the pool's host backings have charged now, and the
  // host backings the budget refused. Atomic: BackingSupply's helpers create without the
  // lock.
  std::atomic<std::size_t> pinned_charged_{0};
  std::atomic<std::uint64_t> pinned_refusals_{0};
  bool warned_pinned_budget_ = false;
};

// Ranges that VmmPool destructors in this process kept mapped (leaked) instead of
// unmapping them (Note [Ranges kept at teardown] in vmm_migration.cpp).
TIDEPOOL_API std::uint64_t vmm_ranges_kept_at_teardown() noexcept;

}  // namespace tidepool
