// VmmPool's moves: how the chunks of a range get their new backing (created ahead by a
// BackingSupply), are copied and are swapped in at the same address. The backings
// themselves (their pinned charge, the spares, the deferred releases) are
// vmm_backings.cpp; the rest of the pool (ranges, users, budget, teardown)
// vmm_migration.cpp; what a caller is promised is in vmm_migration.h.
//
// Note [Migration batches]
// The H200 run of 2026-12-04 moved a 1 GiB range to the host at 3.5 GB/s and back at
// 16 GB/s, against 55 GB/s for a pinned copy. Per 64 MiB chunk a move was: create the new
// backing, map it at a scratch range, copy, synchronize, unmap the scratch range, unmap the
// chunk, map the new backing there, release the old one, all strictly in turn. Creating
// host-NUMA memory allocates and pins fresh pages (cudaHostAlloc, which does the same,
// runs at 2.7 GB/s here: DESIGN.md), and releasing it unpins them; the copy, the only
// step that needs the link, waited for both. So a move (move_planned_locked) now:
//   1. finds every chunk's new backing up front: spare host backings first (Note [Spare
//      host backings]), the rest created in chunk order by up to creation_threads helper
//      threads (BackingSupply, vmm_backing_supply.h), which go on creating while the
//      migrating thread copies and swaps the chunks whose backings are ready. A call that
//      moves several ranges to the host (migrate_tag, migrate_ranges_holding) plans the
//      backings of all of them at once, so that an eviction of many one-chunk ranges
//      (optimizer state) creates ahead too;
//   2. takes the chunks batch_chunks at a time: each new backing is mapped at its slot of
//      the scratch range and its copy enqueued, one copy per chunk (a copy never spans
//      two backings: Note [Copies across host-NUMA mappings] in cuda_backend.cpp), and
//      one synchronize waits for the whole batch;
//   3. swaps the batch's chunks one by one (scratch slot unmapped, chunk unmapped, new
//      backing mapped in its place) and keeps each old host backing as a spare, or
//      releases it.
// VmmStats says where the time went (create_ms, create_wait_ms, copy_wait_ms, remap_ms,
// release_ms, migration_batches, migration_backend_calls), so that a GPU run shows which
// step dominates. A failure before the swaps leaves the whole batch where it was (its new
// backings given back); one during the swaps leaves the chunks swapped before it moved and
// undoes the failing chunk's step as before. Chunks of earlier batches stay moved. Every
// byte stays readable at its address throughout.
#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "tiering/tiered_store.h"  // TieringError
#include "tiering/vmm_backing_supply.h"
#include "tiering/vmm_migration.h"

namespace tidepool {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

const char* location_name(MemoryLocation w) {
  return w == MemoryLocation::device ? "device" : "host";
}

// A backend call of a move: counted in migration_backend_calls, its time added to `ms`.
template <typename Fn>
void timed_call(VmmStats& stats, double& ms, Fn&& fn) {
  struct AddTime {
    double& ms;
    Clock::time_point t0;
    ~AddTime() { ms += ms_since(t0); }
  } add{ms, Clock::now()};
  stats.migration_backend_calls++;
  fn();
}

// Called in a handler: a BackendError goes on as a TieringError saying what failed (`what`
// ends with ": "); anything else (the heap's std::bad_alloc out of the seam's
// bookkeeping) goes on as it is.
[[noreturn]] void rethrow_backend_error_as_migrate_error(const std::string& what) {
  try {
    throw;
  } catch (const BackendError& e) {
    throw TieringError("vmm pool: migrate: " + what + e.what());
  }
}

}  // namespace

// ---- backings created ahead (vmm_backing_supply.h) ---------------------------------------------

VmmPool::BackingSupply::BackingSupply(VmmPool& pool, MemoryLocation where,
                                      const std::vector<std::size_t>& sizes, unsigned threads)
    : pool_(pool), where_(where) {
  slots_.reserve(sizes.size());
  for (const std::size_t bytes : sizes) {
    slots_.push_back(Slot{bytes, Status::pending, NewBacking{}, nullptr});
  }
  const std::size_t helpers = std::min<std::size_t>(threads, slots_.size());
  if (helpers < 2) return;
  try {
    for (std::size_t i = 0; i < helpers; ++i) helpers_.emplace_back([this] { run(); });
  } catch (...) {  // no more threads: those started create, take() the rest
  }
}

