// VmmPool's physical backings: every backing the pool creates and releases, host ones
// charged to the pinned budget (Note [Pinned host backings]); the spare host backings kept
// between moves (Note [Spare host backings]); and the releases and repairs a failed
// backend call leaves for later (Note [Deferred releases]). How a move uses them is
// vmm_moves.cpp; ranges, users, budgets and teardown are vmm_migration.cpp.
//
// Note [Spare host backings]
// The host backing a move to the device frees is kept, unmapped, for the next move to the
// host, which then takes it instead of creating (and pinning) new host memory: a training
// loop that brings state in before each step and sends it out after creates host memory
// once. Kept only while the pool's spare bytes stay within both VmmPoolOptions::
// spare_host_bytes and the pool's device-backed bytes (the most a move to the host could
// take); a deallocate or a move to the host that lowers the device-backed bytes releases
// the spares beyond that (trim_spares_locked). Exact sizes only: chunks are whole
// chunk_granules chunks but a range's last one. An allocation on the host takes spares
// too. A spare is mapped nowhere and no copy uses it, so the destructor and
// release_spare_host_backings release them whatever else failed. The host memory they
// hold is what the state they would take takes on the host anyway; torch.cuda.empty_cache()
// gives it back (Note [empty_cache releases the spares] in tiering_registry.cpp).
//
// Note [Pinned host backings]
// A host backing is pinned memory (host-NUMA memory on the cuda backend), so every one the
// pool creates is charged to the pinned budget before it is created (create_backing),
// and the charge is given back when the backing is released (release_backing): mapped at
// a range, kept as a spare, created ahead of a move, or waiting for a deferred release,
// it stays charged. The budget is the process's by default, shared with the tiered
// stores' host arenas (Note [One pinned budget per process] in pinned_budget.cpp), so that
// tidepool.pinned_budget bounds all that tidepool pins; before, the ranges the Python
// hooks evict after each step pinned without bound, and the budget bounded the stores
// alone. A host backing the budget has no room for is not created: a move to the host
// stops at that chunk without an error, the rest of the range staying on the device
// (every byte still readable at its address; host-NUMA memory has no pageable kind to
// fall back to), counted in MigrationResult::bytes_left and VmmStats::pinned_budget_stops
// and bytes_left_on_device, and said once on stderr; the next range is still tried, so a
// smaller chunk may still fit. New state falls back to the device instead (Note [New
// state where the budget puts it] in vmm_migration.cpp). Spares count: they are pinned;
// torch.cuda.empty_cache() releases them.
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>

#include "allocator/stats.h"
#include "allocator/warn_once.h"
#include "tiering/pinned_budget.h"
#include "tiering/vmm_migration.h"

