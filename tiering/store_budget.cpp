// The tiered store's room on the device: how a load gets room within its budget (its own,
// or the device's tidepool.state_budget shared with the device's other stores and VMM
// ranges: Note [Shared state budget] in device_budget_ledger.h), the books of that budget,
// and an acquire that asks the other stores for room (which resident handle an eviction
// takes is in eviction_order.cpp). The budget's invariant is at the
// top of tiered_store.cpp; the buffers on their way out, which a load may take or hand
// back in stream order, are in pending_frees.cpp; what a store gives back when asked is
// give_back_for_peer in tiered_store.cpp, beside reclaim, whose work it shares.
//
// The books: the store's charge is device_bytes_ (resident buffers and buffers on their
// way out) plus reserved_, the room taken for the one buffer being allocated. Room is
// reserved before the allocation and given back if it fails, so the charge never falls
// below what the store holds, and with a shared budget another store cannot take the
// same room in between (its check and its charge are one atomic step in the ledger).
#include <algorithm>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "tiering/store_entry.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"

namespace tidepool {

// ---- the books ---------------------------------------------------------------------------

bool TieredStore::reserve_locked(std::size_t bytes) {
  if (shared_) {
    if (!shared_->try_charge(bytes, options_.device_budget_bytes)) return false;
  } else if (device_bytes_ + reserved_ + bytes > options_.device_budget_bytes) {
    return false;
  }
  reserved_ += bytes;
  return true;
}

void TieredStore::unreserve_locked(std::size_t bytes) noexcept {
  reserved_ -= bytes;
  if (shared_) shared_->uncharge(bytes);
}

void TieredStore::commit_reserved_locked(std::size_t bytes) {
  reserved_ -= bytes;
  device_bytes_ += bytes;
  note_device_bytes_locked();
}

void TieredStore::uncharge_locked(std::size_t bytes) noexcept {
  device_bytes_ -= bytes;
  if (shared_) shared_->uncharge(bytes);
}

std::size_t TieredStore::peer_bytes_locked() const noexcept {
  return shared_ ? shared_->others_bytes() : 0;
}

std::size_t TieredStore::held_once_written_back_locked() const noexcept {
  std::size_t held = peer_bytes_locked() + device_bytes_ + reserved_;
  for (const PendingFree& f : pending_frees_) held -= f.bytes;
  return held;
}

std::size_t TieredStore::peer_shortfall_locked(std::size_t bytes) const {
  const std::size_t wanted = held_once_written_back_locked() + bytes;
  return wanted > options_.device_budget_bytes ? wanted - options_.device_budget_bytes : 0;
}

// ---- room for a load ----------------------------------------------------------------------

// Frees room for `bytes` within the budget. Evicts released handles, furthest next use
// first; for a prefetch (may_wait false) only handles needed later than the incoming one.
// Once the pending frees would leave room when their write-backs finish, the load gets it
// from them in stream order (room_from_pending_locked) instead of waiting on the host;
// only an acquire whose room the pending frees cannot give that way waits, oldest first,
// and only when their write-backs would leave room (Note [No room, no wait]).
// What the other participants of a shared budget hold counts as held: this store's own
// evictions and write-backs are all it can use here; the others are asked by the acquire
// once this returns none (with_room_from_peers), a prefetch never asks them.
TieredStore::Room TieredStore::make_room_locked(std::size_t bytes, const Entry* incoming,
                                                bool may_wait, bool others_first) {
  // Note [A victim that cannot be evicted] (eviction_order.cpp).
  const SkippedVictims skipped(*this);
  const Room room = find_room_locked(bytes, incoming, may_wait, others_first);
  if (room.kind == Room::Kind::none) skipped.rethrow_failure();
  return room;
}

TieredStore::Room TieredStore::find_room_locked(std::size_t bytes, const Entry* incoming,
                                                bool may_wait, bool others_first) {
  const std::size_t budget = options_.device_budget_bytes;
  const std::size_t incoming_score =
      incoming != nullptr && !may_wait ? policy_.eviction_score(incoming->id) : 0;
  // Review finding: a load that cannot fit beside the acquired handles evicted every
  // released one first (a copy back each), and with a shared budget had the other stores
  // evict theirs, all for nothing. (No pending free can be taken over either: its bytes
  // are charged beside the acquired ones.)
  const bool hopeless = never_fits_beside_acquired_locked(bytes);
  while (true) {
    reap_frees_locked(/*wait_all=*/false);
    if (reserve_locked(bytes)) return {Room::Kind::fresh, 0};
    if (hopeless) return {Room::Kind::none, 0};
    // Nothing is reserved here (a reservation is taken only as this returns).
    if (held_once_written_back_locked() + bytes > budget) {
      Entry* victim = eviction_victim_locked(
          may_wait ? std::nullopt : std::optional<std::size_t>(incoming_score));
      // Note [Shared state budget], step 1: the furthest own handle is used again in this
      // step (so are all the others): the other stores are asked first.
      if (victim != nullptr && others_first &&
          policy_.eviction_score_of_key(victim->evict_key) < policy_.rest_of_step()) {
        victim = nullptr;
      }
      if (victim != nullptr) {
        evict_or_skip_locked(*victim);
        continue;
      }
      // Note [No room, no wait]
      // All acquired (or needed sooner, or left for the others first): even with every
      // write-back of this store done, the load would not fit. A pending free of exactly
      // its size may still be taken over (its charge passes to the load), but waiting for
      // the write-backs frees no room the load could use: it would sync the host with the
      // device for nothing (counted as a budget wait and exposed time) and, with a shared
      // budget, drain them all before the other stores are asked.
      const Room room = room_from_pending_locked(bytes);
      return room.kind == Room::Kind::take_over ? room : Room{Room::Kind::none, 0};
    }
    const Room room = room_from_pending_locked(bytes);
    if (room.kind == Room::Kind::take_over) return room;
    if (room.kind == Room::Kind::release_pending) {
      // The pending frees' charge covers the load up to their bytes; the rest is reserved
      // now, so that no other store takes the room before they are handed back.
      std::size_t released = 0;
      for (std::size_t i = 0; i < room.n; ++i) released += pending_frees_[i].bytes;
      if (bytes <= released || reserve_locked(bytes - released)) return room;
    }
    if (!may_wait || pending_frees_.empty()) return {Room::Kind::none, 0};
    stats_.budget_waits++;
    copies_.wait_exposed(pending_frees_.front().after);
  }
}

TieredStore::DeviceBuffer TieredStore::device_allocate_locked(std::size_t bytes,
                                                              const Entry* incoming, RoomFor why) {
  const bool may_wait = why != RoomFor::prefetch;
  const Room room =
      make_room_locked(bytes, incoming, may_wait, why == RoomFor::acquire_may_ask_peers);
  switch (room.kind) {
    case Room::Kind::none:
      if (why == RoomFor::acquire) throw_no_room_locked(bytes);
      return {};  // a prefetch is skipped; an acquire asks the other stores
    case Room::Kind::take_over: {  // a buffer on its way out: its bytes stay charged
      const PendingFree f = pending_frees_[room.n];
      pending_frees_.erase(pending_frees_.begin() + static_cast<long>(room.n));
      stats_.buffers_reused++;
      return DeviceBuffer{f.ptr, f.after};
    }
    case Room::Kind::release_pending:
      try {
        release_pending_locked(room.n);
      } catch (...) {
        unreserve_locked(reserved_);  // those handed back are no longer charged
        throw;
      }
      if (reserved_ > bytes) unreserve_locked(reserved_ - bytes);
      break;
    case Room::Kind::fresh:
      break;
  }
  return allocate_reserved_locked(bytes, may_wait);
}

TieredStore::DeviceBuffer TieredStore::allocate_reserved_locked(std::size_t bytes,
                                                                bool may_wait) {
  const Stream s = copies_.stream(Direction::host_to_device);
  void* p = nullptr;
  const SkippedVictims skipped(*this);  // Note [A victim that cannot be evicted]
  try {
    p = !may_wait && device_.try_allocate ? device_.try_allocate(bytes, s)
                                          : device_.allocate(bytes, s);
    bool last_ask = false;
    // The device itself is out of memory (others use it too): give back what we hold.
    while (p == nullptr) {
      if (!may_wait) {
        unreserve_locked(bytes);
        return {};
      }
      // The same victim the budget would give up: the furthest next use.
      Entry* victim = eviction_victim_locked(std::nullopt);
      if (victim != nullptr) evict_or_skip_locked(*victim);
      if (victim == nullptr && pending_frees_.empty() && !last_ask &&
          detail::registry_wait_failed_in_store_operation()) {
        // Nothing of this store's left to give, and an OOM hook skipped waiting for a busy
        // registry: the last ask may wait for it again (Note [One wait for a busy registry
        // per store operation]), for the other stores' room, before the request fails.
        last_ask = true;
        detail::allow_another_registry_wait();
        p = device_.allocate(bytes, s);
        continue;
      }
      if (victim == nullptr && pending_frees_.empty()) {
        skipped.rethrow_failure();
        throw TieringError("tiered store: the device is out of memory for " +
                           std::to_string(bytes) + " bytes of tiered state (the store holds " +
                           std::to_string(device_bytes_) +
                           " bytes, none of them evictable now)");
      }
      reap_frees_locked(/*wait_all=*/true);
      p = device_.allocate(bytes, s);
    }
  } catch (...) {
    unreserve_locked(bytes);
    throw;
  }
  commit_reserved_locked(bytes);
  return DeviceBuffer{p, {}};
}

std::size_t TieredStore::acquired_bytes_locked() const noexcept {
  std::size_t acquired = 0;
  for (const Entry* e : resident_) {
    if (e->pins > 0) acquired += e->bytes;
  }
  return acquired;
}

bool TieredStore::never_fits_beside_acquired_locked(std::size_t bytes) const noexcept {
  const std::size_t budget = options_.device_budget_bytes;
  const std::size_t acquired = acquired_bytes_locked();
  return acquired > budget || bytes > budget - acquired;
}

void TieredStore::throw_no_room_locked(std::size_t bytes) {
  const std::size_t acquired = acquired_bytes_locked();
  std::string what = "tiered store: no room for " + std::to_string(bytes) +
                     " bytes in the device budget of " +
                     std::to_string(options_.device_budget_bytes) + " bytes: " +
                     std::to_string(acquired) + " bytes are held by acquired handles";
  if (shared_) {
    what += " of this store, and the budget is shared (tidepool.state_budget, the device's): "
            "the device's other tiered stores and pointer-stable ranges hold " +
            std::to_string(peer_bytes_locked()) +
            " bytes of it, none of which they could give back (acquired handles and VMM "
            "ranges stay; Note [Shared state budget])";
  }
  throw TieringError(what);
}

// ---- asking the other stores --------------------------------------------------------------

namespace {
// Asks that gave nothing back, in a row, before an acquire takes "no room" for an answer.
// One is usually enough: the peers had nothing released. More than one covers a peer's
// own acquire taking the room this one was given before it could take it.
constexpr int kFruitlessPeerAsks = 3;
}  // namespace

// Note [Shared state budget], step 2. The attempt looks its handle up afresh each time
// (acquire_locked): with the lock let go, another thread may have loaded it (a prefetch),
// or destroyed it.
void* TieredStore::with_room_from_peers(std::unique_lock<std::mutex>& lock, std::size_t bytes,
                                        const std::function<void*(RoomFor)>& attempt) {
  int fruitless = 0;
  bool counted = false;  // peer_room_requests counts the calls that asked, not the asks
  while (true) {
    const RoomFor why =
        fruitless < kFruitlessPeerAsks ? RoomFor::acquire_may_ask_peers : RoomFor::acquire;
    if (void* p = attempt(why)) return p;
    // What the others give back cannot make room beside this store's acquired handles.
    if (never_fits_beside_acquired_locked(bytes)) throw_no_room_locked(bytes);
    // At least a byte: a shortfall of 0 means another store took room as this one asked.
    const std::size_t shortfall = std::max<std::size_t>(peer_shortfall_locked(bytes), 1);
    if (!std::exchange(counted, true)) stats_.peer_room_requests++;
    lock.unlock();
    const std::size_t given = shared_->ask_peers(shortfall);
    lock.lock();
    fruitless = given == 0 ? fruitless + 1 : 0;
  }
}

}  // namespace tidepool