VmmPool::BackingSupply::~BackingSupply() { stop_and_join(); }

// Note [A failed creation is taken last]
// The helpers create the slots concurrently, so which of them a device with room for only
// some gets is a race: the first slot of a size may fail while later ones hold memory.
// A take that returned the first ready slot, failed or not, stopped a prefetch to a
// nearly full device at a chunk there was memory for (moving nothing, at worst, with the
// memory created for the rest given straight back). So a take prefers a created backing,
// then one being created, then creating one itself, and returns a failure (null, or the
// creation's error) only when none of those is left or its own creation failed: one more
// attempt per take at most, not one per slot left, after the device is out of memory.
VmmPool::NewBacking VmmPool::BackingSupply::take(std::size_t bytes) {
  std::unique_lock lock(mutex_);
  bool created_here = false;  // this take created a slot itself: once one failed, no more
  while (true) {
    // The first slot of this size created, else the first being created, else the first
    // nobody claimed yet, else the first whose creation failed.
    const std::size_t none = slots_.size();
    std::size_t ready = none, creating = none, pending = none, failed = none;
    for (std::size_t i = 0; i < slots_.size() && ready == none; ++i) {
      const Slot& s = slots_[i];
      if (s.bytes != bytes) continue;
      const bool made = s.status == Status::ready && s.backing.handle && !s.error;
      if (made) ready = i;
      if (s.status == Status::ready && !made && failed == none) failed = i;
      if (s.status == Status::creating && creating == none) creating = i;
      if (s.status == Status::pending && pending == none) pending = i;
    }
    if (ready < none) {
      slots_[ready].status = Status::taken;
      return slots_[ready].backing;
    }
    if (creating < none) {
      const Clock::time_point t0 = Clock::now();
      ready_.wait(lock, [&] { return slots_[creating].status != Status::creating; });
      wait_ms_ += ms_since(t0);
      continue;
    }
    if (pending < none && !(created_here && failed < none)) {
      slots_[pending].status = Status::creating;
      created_here = true;
      lock.unlock();
      create(pending);
      lock.lock();
      continue;
    }
    if (failed < none) {
      Slot& s = slots_[failed];
      s.status = Status::taken;
      if (s.error) std::rethrow_exception(s.error);
      return s.backing;  // null: out of memory, or the pinned budget spent
    }
    // None of this size planned (the range changed since): created now, outside the slots.
    lock.unlock();
    const Clock::time_point t0 = Clock::now();
    NewBacking b;
    try {
      b = pool_.create_backing(bytes, where_);
    } catch (...) {
      lock.lock();
      create_calls_++;
      create_ms_ += ms_since(t0);
      throw;
    }
    lock.lock();
    if (!b.pinned_budget_spent) create_calls_++;
    create_ms_ += ms_since(t0);
    if (b.handle) created_++;
    return b;
  }
}

void VmmPool::BackingSupply::finish(
    const std::function<void(PhysicalHandle, std::size_t)>& give_back) {
  stop_and_join();
  for (Slot& s : slots_) {
    if (s.status == Status::ready && s.backing.handle) {
      s.status = Status::taken;
      give_back(s.backing.handle, s.bytes);
    }
  }
}

std::uint64_t VmmPool::BackingSupply::created() const {
  std::lock_guard lock(mutex_);
  return created_;
}
std::uint64_t VmmPool::BackingSupply::create_calls() const {
  std::lock_guard lock(mutex_);
  return create_calls_;
}
double VmmPool::BackingSupply::create_ms() const {
  std::lock_guard lock(mutex_);
  return create_ms_;
}
double VmmPool::BackingSupply::wait_ms() const {
  std::lock_guard lock(mutex_);
  return wait_ms_;
}

void VmmPool::BackingSupply::run() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    while (next_ < slots_.size() && slots_[next_].status != Status::pending) ++next_;
    if (next_ == slots_.size()) return;
    const std::size_t i = next_++;
    slots_[i].status = Status::creating;
    lock.unlock();
    create(i);
    lock.lock();
  }
}

