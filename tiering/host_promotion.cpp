// Moving a tiered handle's host block out of the pageable fallback into pinned memory,
// once pinned memory has room for it again (TieredStore::promote_host_block_locked).
//
// Note [Pageable blocks are promoted]
// A handle whose host block fell back to pageable memory (the pinned budget was spent
// when it was created) would otherwise stay there for good: its copies run at pageable
// speed and do not overlap. That happens in ordinary use, not only on small machines: an
// optimizer that restores a checkpoint creates the new state beside the state it replaces,
// so above half the pinned budget the restored state falls back, and the old state's
// pinned memory is freed right after. So a load first moves such a block into pinned
// memory when the arena can pin it now: a new pinned block, a memcpy on the host, the
// pageable block freed. Once per handle; it is host work under the store's lock (a
// registration, 44 ms/GiB on the H200, and the memcpy), so the load that does it, a
// prefetch too, takes that long once.
//   - Only a block no copy uses: the last copy-back into it (host_ready) and the last load
//     out of it (dev_ready: a prefetched copy evicted clean before its load landed) are
//     done. A block still in use is left for a later load; nothing waits.
//   - A refusal for want of budget is asked again at every load of a pageable handle:
//     the arena answers it without mapping or registering anything, the budget resolved anew each
//     time (a raised tidepool.pinned_budget is seen), for each handle's own size. Any
//     other refusal (the backend would not register, mmap failed, no mimalloc) costs
//     system calls to find out, so it is asked again only once the arena's pinned room
//     changed since (HostArena::pinned_room_epoch, read after the refused attempt, whose
//     own give-backs are then not taken for room made).
//   - Any failure (the backend's event query, the heap, the arena) leaves the handle on
//     its pageable block, as before: a promotion is an improvement, never a new error.
#include <cstring>

#include "tiering/store_entry.h"
#include "tiering/tiered_store.h"

namespace tidepool {

void TieredStore::promote_host_block_locked(Entry& e) noexcept {
  if (e.host.tier != HostTier::pageable) return;
  if (promotion_refused_at_ && *promotion_refused_at_ == host_.pinned_room_epoch()) return;
  try {
    if (!backend_.event_query(e.host_ready) || !backend_.event_query(e.dev_ready)) return;
    HostArena::PinnedAttempt attempt;
    try {
      attempt = host_.try_allocate_pinned(e.bytes);
    } catch (...) {
      attempt = {};
    }
    const HostBlock pinned = attempt.block;
    if (!pinned) {
      if (!attempt.budget_spent) promotion_refused_at_ = host_.pinned_room_epoch();
      return;
    }
    // Even for an acquire to overwrite: should it fail, the host copy is the latest again
    // (Note [A failed acquire to overwrite] in tiered_store.cpp).
    std::memcpy(pinned.ptr, e.host.ptr, e.bytes);
    try {
      host_.deallocate(e.host);
    } catch (...) {  // HostArenaError: the pageable block stays the handle's
      try {
        host_.deallocate(pinned);
      } catch (...) {
      }
      return;
    }
    e.host = pinned;
    stats_.host_promotions++;
    stats_.host_promoted_bytes += e.bytes;
  } catch (...) {
  }
}

}  // namespace tidepool
