// VmmPool: VA-stable ranges whose physical backing moves between device and host.
// See vmm_migration.h for the algorithm and the failure guarantees.
#include "tiering/vmm_migration.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <unordered_set>

#include "allocator/config.h"
#include "allocator/tier_routing.h"
#include "allocator/warn_once.h"
#include "tiering/teardown.h"
#include "tiering/tiered_store.h"  // TieringError
#include "tiering/vmm_backing_supply.h"

namespace tidepool {

namespace {
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
}  // namespace

VmmPool::VmmPool(Backend& backend, VmmPoolOptions options)
    : backend_(backend), options_(options) {
  if (options_.device_budget_bytes == VmmPoolOptions::kDeviceBudgetFromConfig) {
    shared_ = std::make_unique<DeviceBudgetLedger::Seat>(
        DeviceBudgetLedger::of_device(backend_.device()));
  }
  chunk_bytes_ = backend_.granularity() * std::max<std::size_t>(1, options_.chunk_granules);
  batch_chunks_ = std::max<std::size_t>(1, options_.batch_chunks);
  scratch_bytes_ = chunk_bytes_ * batch_chunks_;
  scratch_mapped_.reserve(batch_chunks_);  // its push_backs never throw
  // No destructor runs for a constructor that throws: what was made before the failure
  // goes back here (review finding: a failed event or reservation leaked the stream).
  stream_ = backend_.create_stream();
  try {
    sync_event_ = backend_.create_event();
    scratch_ = backend_.reserve_address(scratch_bytes_);
  } catch (...) {
    try {
      if (sync_event_.handle != nullptr) backend_.destroy_event(sync_event_);
      backend_.destroy_stream(stream_);
    } catch (...) {  // the first failure is the one to report
    }
    throw;
  }
}

// Note [Ranges kept at teardown]
// Unmapping memory that queued work may still touch is worse than leaking it: the work
// would fault, or read and write whatever is mapped there next. So the destructor keeps a
// range (mapped, its backings alive, its address reserved) when it cannot tell that no
// work uses it: when the streams that used it (record_use) could not be waited for, and
// every range, with the scratch range, when the migration stream could not be drained (a
// copy left on it reads from some range and writes the scratch range). A failed unmap
// does not stop the teardown: the range's other chunks are still unmapped and every
// backing released (a mapping keeps its memory until the process ends, as it may outlive
// its handle), as are the other ranges; the range's address stays reserved, as releasing
// it under a live mapping fails or lets a later reservation overlap that mapping, and the
// range counts as kept. Kept ranges are leaked until the process ends: said in one stderr
// line per pool (always, as a teardown's failures are) and counted process-wide
// (vmm_ranges_kept_at_teardown), besides the Teardown line that counts the failed steps.
// The line names the first kKeptRangesNamed kept ranges by address and size: the Teardown
// line says what failed, this one which memory stays mapped, to match against the
// addresses a user's own tensors or a sanitizer report show.
namespace {
constexpr std::size_t kKeptRangesNamed = 4;
std::atomic<std::uint64_t> g_ranges_kept_at_teardown{0};
}  // namespace

std::uint64_t vmm_ranges_kept_at_teardown() noexcept {
  return g_ranges_kept_at_teardown.load(std::memory_order_relaxed);
}

VmmPool::~VmmPool() {
  Teardown teardown("vmm pool");
  std::lock_guard lock(mutex_);
  const bool drained = teardown.attempt("draining the migration stream",
                                        [&] { backend_.stream_synchronize(stream_); });
  std::size_t kept = 0;
  std::size_t kept_bytes = 0;
  std::string kept_named;  // Note [Ranges kept at teardown]: the first few, by address
  for (auto& [base, r] : ranges_) {
    const bool unused = drained && teardown.attempt("waiting for the streams that used a range",
                                                    [&] { wait_for_users_locked(r); });
    if (!unused || !release_range_locked(r, &teardown)) {
      if (kept < kKeptRangesNamed) {
        char one[64];
        std::snprintf(one, sizeof one, "%s%p (%zu bytes)", kept == 0 ? "" : ", ",
                      static_cast<const void*>(r.base), r.bytes);
        kept_named += one;
      }
      kept++;
      kept_bytes += r.bytes;
    }
  }
  if (kept > kKeptRangesNamed)
    kept_named += ", and " + std::to_string(kept - kKeptRangesNamed) + " more";
  ranges_.clear();
  for (const DeferredRelease& d : deferred_releases_) {
    teardown.attempt("releasing a backing whose release failed before",
                     [&] { release_backing(d.physical, d.bytes, d.where); });
  }
  deferred_releases_.clear();
  // Spares are mapped nowhere and no copy uses them (Note [Spare host backings]).
  for (const auto& [bytes, physical] : spares_) {
    teardown.attempt("releasing a spare host backing",
                     [&] { release_backing(physical, bytes, MemoryLocation::host); });
  }
  spares_.clear();
  spare_bytes_ = 0;
  if (drained) {
    if (!scratch_mapped_.empty()) {
      teardown.attempt("unmapping the scratch range", [&] { unmap_scratch_locked(); });
    }
    if (scratch_mapped_.empty()) {
      teardown.attempt("releasing the scratch range",
                       [&] { backend_.release_address(scratch_, scratch_bytes_); });
    }
  }
  teardown.attempt("destroying the sync event", [&] { backend_.destroy_event(sync_event_); });
  teardown.attempt("destroying the migration stream", [&] { backend_.destroy_stream(stream_); });
  if (kept > 0) {
    g_ranges_kept_at_teardown.fetch_add(kept, std::memory_order_relaxed);
    std::fprintf(stderr,
                 "tidepool: vmm pool: kept %zu pointer-stable range%s (%zu bytes) mapped at "
                 "its destruction, leaked until the process ends: work queued on it could "
                 "not be waited for, or an unmap failed (the pool's teardown line names the "
                 "failures): %s\n",
                 kept, kept == 1 ? "" : "s", kept_bytes, kept_named.c_str());
  }
}

VmmPool::Range* VmmPool::find_locked(const void* ptr) {
  return const_cast<Range*>(static_cast<const VmmPool*>(this)->find_locked(ptr));
}

const VmmPool::Range* VmmPool::find_locked(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  auto it = ranges_.upper_bound(p);
  if (it == ranges_.begin()) return nullptr;
  --it;
  const Range& r = it->second;
  return p < r.base + r.bytes ? &r : nullptr;
}

// Chunks are dropped from the range (and from the stats) as they are unmapped, so a
// deallocate that stops at a failed unmap leaves a range a later one can go on with.
bool VmmPool::release_range_locked(Range& r, Teardown* teardown) {
  // Throws at the first failure, or with a Teardown records it and goes on; true when
  // the step succeeded.
  auto step = [teardown](const char* what, auto&& fn) {
    if (teardown != nullptr) return teardown->attempt(what, fn);
    try {
      fn();
    } catch (const BackendError& e) {
      throw TieringError(std::string("vmm pool: ") + what + " failed (the range stays allocated "
                         "with what is still mapped; deallocate again): " + e.what());
    }
    return true;
  };
  bool all_unmapped = true;
  while (!r.chunks.empty()) {
    const Chunk c = r.chunks.back();
    // Only in a teardown does a failed unmap get here: the handle is released all the
    // same (Note [Ranges kept at teardown]), its memory staying pinned under the mapping
    // until the process ends, so a host one stays charged (Note [One pinned budget per
    // process] in pinned_budget.cpp).
    bool unmapped = true;
    if (c.mapped) {
      unmapped = step("unmapping a chunk", [&] { backend_.unmap(r.base + c.offset, c.bytes); });
      all_unmapped = all_unmapped && unmapped;
    }
    r.chunks.pop_back();
    if (!c.mapped) unmapped_chunks_--;
    (c.where == MemoryLocation::device ? stats_.device_backed_bytes : stats_.host_backed_bytes) -=
        c.bytes;
    if (c.where == MemoryLocation::device) give_device_room_locked(c.bytes);
    if (teardown != nullptr) {
      teardown->attempt("releasing a chunk's backing", [&] {
        if (unmapped) {
          release_backing(c.physical, c.bytes, c.where);
        } else {
          backend_.release_physical(c.physical, c.bytes);
        }
      });
    } else {
      release_or_defer_locked(c.physical, c.bytes, c.where);
    }
  }
  if (!all_unmapped) return false;
  step("releasing a range's address space", [&] { backend_.release_address(r.base, r.bytes); });
  stats_.ranges--;
  return true;
}

void* VmmPool::allocate(std::size_t bytes, int tag, MemoryLocation where) {
  return allocate_range(bytes, tag,
                        where == MemoryLocation::device ? Placement::device : Placement::host);
}

void* VmmPool::allocate_within_budget(std::size_t bytes, int tag) {
  return allocate_range(bytes, tag, Placement::within_budget);
}

// Note [New state where the budget puts it]
// allocate_within_budget places each chunk as a prefetch would move it (Note [VMM device
// budget]): on the device while the budget has free room for it, else on the host, so
// that state made inside a step is where the next steps keep it. With the default budget
// of 0 that is all of it on the host: the step that creates the state (an optimizer's
// first) then peaks no higher than the later ones, instead of holding all of it on the
// device until the eviction after the step copies it out again (on the H200 on
// 2026-12-04 the first step of the Llama run peaked at 30.0 GB against 17.0 GB for the
// others, and 23.3 GB for the plain run's). Room is taken, not asked for: like a
// migration it never makes a store evict. A device chunk the device has no memory for
// goes to the host as well: new state never fails for want of device memory while the
// host has some. Nor for want of host memory while the device has some: a host chunk the
// host has no memory for, or the pinned budget no room for (Note [Pinned host backings]
// in vmm_backings.cpp), goes to the device, past the state budget.
void* VmmPool::allocate_range(std::size_t bytes, int tag, Placement placement) {
  if (bytes == 0) throw TieringError("vmm pool: allocate(0)");
  if (bytes > kMaxRangeBytes) {
    throw TieringError("vmm pool: absurd size " + std::to_string(bytes));
  }
  const std::size_t g = backend_.granularity();
  const std::size_t total = round_up(bytes, g);
  const std::optional<std::size_t> given =
      placement == Placement::device ? ask_stores_for_room(total) : std::nullopt;
  const std::optional<std::size_t> budget = placement == Placement::within_budget
                                                ? device_budget_bytes()
                                                : std::nullopt;
  std::lock_guard lock(mutex_);
  repair_locked();
  if (given) {
    stats_.budget_room_requests++;
    stats_.budget_room_given_bytes += *given;
  }
  Range r;
  r.bytes = total;
  r.tag = tag;
  // Room for every chunk before any is made: a chunk mapped and then lost to a failed
  // push_back would stay mapped, charged and counted for good.
  r.chunks.reserve((total + chunk_bytes_ - 1) / chunk_bytes_);
  r.sequence = next_sequence_++;
  try {
    r.base = static_cast<char*>(backend_.reserve_address(total));
  } catch (const BackendError& e) {
    throw TieringError(std::string("vmm pool: reserving ") + std::to_string(total) +
                       " bytes of address space failed: " + e.what());
  }
  stats_.ranges++;  // counted out by release_range_locked, as the backed bytes below
  // Undoes a half-built range. One that cannot be undone (an unmap fails) stays in the
  // pool, which frees it at its destruction: nothing is lost.
  auto unwind = [&] {
    try {
      release_range_locked(r);
    } catch (const TieringError&) {
      char* base = r.base;
      ranges_.emplace(base, std::move(r));
    }
  };
  // A chunk's backing in `where`, a spare if there is one; null when `where` has no
  // memory for it (or, on the host, the pinned budget no room). A device chunk's room,
  // taken by the caller, is given back when none is made.
  auto create_in = [&](std::size_t n, MemoryLocation where) {
    NewBacking b{where == MemoryLocation::host ? take_spare_locked(n) : PhysicalHandle{}};
    try {
      if (!b.handle) b = create_backing(n, where);
      if (b.pinned_budget_spent) b = retry_refused_host_backing_locked(n);
    } catch (...) {
      if (where == MemoryLocation::device) give_device_room_locked(n);
      throw;
    }
    if (!b.handle && where == MemoryLocation::device) give_device_room_locked(n);
    return b;
  };
  try {
    for (std::size_t off = 0; off < total; off += chunk_bytes_) {
      const std::size_t n = std::min(chunk_bytes_, total - off);
      // A device chunk takes its room first (given back on every way out below). Placed
      // on the device it is not limited by the budget (`budget` is none: Note [VMM device
      // budget]), only charged, so the stores sharing it find that much less room; within
      // the budget, a chunk without room goes to the host.
      MemoryLocation where = MemoryLocation::host;
      if (placement != Placement::host && take_device_room_locked(n, budget)) {
        where = MemoryLocation::device;
      }
      NewBacking b = create_in(n, where);
      if (!b.handle && placement == Placement::within_budget) {
        // Note [New state where the budget puts it]: the device is full, or the host has
        // no room (the pinned budget spent): the other one. On the device that is past
        // the state budget, charged all the same.
        const bool pinned_budget_spent = b.pinned_budget_spent;
        where = where == MemoryLocation::device ? MemoryLocation::host : MemoryLocation::device;
        if (where == MemoryLocation::device) take_device_room_locked(n, std::nullopt);
        b = create_in(n, where);
        if (pinned_budget_spent && b.handle) warn_pinned_budget_spent_locked(n);
      }
      const PhysicalHandle h = b.handle;
      if (!h) {
        unwind();
        return nullptr;
      }
      try {
        backend_.map(r.base + off, n, h);
      } catch (...) {
        if (where == MemoryLocation::device) give_device_room_locked(n);
        release_or_defer_locked(h, n, where);
        throw;
      }
      r.chunks.push_back(Chunk{off, n, h, where});
      (where == MemoryLocation::device ? stats_.device_backed_bytes : stats_.host_backed_bytes) +=
          n;
    }
  } catch (const BackendError& e) {
    unwind();
    throw TieringError(std::string("vmm pool: allocate of ") + std::to_string(bytes) +
                       " bytes failed: " + e.what());
  } catch (...) {  // std::bad_alloc in a backend call: the range goes back all the same
    unwind();
    throw;
  }
  char* base = r.base;
  try {
    ranges_.emplace(base, std::move(r));
  } catch (...) {
    // The map's node could not be made (std::bad_alloc), so `r` was not moved from: given
    // back, it leaves no mapping, backing, charge or count behind.
    unwind();
    throw;
  }
  return base;
}

void VmmPool::deallocate(void* ptr) {
  std::lock_guard lock(mutex_);
  repair_locked();
  auto it = ranges_.find(static_cast<const char*>(ptr));
  if (it == ranges_.end()) {
    throw TieringError("vmm pool: deallocate of a pointer it does not own (or not a range base)");
  }
  // A failed move's copies may still read a range while the scratch range stays mapped
  // (its stream could not be synchronized, and repair_locked could not either): releasing
  // a range's backings now could free memory they read, so the range stays, as at
  // teardown (Note [Ranges kept at teardown]; review finding: deallocate released it).
  if (!scratch_mapped_.empty()) {
    throw TieringError("vmm pool: deallocate: the copies of a failed move may still read this "
                       "pool's memory (its stream could not be synchronized), so the range "
                       "stays allocated; free it again once the stream can be synchronized");
  }
  wait_for_users_locked(it->second);
  try {
    release_range_locked(it->second);
  } catch (...) {
    trim_spares_locked();  // the chunks unmapped before the failure are gone
    throw;
  }
  ranges_.erase(it);
  trim_spares_locked();  // fewer device-backed bytes: fewer spares are of use
}

void VmmPool::record_use(const void* ptr, Stream stream) {
  std::lock_guard lock(mutex_);
  Range* r = find_locked(ptr);
  if (r == nullptr) throw TieringError("vmm pool: record_use of a pointer it does not own");
  for (Stream s : r->use_streams) {
    if (s == stream) return;
  }
  r->use_streams.push_back(stream);
}

// Note [Releasing a stream no range used]
// release_stream waits for the stream only when a range names it among its users: then
// work queued on it may still touch the range, and a failed wait throws with nothing
// forgotten. A stream no range names has nothing here to wait for or forget, so it costs
// no backend call (and one already destroyed is no error): tidepool_release_stream runs
// on every stream a PyTorch or LD_PRELOAD program destroys, most of which never touched
// a tierable range, and a synchronize there would make each destroy a full wait (as
// Note [Releasing a stream tidepool never saw] in allocator/stream_ordering.cpp says for
// the allocator).
bool VmmPool::release_stream(Stream stream) {
  std::lock_guard lock(mutex_);
  const bool named = std::ranges::any_of(ranges_, [&](const auto& entry) {
    return std::ranges::find(entry.second.use_streams, stream) != entry.second.use_streams.end();
  });
  if (!named) return false;
  backend_.stream_synchronize(stream);
  for (auto& [base, r] : ranges_) std::erase(r.use_streams, stream);
  return true;
}

// Note [A lost use stream]
// A stream given to record_use and destroyed without release_stream (PyTorch's
// record_stream on a side stream that goes away) cannot take the event that waits for
// it. Failing would leave the range unfreeable for good — its free comes from a tensor's
// destructor through tidepool_free — and cudaStreamDestroy returns while work queued on
// the stream may still use the range. A device synchronization waits for that work and
// for every other user, so the wait is done; the dead stream is dropped from every range
// (no later wait can name it). As the allocator does (Note [Free after a lost stream] in
// allocator/caching_allocator.cpp): said once per pool unless tidepool.log:off, counted
// in VmmStats::lost_stream_syncs. If the synchronization fails too (a sticky device
// error), the caller gets a TieringError and nothing changed.
void VmmPool::wait_for_users_locked(Range& r) {
  // The streams stay users: PyTorch keeps running kernels on a block's stream (and on
  // the streams record_stream named) for as long as the block lives, without telling
  // anyone again, so each later migrate and the deallocate must wait for them too. Only
  // release_stream drops one. A copy of the list: a lost stream is dropped from it. After
  // a lost stream's device synchronization the rest are still waited for: it covers this
  // pool's device alone, not a peer's stream later in the list.
  const std::vector<Stream> users = r.use_streams;
  for (const Stream s : users) {
    try {
      backend_.record_event(sync_event_, s);
    } catch (const BackendError& e) {
      // Note [A use stream of another device]: the pool's event cannot be recorded on a
      // stream of another device (a peer's kernels reading the range after record_stream
      // named its stream), which is alive; waiting for the stream itself works there.
      // Only a stream that cannot be waited for either is taken for lost.
      try {
        backend_.stream_synchronize(s);
        continue;
      } catch (const BackendError&) {
      }
      synchronize_for_lost_stream_locked(s, e);
      continue;
    }
    try {
      backend_.event_synchronize(sync_event_);
    } catch (const BackendError& e) {
      throw TieringError(std::string("vmm pool: waiting for a stream that used the range "
                                     "failed, nothing changed: ") + e.what());
    }
  }
}

void VmmPool::synchronize_for_lost_stream_locked(Stream lost, const BackendError& record_error) {
  try {
    backend_.device_synchronize();
  } catch (const BackendError& e) {
    throw TieringError(std::string("vmm pool: recording an event on a stream that used the "
                                   "range failed (") + record_error.what() +
                       "), and synchronizing the device instead failed too (" + e.what() +
                       "); nothing changed. A stream given to record_use must be released "
                       "(tidepool_release_stream) before it is destroyed");
  }
  for (auto& [base, range] : ranges_) std::erase(range.use_streams, lost);
  ++stats_.lost_stream_syncs;
  if (!warn_once_due(warned_lost_stream_)) return;
  std::fprintf(stderr,
               "tidepool: vmm pool: could not record an event on a stream that used a "
               "pointer-stable range (%s); it synchronized the whole device instead, which is "
               "slow. A stream given to record_stream was probably destroyed without "
               "tidepool_release_stream first. Said once; the tiering stats' "
               "lost_stream_syncs counts them.\n",
               record_error.what());
}

std::optional<std::size_t> VmmPool::device_budget_bytes() const {
  if (options_.device_budget_bytes == VmmPoolOptions::kNoDeviceBudget) return std::nullopt;
  if (options_.device_budget_bytes != VmmPoolOptions::kDeviceBudgetFromConfig) {
    return options_.device_budget_bytes;
  }
  return configured_state_budget_bytes(active_config(), backend_);
}

// Resolved outside the lock: a percentage asks the backend for the device's size.
std::optional<std::size_t> VmmPool::budget_towards(MemoryLocation to) const {
  return to == MemoryLocation::device ? device_budget_bytes() : std::nullopt;
}

std::optional<std::size_t> VmmPool::ask_stores_for_room(std::size_t bytes) {
  if (!shared_) return std::nullopt;
  const std::optional<std::size_t> budget = device_budget_bytes();
  if (!budget) return std::nullopt;
  const std::size_t charged = shared_->ledger().charged_bytes();
  if (charged + bytes <= *budget) return std::nullopt;
  // Best effort: what the stores give back may be taken by another participant first,
  // and the allocation goes ahead whatever they give (Note [VMM device budget]).
  return shared_->ask_peers(std::min(charged + bytes - *budget, bytes));
}

bool VmmPool::take_device_room_locked(std::size_t bytes, std::optional<std::size_t> budget,
                                      std::size_t taken) {
  if (!shared_) return !budget || stats_.device_backed_bytes + taken + bytes <= *budget;
  if (!budget) {
    shared_->charge(bytes);  // tidepool not configured: nothing to keep within, but counted
    return true;
  }
  return shared_->try_charge(bytes, *budget);
}

void VmmPool::give_device_room_locked(std::size_t bytes) noexcept {
  if (shared_) shared_->uncharge(bytes);
}

MigrationResult VmmPool::migrate(const void* ptr, MemoryLocation to, std::uint64_t range_id) {
  const std::optional<std::size_t> budget = budget_towards(to);
  std::lock_guard lock(mutex_);
  repair_locked();
  Range* r = find_locked(ptr);
  if (range_id != 0 && (r == nullptr || r->sequence != range_id)) return {};  // freed since
  if (r == nullptr) throw TieringError("vmm pool: migrate of a pointer it does not own");
  return migrate_locked(*r, to, budget);
}

MigrationResult VmmPool::migrate_locked(Range& r, MemoryLocation to,
                                        std::optional<std::size_t> budget,
                                        BackingSupply* supply) {
  try {
    return move_range_locked(r, to, budget, supply);
  } catch (...) {
    stats_.failed_migrations++;
    throw;
  }
}

// Note [A device with no room for a prefetch]
// A move to the device is a prefetch: the state is readable where it is, on the host. When
// the device has no memory for a chunk (its budget had room, but the device is full of
// other memory: activations, another process), the move stops there, keeps what it moved,
// and counts the rest as left on the host, as a budget stop does (bytes_left,
// budget_stops, bytes_left_on_host); the next range is still tried. Before, it threw: the
// whole batch was undone, the tag's or pointers' later ranges were never tried, and the
// Python pre-step hook raised out of optimizer.step(). It does not empty the caching
// allocator's cache to make room: the step about to run needs that memory again.
//
// Note [Nothing to move, nothing to wait for]
// A range already wholly where it is asked to go returns before waiting for its users:
// the wait is there so that no copy reads or unmaps memory a kernel still uses, and
// nothing is copied or unmapped. This is what makes a tag call cheap for the ranges it
// finds in place: the optimizer hooks evict the whole optimizer_state tag after each
// step (Note [evict by tag] in python/src/tidepool/_state_moves.py), and with several
// optimizers on a device most of the tag's ranges (the other optimizers' state) were
// evicted after their own steps; waiting on each one's streams (an event recorded and
// synchronized per stream, per range) would be thousands of backend calls a step for
// nothing. A range partly in place still waits once, before its first chunk moves; one
// whose chunks the device budget has no room for waits not at all (a prefetch under a
// full budget moves nothing).
MigrationResult VmmPool::move_range_locked(Range& r, MemoryLocation to,
                                           std::optional<std::size_t> budget,
                                           BackingSupply* supply) {
  MigrationResult result;
  result.ranges = 1;
  for (const Chunk& c : r.chunks) {
    if (!c.mapped) {  // its data is not at the address to copy from
      throw TieringError("vmm pool: migrate: a chunk of the range could not be mapped back "
                         "after an earlier failure; its data is kept and mapped again at a "
                         "later call");
    }
  }
  if (std::ranges::all_of(r.chunks, [&](const Chunk& c) { return c.where == to; })) {
    return result;
  }
  auto t0 = std::chrono::steady_clock::now();  // from the end of the wait, when there is one
  auto add_time = [&] {
    stats_.migration_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  const bool to_device = to == MemoryLocation::device;
  // Note [VMM device budget]: a chunk that would exceed it stays; a later, smaller one may
  // still fit. Room is taken for every chunk that moves before the first one moves, and
  // given back for those a failure leaves where they were.
  std::vector<std::size_t> plan;  // indices into r.chunks, in order
  plan.reserve(r.chunks.size());
  std::size_t taken = 0;  // device room taken for the planned chunks
  for (std::size_t i = 0; i < r.chunks.size(); ++i) {
    const Chunk& c = r.chunks[i];
    if (c.where == to) continue;
    if (to_device) {
      if (!take_device_room_locked(c.bytes, budget, taken)) {
        result.bytes_left += c.bytes;
        continue;
      }
      taken += c.bytes;
    }
    plan.push_back(i);
  }
  std::size_t moved = 0;  // plan[0, moved) are swapped
  try {
    // Note [Nothing to move, nothing to wait for], for a range the budget has no room for
    // at all: its users are waited for only when a chunk will move.
    if (!plan.empty()) {
      wait_for_users_locked(r);
      t0 = std::chrono::steady_clock::now();
      move_planned_locked(r, plan, to, moved, result, supply);  // vmm_moves.cpp
    }
    // Note [A device with no room for a prefetch]: what the device had no memory for stays
    // on the host, as what the budget has no room for does; towards the host, what the
    // pinned budget had no room for stays on the device (Note [Pinned host backings]).
    for (std::size_t k = moved; k < plan.size(); ++k) {
      if (to_device) give_device_room_locked(r.chunks[plan[k]].bytes);
      result.bytes_left += r.chunks[plan[k]].bytes;
    }
  } catch (...) {
    if (to_device) {
      for (std::size_t k = moved; k < plan.size(); ++k) {
        give_device_room_locked(r.chunks[plan[k]].bytes);
      }
    }
    add_time();
    throw;
  }
  if (result.bytes_left > 0) {
    (to_device ? stats_.budget_stops : stats_.pinned_budget_stops)++;
    (to_device ? stats_.bytes_left_on_host : stats_.bytes_left_on_device) += result.bytes_left;
  }
  add_time();
  return result;
}

// Note [Migration batches] in vmm_moves.cpp: a call that moves several ranges to the host
// has their host backings created ahead, on helper threads, while it moves them one by one
// (an eviction by tag of many ranges of a chunk or two each would otherwise create each
// range's backing only as its move starts, with no copy to overlap).
MigrationResult VmmPool::migrate_tag(int tag, MemoryLocation to) {
  const std::optional<std::size_t> budget = budget_towards(to);
  // (sequence, base) of the tag's ranges, oldest first. The lock is let go between ranges
  // (a migration waits for streams); the sequence tells a range freed meanwhile, whose
  // address a new range may have taken, from the one listed.
  std::vector<std::pair<std::uint64_t, const char*>> order;
  std::unique_ptr<BackingSupply> supply;
  {
    std::lock_guard lock(mutex_);
    repair_locked();
    std::vector<const Range*> planned;
    for (auto& [base, r] : ranges_) {
      if (r.tag != tag) continue;
      order.emplace_back(r.sequence, base);
      planned.push_back(&r);
    }
    std::sort(order.begin(), order.end());
    std::sort(planned.begin(), planned.end(),
              [](const Range* a, const Range* b) { return a->sequence < b->sequence; });
    if (to == MemoryLocation::host) supply = host_supply_locked(planned);
  }
  return with_supply(supply, [&] {
    MigrationResult total;
    for (const auto& [sequence, base] : order) {
      std::lock_guard lock(mutex_);
      // Note [Repairs between ranges]: the lock was let go since the last range; another
      // thread's failed migration may have left a scratch mapping or an unmapped chunk
      // behind, which this range's move would otherwise trip over.
      repair_locked();
      auto it = ranges_.find(base);
      if (it == ranges_.end() || it->second.sequence != sequence) continue;  // freed meanwhile
      total += migrate_locked(it->second, to, budget, supply.get());
    }
    return total;
  });
}

MigrationResult VmmPool::migrate_ranges_holding(std::span<const void* const> ptrs,
                                                MemoryLocation to) {
  const std::optional<std::size_t> budget = budget_towards(to);
  std::unique_ptr<BackingSupply> supply;
  // The range each pointer named when the call began, by sequence (0: none). The lock is
  // let go between ranges, as in migrate_tag; a range freed meanwhile, whose address a new
  // range may have taken (another tag's, another optimizer's, whose kernels may be
  // running), is not the one the caller named: it is skipped, not moved.
  std::vector<std::uint64_t> named(ptrs.size(), 0);
  {
    std::lock_guard lock(mutex_);
    repair_locked();
    std::vector<const Range*> planned;  // for the host supply
    std::unordered_set<std::uint64_t> seen;
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      const Range* r = ptrs[i] != nullptr ? find_locked(ptrs[i]) : nullptr;
      if (r == nullptr) continue;
      named[i] = r->sequence;
      if (to == MemoryLocation::host && seen.insert(r->sequence).second) planned.push_back(r);
    }
    if (to == MemoryLocation::host) supply = host_supply_locked(planned);
  }
  // Ranges already visited, by sequence (views and interior pointers name one again).
  std::unordered_set<std::uint64_t> visited;
  return with_supply(supply, [&] {
    MigrationResult total;
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      if (named[i] == 0) continue;
      std::lock_guard lock(mutex_);
      repair_locked();  // Note [Repairs between ranges]
      Range* r = find_locked(ptrs[i]);
      if (r == nullptr || r->sequence != named[i] || !visited.insert(r->sequence).second) {
        continue;
      }
      total += migrate_locked(*r, to, budget, supply.get());
    }
    return total;
  });
}