void VmmPool::BackingSupply::create(std::size_t i) {
  const Clock::time_point t0 = Clock::now();
  NewBacking b;
  std::exception_ptr error;
  try {
    b = pool_.create_backing(slots_[i].bytes, where_);  // bytes never change
  } catch (...) {
    error = std::current_exception();
  }
  const double ms = ms_since(t0);
  std::lock_guard lock(mutex_);
  Slot& s = slots_[i];
  s.backing = b;
  s.error = error;
  s.status = Status::ready;
  if (!b.pinned_budget_spent) create_calls_++;
  create_ms_ += ms;
  if (b.handle) {
    created_++;
  } else {
    stop_ = true;  // out of memory, the budget spent or an error: the helpers stop
  }
  ready_.notify_all();
}

void VmmPool::BackingSupply::stop_and_join() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  for (std::thread& t : helpers_) t.join();
  helpers_.clear();
}

// ---- a move ------------------------------------------------------------------------------------

std::vector<std::size_t> VmmPool::sizes_beyond_spares_locked(
    const std::vector<std::size_t>& sizes) const {
  std::map<std::size_t, std::size_t> spares_left;  // by size
  std::vector<std::size_t> beyond;
  beyond.reserve(sizes.size());
  for (const std::size_t bytes : sizes) {
    auto [it, added] = spares_left.try_emplace(bytes, 0);
    if (added) it->second = spares_.count(bytes);
    if (it->second > 0) {
      it->second--;
    } else {
      beyond.push_back(bytes);
    }
  }
  return beyond;
}

std::unique_ptr<VmmPool::BackingSupply> VmmPool::host_supply_locked(
    const std::vector<const Range*>& ranges) {
  if (options_.creation_threads < 2) return nullptr;
  std::vector<std::size_t> sizes;
  for (const Range* r : ranges) {
    for (const Chunk& c : r->chunks) {
      if (c.where != MemoryLocation::host) sizes.push_back(c.bytes);
    }
  }
  sizes = sizes_beyond_spares_locked(sizes);
  if (sizes.size() < 2) return nullptr;  // each move makes its own, on its thread
  return std::make_unique<BackingSupply>(*this, MemoryLocation::host, sizes,
                                         options_.creation_threads);
}

void VmmPool::finish_supply_locked(BackingSupply& supply) {
  const MemoryLocation where = supply.where();
  supply.finish([this, where](PhysicalHandle h, std::size_t bytes) {
    keep_or_release_locked(h, bytes, where);
  });
  stats_.backings_created += supply.created();
  stats_.migration_backend_calls += supply.create_calls();
  stats_.create_ms += supply.create_ms();
  stats_.create_wait_ms += supply.wait_ms();
  trim_spares_locked();
}

// Note [Spare host backings] in vmm_backings.cpp.
void VmmPool::keep_or_release_locked(PhysicalHandle old, std::size_t bytes,
                                     MemoryLocation where) {
  if (where == MemoryLocation::host && spare_bytes_ + bytes <= spare_limit_locked()) {
    try {
      spares_.emplace(bytes, old);
      spare_bytes_ += bytes;
      return;
    } catch (const std::bad_alloc&) {  // not kept: released below
    }
  }
  // release_or_defer_locked throws nothing for a failed release: it is deferred.
  timed_call(stats_, stats_.release_ms, [&] { release_or_defer_locked(old, bytes, where); });
}

void VmmPool::move_planned_locked(Range& r, const std::vector<std::size_t>& plan,
                                  MemoryLocation to, std::size_t& moved,
                                  MigrationResult& result, BackingSupply* supply) {
  std::unique_ptr<BackingSupply> own;
  if (supply == nullptr) {
    std::vector<std::size_t> sizes;
    sizes.reserve(plan.size());
    for (const std::size_t i : plan) sizes.push_back(r.chunks[i].bytes);
    if (to == MemoryLocation::host) sizes = sizes_beyond_spares_locked(sizes);
    own = std::make_unique<BackingSupply>(*this, to, sizes, options_.creation_threads);
    supply = own.get();
  }
  // Whatever happens, what the supply made for this move alone goes back (Note [Spare
  // host backings]), and its figures go into the stats.
  struct Finish {
    VmmPool& pool;
    BackingSupply* own;
    ~Finish() {
      if (own != nullptr) pool.finish_supply_locked(*own);
    }
  } finish{*this, own.get()};
  for (std::size_t begin = 0; begin < plan.size(); begin += batch_chunks_) {
    const std::size_t end = std::min(plan.size(), begin + batch_chunks_);
    if (!move_batch_locked(r, plan, begin, end, to, *supply, moved, result)) return;
  }
}