namespace tidepool {

// ---- pinned host backings (Note [Pinned host backings]) ----------------------------------------

VmmPool::NewBacking VmmPool::create_backing(std::size_t bytes, MemoryLocation where) {
  if (where == MemoryLocation::device) return NewBacking{backend_.create_physical(bytes, where)};
  if (!charge_pinned(bytes)) return NewBacking{PhysicalHandle{}, true};
  PhysicalHandle h;
  try {
    h = backend_.create_physical(bytes, where);
  } catch (...) {
    uncharge_pinned(bytes);
    throw;
  }
  if (!h) uncharge_pinned(bytes);
  return NewBacking{h};
}

void VmmPool::release_backing(PhysicalHandle physical, std::size_t bytes, MemoryLocation where) {
  backend_.release_physical(physical, bytes);
  if (where == MemoryLocation::host) uncharge_pinned(bytes);
}

// A refusal is tried once more under the lock: a helper's refusal may be stale (another
// arena or pool gave pinned memory back since), and the pool's own spares may hold the
// room, charged but of other sizes than this chunk (it would have taken one of its size).
// Those go first, largest first, until what they give back covers the chunk, and only when
// that is enough with the budget's room: a pool evicting ranges of a new shape is not
// stopped by the spares of the old ones, nor does it give up spares for nothing. A refusal
// counts (pinned_budget_refusals) when this retry is refused too: the chunk then stays.
VmmPool::NewBacking VmmPool::retry_refused_host_backing_locked(std::size_t bytes) {
  const std::size_t budget = pinned_budget_now();
  const std::size_t charged = pinned_bytes_against_budget();
  const std::size_t room = charged < budget ? budget - charged : 0;
  if (room < bytes && room + spare_bytes_ >= bytes) {
    std::size_t released = 0;
    while (room + released < bytes && !spares_.empty()) released += release_largest_spare_locked();
  }
  NewBacking b = create_backing(bytes, MemoryLocation::host);
  if (b.pinned_budget_spent) pinned_refusals_.fetch_add(1, std::memory_order_relaxed);
  return b;
}

// A budget of the pool's own is checked against its own count (a compare-and-swap, as the
// helpers charge concurrently); the process's against the process's count, and then
// counted in the pool's too, for its stats and for giving back.
bool VmmPool::charge_pinned(std::size_t bytes) {
  if (pinned_budget_shared()) {
    if (!charge_process_pinned(bytes, process_pinned_budget().bytes)) return false;
    pinned_charged_.fetch_add(bytes);
    return true;
  }
  const std::size_t budget = options_.pinned_budget_bytes;
  std::size_t now = pinned_charged_.load();
  do {
    if (bytes > budget || now > budget - bytes) return false;
  } while (!pinned_charged_.compare_exchange_weak(now, now + bytes));
  return true;
}

void VmmPool::uncharge_pinned(std::size_t bytes) noexcept {
  pinned_charged_.fetch_sub(bytes);
  if (pinned_budget_shared()) uncharge_process_pinned(bytes);
}

bool VmmPool::pinned_budget_shared() const {
  return options_.pinned_budget_bytes == VmmPoolOptions::kProcessPinnedBudget;
}

std::size_t VmmPool::pinned_budget_now() const {
  return pinned_budget_shared() ? process_pinned_budget().bytes : options_.pinned_budget_bytes;
}

std::size_t VmmPool::pinned_bytes_against_budget() const {
  return pinned_budget_shared() ? process_pinned_bytes() : pinned_charged_.load();
}

void VmmPool::warn_pinned_budget_spent_locked(std::size_t bytes) {
  if (!warn_once_due(warned_pinned_budget_)) return;
  const bool shared = pinned_budget_shared();
  const std::string budget = format_bytes(pinned_budget_now());
  const std::string pinned = format_bytes(pinned_bytes_against_budget());
  std::fprintf(stderr,
               "tidepool: vmm pool: the pinned host budget (%s, %s; %s pinned by %s now) has no "
               "room for a %s chunk of pointer-stable state, which is kept in device memory "
               "instead. Raise tidepool.pinned_budget, or release pinned memory "
               "(torch.cuda.empty_cache() gives back the spare host backings). Said once; the "
               "tiering stats' vmm_pinned_budget_stops and vmm_bytes_left_on_device count "
               "them.\n",
               budget.c_str(), shared ? "the process's" : "the pool's own", pinned.c_str(),
               shared ? "the process" : "the pool", format_bytes(bytes).c_str());
}

// ---- spare host backings (Note [Spare host backings]) ------------------------------------------

PhysicalHandle VmmPool::take_spare_locked(std::size_t bytes) {
  auto it = spares_.find(bytes);
  if (it == spares_.end()) return PhysicalHandle{};
  const PhysicalHandle h = it->second;
  spares_.erase(it);
  spare_bytes_ -= bytes;
  return h;
}

std::size_t VmmPool::spare_limit_locked() const {
  return std::min(options_.spare_host_bytes,
                  static_cast<std::size_t>(stats_.device_backed_bytes));
}

std::size_t VmmPool::release_largest_spare_locked() {
  // Room to defer its release before the spare leaves the list: a std::bad_alloc then
  // leaves it a spare, not a handle in neither list (Note [Deferred releases]).
  deferred_releases_.reserve(deferred_releases_.size() + 1);
  auto largest = std::prev(spares_.end());
  const auto [bytes, h] = *largest;
  spares_.erase(largest);
  spare_bytes_ -= bytes;
  const std::size_t deferred = deferred_releases_.size();
  release_or_defer_locked(h, bytes, MemoryLocation::host);
  return deferred_releases_.size() == deferred ? bytes : 0;  // a deferred one stays charged
}

// Never throws: it runs where the work is done (a move's end, from a destructor; a free
// that succeeded; empty_cache). One spare at a time, each out of the list before its
// release (review finding: released in a walk of the list and cleared after it, a throw
// part-way left released handles listed as spares, to be mapped or released again).
// Without heap to defer a release the spares beyond `limit` stay, valid and charged,
// until a later call.
void VmmPool::release_spares_beyond_locked(std::size_t limit) noexcept {
  try {
    while (spare_bytes_ > limit && !spares_.empty()) release_largest_spare_locked();
  } catch (const std::bad_alloc&) {
  }
}

void VmmPool::trim_spares_locked() noexcept { release_spares_beyond_locked(spare_limit_locked()); }

void VmmPool::release_spare_host_backings() {
  std::lock_guard lock(mutex_);
  release_spares_beyond_locked(0);
}

// ---- deferred releases and repairs (Note [Deferred releases]) ------------------------------

// Note [Deferred releases]
// A backing the pool no longer uses (the old one once a migration has mapped the new one
// in its place, the new one after a failed step, a freed range's) is released at once.
// When the backend fails that release, the handle is not dropped: it goes on
// deferred_releases_, and every later call that changes the pool (allocate, deallocate,
// migrate, migrate_tag) retries it first, as the destructor does a last time. A failed
// release is not the caller's failure (the move or the free it asked for is done, and
// every chunk's record names the backing mapped at its address), so it throws nothing;
// the stats count what is waiting. A release that threw is taken not to have happened,
// so each handle is released exactly once.
// The same repair (repair_locked) unmaps the scratch range when that unmap failed (the
// next migration maps there), and maps a chunk's backing again when a failed migration
// could map neither the new nor the old backing at the chunk's address: the chunk keeps
// the old backing, which holds its data, so the bytes are back at the same address after
// the next call; until then a migrate of that range throws.
void VmmPool::release_or_defer_locked(PhysicalHandle physical, std::size_t bytes,
                                      MemoryLocation where) {
  try {
    release_backing(physical, bytes, where);
  } catch (const BackendError&) {
    deferred_releases_.push_back(DeferredRelease{physical, bytes, where});
  }
}

// What fails again stays for the next call (Note [Deferred releases]).
void VmmPool::repair_locked() {
  if (!scratch_mapped_.empty()) {
    try {
      // A copy into it may still run when the synchronize after it failed.
      backend_.stream_synchronize(stream_);
      unmap_scratch_locked();
    } catch (const BackendError&) {
    }
  }
  if (unmapped_chunks_ > 0) {
    for (auto& [base, r] : ranges_) {
      for (Chunk& c : r.chunks) {
        if (c.mapped) continue;
        try {
          backend_.map(r.base + c.offset, c.bytes, c.physical);
          c.mapped = true;
          unmapped_chunks_--;
        } catch (const BackendError&) {
        }
      }
    }
  }
  std::erase_if(deferred_releases_, [&](const DeferredRelease& d) {
    try {
      release_backing(d.physical, d.bytes, d.where);
      return true;
    } catch (const BackendError&) {
      return false;
    }
  });
}

void VmmPool::unmap_scratch_locked() {
  while (!scratch_mapped_.empty()) unmap_scratch_slot_locked(scratch_mapped_.back().offset);
}

void VmmPool::unmap_scratch_slot_locked(std::size_t offset) {
  auto it = std::ranges::find(scratch_mapped_, offset, &ScratchSlot::offset);
  if (it == scratch_mapped_.end()) return;
  backend_.unmap(static_cast<char*>(scratch_) + offset, it->bytes);
  scratch_mapped_.erase(it);
}

}  // namespace tidepool