MigrationResult VmmPool::with_supply(std::unique_ptr<BackingSupply>& supply,
                                     const std::function<MigrationResult()>& moves) {
  auto finish = [&] {
    if (!supply) return;
    std::lock_guard lock(mutex_);
    finish_supply_locked(*supply);
  };
  MigrationResult total;
  try {
    total = moves();
  } catch (...) {
    finish();
    throw;
  }
  finish();
  return total;
}

std::vector<void*> VmmPool::device_backed_ranges(int tag, std::span<const void* const> except,
                                                 std::vector<std::uint64_t>* ids) const {
  std::lock_guard lock(mutex_);
  std::unordered_set<const char*> excluded;
  for (const void* ptr : except) {
    if (const Range* r = ptr != nullptr ? find_locked(ptr) : nullptr) excluded.insert(r->base);
  }
  std::vector<const Range*> found;
  for (const auto& [base, r] : ranges_) {
    if (r.tag != tag || excluded.contains(base)) continue;
    if (std::any_of(r.chunks.begin(), r.chunks.end(),
                    [](const Chunk& c) { return c.where == MemoryLocation::device; })) {
      found.push_back(&r);
    }
  }
  std::sort(found.begin(), found.end(),
            [](const Range* a, const Range* b) { return a->sequence < b->sequence; });
  std::vector<void*> bases;
  bases.reserve(found.size());
  for (const Range* r : found) bases.push_back(r->base);
  if (ids != nullptr) {
    ids->clear();
    for (const Range* r : found) ids->push_back(r->sequence);
  }
  return bases;
}