bool VmmPool::move_batch_locked(Range& r, const std::vector<std::size_t>& plan,
                                std::size_t begin, std::size_t end, MemoryLocation to,
                                BackingSupply& supply, std::size_t& moved,
                                MigrationResult& result) {
  bool had_room = true;
  std::vector<PhysicalHandle> fresh(end - begin);  // the batch's new backings, taken so far
  // Gives back the new backings of plan[from, end) and unmaps those still at the scratch
  // range (one that will not unmap stays listed for repair_locked: Note [Deferred
  // releases]). No copy into them runs any more.
  auto abandon_from = [&](std::size_t from) {
    for (std::size_t k = from; k < end; ++k) {
      try {
        unmap_scratch_slot_locked((k - begin) * chunk_bytes_);
      } catch (const BackendError&) {
      }
      if (fresh[k - begin]) {
        release_or_defer_locked(fresh[k - begin], r.chunks[plan[k]].bytes, to);
      }
      fresh[k - begin] = PhysicalHandle{};
    }
  };

  // Step 2: each chunk's copy into its new backing at the scratch range; one wait.
  try {
    for (std::size_t k = begin; k < end; ++k) {
      const Chunk& c = r.chunks[plan[k]];
      PhysicalHandle h = to == MemoryLocation::host ? take_spare_locked(c.bytes)
                                                    : PhysicalHandle{};
      if (h) stats_.spare_host_reuses++;
      bool pinned_budget_spent = false;
      try {
        if (!h) {
          NewBacking b = supply.take(c.bytes);
          if (b.pinned_budget_spent) b = retry_refused_host_backing_locked(c.bytes);
          h = b.handle;
          pinned_budget_spent = b.pinned_budget_spent;
        }
      } catch (const std::exception& e) {  // the backend's, or the heap's in a retry
        throw TieringError(std::string("vmm pool: migrate: creating ") + location_name(to) +
                           " memory failed: " + e.what());
      }
      if (!h && (to == MemoryLocation::device || pinned_budget_spent)) {
        // Note [A device with no room for a prefetch], Note [Pinned host backings]: the
        // batch ends before this chunk.
        if (pinned_budget_spent) warn_pinned_budget_spent_locked(c.bytes);
        had_room = false;
        end = k;
        break;
      }
      if (!h) {
        throw TieringError("vmm pool: migrate: out of " + std::string(location_name(to)) +
                           " memory for a " + std::to_string(c.bytes) +
                           "-byte chunk (data stays where it was)");
      }
      fresh[k - begin] = h;
      const std::size_t slot = (k - begin) * chunk_bytes_;
      try {
        timed_call(stats_, stats_.remap_ms,
                   [&] { backend_.map(static_cast<char*>(scratch_) + slot, c.bytes, h); });
      } catch (const BackendError& e) {
        throw TieringError(std::string("vmm pool: migrate: mapping the new backing failed "
                                       "(data stays where it was): ") + e.what());
      }
      scratch_mapped_.push_back(ScratchSlot{slot, c.bytes});
      try {
        timed_call(stats_, stats_.copy_wait_ms, [&] {
          backend_.copy_async(static_cast<char*>(scratch_) + slot, r.base + c.offset, c.bytes,
                              CopyKind::device_to_device, stream_);
        });
      } catch (const BackendError& e) {
        throw TieringError(std::string("vmm pool: migrate: copy failed (data stays where it "
                                       "was): ") + e.what());
      }
    }
    if (end == begin) return false;  // not even the batch's first chunk had room
    stats_.migration_batches++;
    try {
      timed_call(stats_, stats_.copy_wait_ms, [&] { backend_.stream_synchronize(stream_); });
    } catch (const BackendError& e) {
      throw TieringError(std::string("vmm pool: migrate: copy failed (data stays where it "
                                     "was): ") + e.what());
    }
  } catch (...) {  // a TieringError, or the heap's std::bad_alloc, which goes on as it is
    bool idle = true;
    try {
      backend_.stream_synchronize(stream_);  // the batch's copies write the scratch range
    } catch (const BackendError&) {
      idle = false;
    }
    if (idle) {
      abandon_from(begin);
    } else {
      // A copy may still write there: the scratch range stays mapped, and repair_locked
      // synchronizes and unmaps it at the next call. Its backings are released now (a
      // mapping keeps its memory until it is unmapped).
      for (std::size_t k = begin; k < end; ++k) {
        if (fresh[k - begin]) {
          release_or_defer_locked(fresh[k - begin], r.chunks[plan[k]].bytes, to);
        }
      }
    }
    throw;
  }

  // Step 3: the swaps, chunk by chunk.
  for (std::size_t k = begin; k < end; ++k) {
    Chunk& c = r.chunks[plan[k]];
    // Room to defer one release before the swap: once the new backing is mapped, giving the
    // old one back must throw nothing (review finding: a std::bad_alloc listing a refused
    // release there skipped the move's count and its budget ledger entry).
    try {
      deferred_releases_.reserve(deferred_releases_.size() + 1);
    } catch (...) {
      abandon_from(k);
      throw;
    }
    const PhysicalHandle h = fresh[k - begin];
    fresh[k - begin] = PhysicalHandle{};  // swap_chunk_locked owns it from here
    try {
      swap_chunk_locked(r, c, h, (k - begin) * chunk_bytes_, to);
    } catch (...) {
      abandon_from(k + 1);
      throw;
    }
    ++moved;
    if (to == MemoryLocation::host) give_device_room_locked(c.bytes);
    result.bytes_moved += c.bytes;
  }
  return had_room;
}

