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
// memory when the arena can pin it now: a new pinned block, a memcpy on the host (under
// the store's lock, once per handle), the pageable block freed.
//   - Only a block no copy uses: the last copy-back into it (host_ready) and the last load
//     out of it (dev_ready: a prefetched copy evicted clean before its load landed) are
//     done. A block still in use is left for a later load; nothing waits.
//   - Once refused (the budget still spent, or the backend would not register), the store
//     asks again only after the arena's pinned room changed (HostArena::pinned_room_epoch),
//     so a store whose budget stays spent costs one comparison per load, not a failed
//     allocation.
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
    const HostBlock pinned = host_.try_allocate_pinned(e.bytes);
    if (!pinned) {
      // Read after the attempt: a registration that failed gave its charge back, which
      // moved the epoch but made no room.
      promotion_refused_at_ = host_.pinned_room_epoch();
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