bool VmmPool::owns(const void* ptr) const {
  std::lock_guard lock(mutex_);
  return find_locked(ptr) != nullptr;
}

std::uint64_t VmmPool::range_id(const void* ptr) const {
  std::uint64_t id = 0;
  range_ids({&ptr, 1}, {&id, 1});
  return id;
}

void VmmPool::range_ids(std::span<const void* const> ptrs, std::span<std::uint64_t> ids) const {
  if (ids.size() != ptrs.size()) {
    throw TieringError("vmm pool: range_ids got " + std::to_string(ptrs.size()) +
                       " pointers but room for " + std::to_string(ids.size()) + " ids");
  }
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    const Range* r = find_locked(ptrs[i]);
    ids[i] = r != nullptr ? r->sequence : 0;
  }
}

void* VmmPool::base_of(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const Range* r = find_locked(ptr);
  return r != nullptr ? r->base : nullptr;
}

std::size_t VmmPool::size_of(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const Range* r = find_locked(ptr);
  return r != nullptr ? r->bytes : 0;
}

std::size_t VmmPool::bytes_in(const void* ptr, MemoryLocation where) const {
  std::lock_guard lock(mutex_);
  const Range* r = find_locked(ptr);
  if (r == nullptr) return 0;
  std::size_t n = 0;
  for (const Chunk& c : r->chunks) {
    if (c.where == where) n += c.bytes;
  }
  return n;
}

VmmStats VmmPool::stats() const {
  const std::optional<std::size_t> budget = device_budget_bytes();
  const std::size_t pinned_budget = pinned_budget_now();
  std::lock_guard lock(mutex_);
  VmmStats s = stats_;
  s.deferred_releases = deferred_releases_.size();
  for (const DeferredRelease& d : deferred_releases_) s.deferred_release_bytes += d.bytes;
  s.has_device_budget = budget.has_value();
  s.device_budget_bytes = budget.value_or(0);
  s.budget_shared = shared_ != nullptr && budget.has_value();
  s.budget_peer_bytes = shared_ ? shared_->others_bytes() : 0;
  s.spare_host_backings = spares_.size();
  s.spare_host_bytes = spare_bytes_;
  s.pinned_budget_shared = pinned_budget_shared();
  s.pinned_budget_bytes = pinned_budget;
  s.pinned_bytes = pinned_charged_.load();
  s.pinned_budget_refusals = pinned_refusals_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace tidepool