// One chunk whose new backing holds its bytes at the scratch slot `slot`: swapped in at the
// chunk's address. Every failure leaves the old backing mapped at the address (or, when even
// that map fails, kept for repair_locked) and gives `fresh` back; releases that fail are
// deferred (Note [Deferred releases] in vmm_backings.cpp).
void VmmPool::swap_chunk_locked(Range& r, Chunk& c, PhysicalHandle fresh, std::size_t slot,
                                MemoryLocation to) {
  char* va = r.base + c.offset;
  // Every failure is handled alike whatever was thrown (review finding: only a
  // BackendError was, so a std::bad_alloc from the map left the address unmapped while
  // the chunk counted as mapped, its data unreachable, and `fresh` leaked).
  // Gives `fresh` back and throws: the data stays in the old backing, mapped at `va`.
  auto abandon = [&](const char* what) {
    release_or_defer_locked(fresh, c.bytes, to);
    rethrow_backend_error_as_migrate_error(std::string(what) +
                                           " failed (data stays where it was): ");
  };
  try {
    timed_call(stats_, stats_.remap_ms, [&] { unmap_scratch_slot_locked(slot); });
  } catch (...) {
    abandon("unmapping the scratch range");
  }
  try {
    timed_call(stats_, stats_.remap_ms, [&] { backend_.unmap(va, c.bytes); });
  } catch (...) {
    abandon("unmapping the original address");
  }
  try {
    timed_call(stats_, stats_.remap_ms, [&] { backend_.map(va, c.bytes, fresh); });
  } catch (...) {
    try {
      backend_.map(va, c.bytes, c.physical);  // put the old backing back
    } catch (...) {
      c.mapped = false;
      unmapped_chunks_++;
    }
    release_or_defer_locked(fresh, c.bytes, to);
    rethrow_backend_error_as_migrate_error(
        std::string("remapping the original address failed (") +
        (c.mapped ? "old backing restored"
                  : "old backing kept, mapped there again at the next call") +
        "): ");
  }
  const PhysicalHandle old = c.physical;
  const MemoryLocation from = c.where;
  (from == MemoryLocation::device ? stats_.device_backed_bytes : stats_.host_backed_bytes) -=
      c.bytes;
  (to == MemoryLocation::device ? stats_.device_backed_bytes : stats_.host_backed_bytes) +=
      c.bytes;
  if (to == MemoryLocation::host) {
    stats_.migrations_to_host++;
    stats_.bytes_to_host += c.bytes;
  } else {
    stats_.migrations_to_device++;
    stats_.bytes_to_device += c.bytes;
  }
  c.physical = fresh;
  c.where = to;
  keep_or_release_locked(old, c.bytes, from);
}

}  // namespace tidepool
