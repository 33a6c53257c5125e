// Which resident handle a tiered store evicts: the unacquired one whose next use is
// furthest (PrefetchPolicy::eviction_score), found without scoring every resident handle
// (Note [Resident handles], Note [Eviction order]). Every eviction of the store goes
// through eviction_victim_locked: make_room_locked and the device-OOM loop
// (store_budget.cpp), reclaim (tiered_store.cpp).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <utility>

#include "tiering/store_entry.h"
#include "tiering/tiered_store.h"

namespace tidepool {

// Note [Resident handles]
// Every eviction picks its victim among the resident, unacquired handles. A search over
// every handle made each eviction cost as much as the store has handles: under a budget
// holding 64 of 16,000 handles, where every acquire's prefetch evicts one, an acquire
// cost 266 us on the host CPU against 19 us with 1,000 handles
// (tidepool_bench_store_handles). So the store keeps the entries whose device copy is
// set in resident_ (each knows its slot, so joining and leaving are O(1)): a load adds
// its entry as it sets the device copy, evict_locked removes it as it drops it.

// Note [Eviction order]
// Scoring each resident handle at every eviction still cost as much as the store holds
// resident: 23 us per acquire with 1,024 resident and 45 us with 4,096, against 5.8 us
// with 64 (tidepool_bench_store_handles, 16,000 handles). So the store keeps its
// evictable handles (resident, not acquired) in a max-heap, `evictable_`, by their
// eviction keys (Note [Eviction keys] in prefetch_policy.h), ties to the larger handle
// id: the top is the victim, found in O(1), and a handle joins or leaves it in O(log n).
// A handle's key changes only when it is acquired, and an acquired handle is out of the
// heap; it is keyed afresh when released. Anything else that changes the keys changes
// the policy's key epoch: the heap is then dropped (`evictable_valid_` false) and built
// again, scoring each evictable handle once, by the next eviction that needs it; until
// then joins and leaves leave it alone. A step that follows its shape keeps the epoch
// from its begin_step to its end_step, so the heap is built about once per step; steps
// that deviate at every acquire build it at every eviction, which costs what the scan
// did. Each entry knows its slot (Entry::evictable_slot), and the heap's capacity
// follows resident_'s (create reserves both), so joining cannot fail.

// Note [A victim that cannot be evicted]
// An eviction can fail for good for one handle: a stream that used it was destroyed
// without release_stream (its use event cannot be recorded), or its copy-back keeps
// failing. The handle then stays resident and, its next use the furthest, the first
// victim: every acquire that needed room, every prefetch and every reclaim (the
// allocator's out-of-memory hook, the other stores' requests for room) failed with its
// error, though other handles could have been evicted (review finding). So within one
// operation that evicts to make room (make_room_locked, the device's out-of-memory loop in
// allocate_reserved_locked, reclaim_locked), a victim whose eviction fails is skipped:
// marked out of evictable_ until the operation ends (SkippedVictims puts it back), and
// the next victim is taken. The error stays with the handle's own operations (evict,
// write, destroy say it), and an operation that finds no room without the skipped ones
// throws the first failure, as before: the caller learns why there was none.

bool TieredStore::evict_or_skip_locked(Entry& victim) {
  try {
    evict_locked(victim);
    return true;
  } catch (...) {
    skipped_victims_.push_back(&victim);  // a std::bad_alloc here goes on instead
    if (!victim_failure_) victim_failure_ = std::current_exception();
    victim.eviction_skipped = true;
    evictable_update_locked(victim);
    return false;
  }
}

TieredStore::SkippedVictims::~SkippedVictims() {
  for (Entry* e : store_.skipped_victims_) {
    e->eviction_skipped = false;
    store_.evictable_update_locked(*e);
  }
  store_.skipped_victims_.clear();
  store_.victim_failure_ = nullptr;
}

void TieredStore::SkippedVictims::rethrow_failure() const {
  if (store_.victim_failure_) std::rethrow_exception(store_.victim_failure_);
}

bool TieredStore::evicted_sooner(const Entry* a, const Entry* b) noexcept {
  return a->evict_key != b->evict_key ? a->evict_key > b->evict_key : a->id > b->id;
}

void TieredStore::evictable_place_locked(std::size_t slot, Entry* e) noexcept {
  evictable_[slot] = e;
  e->evictable_slot = slot;
}

void TieredStore::evictable_sift_locked(std::size_t slot) noexcept {
  Entry* e = evictable_[slot];
  while (slot > 0) {  // up, while it goes before its parent
    const std::size_t parent = (slot - 1) / 2;
    if (!evicted_sooner(e, evictable_[parent])) break;
    evictable_place_locked(slot, evictable_[parent]);
    slot = parent;
  }
  while (true) {  // down, while a child goes before it
    std::size_t first = slot;
    Entry* first_entry = e;
    for (std::size_t child = 2 * slot + 1; child <= 2 * slot + 2 && child < evictable_.size();
         ++child) {
      if (evicted_sooner(evictable_[child], first_entry)) {
        first = child;
        first_entry = evictable_[child];
      }
    }
    if (first == slot) break;
    evictable_place_locked(slot, first_entry);
    slot = first;
  }
  evictable_place_locked(slot, e);
}

void TieredStore::evictable_drop_locked() noexcept {
  for (Entry* e : evictable_) e->evictable_slot = Entry::kNotEvictable;
  evictable_.clear();
  evictable_valid_ = false;
}

void TieredStore::evictable_update_locked(Entry& e) noexcept {
  if (!evictable_valid_) return;  // the next eviction builds it
  const bool evictable =
      e.resident_slot != Entry::kNotResident && e.pins == 0 && !e.eviction_skipped;
  const bool in_heap = e.evictable_slot != Entry::kNotEvictable;
  if (evictable == in_heap) return;  // a key changes only with an acquire: out, then in
  if (in_heap) {
    const std::size_t slot = e.evictable_slot;
    Entry* last = evictable_.back();
    evictable_.pop_back();
    e.evictable_slot = Entry::kNotEvictable;
    if (last != &e) {
      evictable_place_locked(slot, last);
      evictable_sift_locked(slot);
    }
    return;
  }
  if (policy_.eviction_key_epoch() != evictable_epoch_) {
    evictable_drop_locked();
    return;
  }
  try {
    e.evict_key = policy_.eviction_key(e.id);
  } catch (...) {  // the policy's look-ahead could not be built (no memory): build later
    evictable_drop_locked();
    return;
  }
  evictable_.push_back(&e);  // within the capacity create reserved: cannot throw
  e.evictable_slot = evictable_.size() - 1;
  evictable_sift_locked(e.evictable_slot);
}

void TieredStore::evictable_build_locked() {
  evictable_drop_locked();
  evictable_epoch_ = policy_.eviction_key_epoch();
  for (Entry* e : resident_) {
    if (e->pins > 0 || e->eviction_skipped) continue;
    e->evict_key = policy_.eviction_key(e->id);
    evictable_.push_back(e);
  }
  std::make_heap(evictable_.begin(), evictable_.end(),
                 [](const Entry* a, const Entry* b) { return evicted_sooner(b, a); });
  for (std::size_t i = 0; i < evictable_.size(); ++i) evictable_[i]->evictable_slot = i;
  evictable_valid_ = true;
}

TieredStore::Entry* TieredStore::eviction_victim_locked(std::optional<std::size_t> above) {
  if (!evictable_valid_ || policy_.eviction_key_epoch() != evictable_epoch_) {
    evictable_build_locked();
  }
  if (evictable_.empty()) return nullptr;
  Entry* victim = evictable_[0];
  if (above && policy_.eviction_score_of_key(victim->evict_key) <= *above) return nullptr;
  return victim;
}

void TieredStore::note_resident_locked(Entry& e) noexcept {
  e.resident_slot = resident_.size();
  resident_.push_back(&e);  // within the capacity create reserved: cannot throw
  evictable_update_locked(e);
}

void TieredStore::note_not_resident_locked(Entry& e) noexcept {
  if (e.resident_slot == Entry::kNotResident) return;
  Entry* last = resident_.back();
  resident_[e.resident_slot] = last;
  last->resident_slot = e.resident_slot;
  resident_.pop_back();
  e.resident_slot = Entry::kNotResident;
  evictable_update_locked(e);
}

}  // namespace tidepool
