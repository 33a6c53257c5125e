// TieredStore: residency of handles between the host tiers and the device budget.
//
// Note [Handle state machine]
// A handle always has a host block. Its device side is one of:
//
//   HOST       dev == null. host copy valid (after host_ready, if a copy-back is in flight).
//   LOADING    dev != null, H2D copy in flight; dev_ready completes when it lands.
//   RESIDENT   dev != null, dev_ready done (streams wait on dev_ready anyway, so LOADING
//              and RESIDENT are handled alike). dev_dirty: device newer than host.
//   ACQUIRED   RESIDENT/LOADING with pins > 0: may not be evicted, destroyed or read.
//
//   HOST     --acquire/prefetch--> LOADING   (device buffer taken within the budget;
//                                             H2D waits on host_ready)
//   HOST     --acquire_to_overwrite-> ACQUIRED (the same, without the copy; dirty at once:
//                                             Note [Acquiring to overwrite])
//   LOADING  --(event)-----------> RESIDENT
//   RESIDENT --acquire-----------> ACQUIRED  (stream waits on dev_ready and on the
//                                             earlier use streams; pins++)
//   ACQUIRED --release(dirty)----> RESIDENT  (pins--; dirty -> host copy stale)
//   RESIDENT --evict-------------> HOST      (dirty: D2H after the use streams, host_ready
//                                             recorded after it; clean: no copy. The
//                                             buffer is freed once the D2H stream passes
//                                             free_after: a PendingFree, still charged to
//                                             the budget until it is reaped)
//
// Invariants: host_valid || dev != null (someone holds the latest bytes);
// device_bytes_ = bytes of resident handles + pending frees <= budget, always (with a
// shared budget, the device's participants together: Note [Shared state budget] in
// device_budget_ledger.h).
// A failed copy leaves the state as it was before the operation (H2D failure: buffer
// freed, or back among the pending frees if it was taken over from one or cannot be
// handed back now, still HOST: Note [A failed load's buffer] in pending_frees.cpp; D2H
// failure: still RESIDENT and dirty), so the last good copy stays.
//
// Note [Both directions at once]
// Loads go on the copy engine's H2D stream and copy-backs on its D2H stream, so an
// eviction and a prefetch issued together use both directions of the link. Nothing
// between them makes the host wait: chunks are enqueued back to back, each transfer
// records one completion event, and a load orders itself after a copy-back only through
// stream waits on events (host_ready, or the events of the buffers on their way out whose
// memory it reuses: Note [Loads over write-backs] in tiered_store.h). The host blocks
// only in acquire() under pressure (no released handle left to evict and no room the
// buffers on their way out can give in stream order: it waits for the oldest pending
// free, counted in budget_waits and exposed time, and only when the pending frees would
// leave room once written back, Note [No room, no wait] in store_budget.cpp; or the
// device itself is out of memory), after a failed copy, and in read()/write()/destroy()/
// synchronize(), which wait by contract. prefetch() and evict() never wait (a prefetch
// without room is skipped).
//
// Note [Locking]
// One mutex guards the store. Backend calls are made under it; they never call back
// into the store (host-backend stream workers only run copies). reclaim() is called from
// an allocator's OOM path, possibly while this store is itself allocating device memory
// on the same thread: it gives up (returns 0) when this thread holds this store's lock
// (InsideStore), and otherwise only try_locks. Another store that runs out of device
// memory on this thread still gets this store's released state. An acquire that asks
// the other stores sharing its budget for room lets its lock go meanwhile, and another
// store's acquire may lock this one to ask it (Note [Shared state budget]).
#include "tiering/tiered_store.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "allocator/config.h"
#include "allocator/tier_routing.h"
#include "allocator/warn_once.h"
#include "tiering/lock_before.h"
#include "tiering/stats_json.h"
#include "tiering/store_entry.h"
#include "tiering/store_errors.h"
#include "tiering/teardown.h"
#include "tiering/tiering_registry.h"

namespace tidepool {

namespace {
// Note [Locking]: the stores whose lock this thread holds while it may allocate (at most
// two deep: a store's OOM reclaims another store), so that an OOM hook reaching one of
// them again gives up instead of locking it twice, while other stores still give room.
thread_local const TieredStore* t_inside_stores[2] = {};
thread_local std::size_t t_inside_depth = 0;
// Note [One wait for a busy registry per store operation] (tiering_registry.cpp): set when
// an OOM hook on this thread waited for the registry in vain during the outermost store
// operation, cleared when that operation ends.
thread_local bool t_registry_wait_failed = false;

class InsideStore {
 public:
  explicit InsideStore(const TieredStore* store) {
    if (t_inside_depth < std::size(t_inside_stores)) t_inside_stores[t_inside_depth] = store;
    ++t_inside_depth;
  }
  ~InsideStore() {
    if (--t_inside_depth == 0) t_registry_wait_failed = false;
  }
  InsideStore(const InsideStore&) = delete;
  InsideStore& operator=(const InsideStore&) = delete;

  static bool holds(const TieredStore* store) {
    const std::size_t known = std::min(t_inside_depth, std::size(t_inside_stores));
    // Deeper than tracked cannot happen (each level is a different store, reached only
    // through an OOM hook); treat it as holding every store, the safe answer.
    if (known < t_inside_depth) return true;
    return std::find(t_inside_stores, t_inside_stores + known, store) != t_inside_stores + known;
  }
};
}  // namespace

namespace detail {
bool registry_wait_failed_in_store_operation() noexcept { return t_registry_wait_failed; }
void note_registry_wait_failed() noexcept {
  if (t_inside_depth > 0) t_registry_wait_failed = true;
}
void allow_another_registry_wait() noexcept { t_registry_wait_failed = false; }
}  // namespace detail

// ---- construction -----------------------------------------------------------------------

TieredStore::TieredStore(Backend& backend, TieredStoreOptions options, DeviceMemorySource device)
    : backend_(backend),
      options_(options),
      device_(whole_memory_source(backend, std::move(device))),  // memory_source.cpp
      host_(backend, options.host),
      copies_(backend, options.copy) {
  bool shared = false;  // the device's configured budget (Note [Shared state budget])
  if (options_.device_budget_bytes == TieredStoreOptions::kDeviceBudgetFromConfig) {
    const auto configured = configured_state_budget_bytes(active_config(), backend_);
    shared = configured.value_or(0) != 0;
    options_.device_budget_bytes = shared ? *configured : TieredStoreOptions::kDefaultDeviceBudget;
  }
  if (options_.device_budget_bytes == 0) throw TieringError("tiered store: device budget is 0");
  stats_.device_budget_bytes = options_.device_budget_bytes;
  if (shared) {
    // Note [Shared state budget]: the other stores may ask for room from now on.
    shared_ = std::make_unique<DeviceBudgetLedger::Seat>(
        DeviceBudgetLedger::of_device(backend_.device()),
        [this](std::size_t bytes_needed) { return give_back_for_peer(bytes_needed); });
  }
  detail::register_tiered_store(backend_.device(), this);
}

// Every release step runs even when an earlier one failed (teardown.h). Buffers are only
// handed back once the device is known to be idle: if it cannot be synchronised (the
// backend is gone), a copy may still be reading or writing them, so they are leaked
// rather than reused under a running transfer. Events are destroyed either way.
TieredStore::~TieredStore() {
  Teardown teardown("tiered store");
  // First, before this store's lock: no other store's acquire asks it for room once this
  // returns (Note [Shared state budget]). What it still holds is given back when the
  // seat goes, after the buffers.
  if (shared_) teardown.attempt("leaving the shared state budget", [&] { shared_->withdraw(); });
  teardown.attempt("leaving the tiering registry",
                   [&] { detail::unregister_tiered_store(backend_.device(), this); });
  const bool idle =
      teardown.attempt("synchronising the device", [&] { backend_.device_synchronize(); });
  std::lock_guard lock(mutex_);
  const Stream d2h = copies_.stream(Direction::device_to_host);
  // Events are destroyed where they are met, not gathered into free_events_ first: a
  // push_back that runs out of heap here would leave this noexcept destructor (review
  // finding: std::terminate with more handles than the list had room for).
  const auto destroy_event = [&](Event ev) {
    teardown.attempt("destroying an event", [&] { backend_.destroy_event(ev); });
  };
  for (const PendingFree& f : pending_frees_) {
    if (idle)
      teardown.attempt("freeing a device buffer", [&] { device_.deallocate(f.ptr, f.bytes, d2h); });
    destroy_event(f.after);
  }
  pending_frees_.clear();
  for (auto& [id, e] : entries_) {
    if (idle) {
      if (e->dev != nullptr) {
        teardown.attempt("freeing a device buffer",
                         [&] { device_.deallocate(e->dev, e->bytes, d2h); });
      }
      teardown.attempt("freeing a host block", [&] { host_.deallocate(e->host); });
    }
    destroy_event(e->dev_ready);
    destroy_event(e->host_ready);
  }
  entries_.clear();
  resident_.clear();
  for (Event ev : free_events_) destroy_event(ev);
  free_events_.clear();
  // copies_ destroys its streams after this body: the memory source must forget them
  // first (Note [Stream contract] in caching_allocator.h). Done even when the device
  // could not be synchronized: the source then keeps the leaked buffers as live blocks.
  if (device_.release_stream) {
    for (Direction d : {Direction::host_to_device, Direction::device_to_host}) {
      teardown.attempt("releasing a copy stream from the memory source",
                       [&] { device_.release_stream(copies_.stream(d)); });
    }
  }
}

TieredStore::Entry& TieredStore::entry_locked(Handle h, const char* op) {
  auto it = entries_.find(h);
  if (it == entries_.end()) {
    throw TieringError(std::string("tiered store: ") + op + " of unknown handle " +
                       std::to_string(h));
  }
  return *it->second;
}

void TieredStore::note_device_bytes_locked() {
  stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, device_bytes_);
}

// ---- create / destroy ---------------------------------------------------------------------

TieredStore::Handle TieredStore::create(std::size_t bytes, int tag, Tier initial) {
  if (bytes == 0) throw TieringError("tiered store: create of 0 bytes");
  if (bytes > options_.device_budget_bytes) {
    throw TieringError("tiered store: a handle of " + std::to_string(bytes) +
                       " bytes can never fit the device budget of " +
                       std::to_string(options_.device_budget_bytes) + " bytes");
  }
  try {
    return create_checked(bytes, tag, initial);
  } catch (...) {
    detail::rethrow_as_tiering_error("create of " + std::to_string(bytes) + " bytes" +
                                     (initial == Tier::device ? " on the device" : ""));
  }
}

TieredStore::Handle TieredStore::create_checked(std::size_t bytes, int tag, Tier initial) {
  const HostBlock host = host_.allocate(bytes);
  std::unique_ptr<Entry> e;
  try {
    e = std::make_unique<Entry>();
  } catch (...) {
    host_.deallocate(host);
    throw;
  }
  std::memset(host.ptr, 0, bytes);
  std::unique_lock lock(mutex_);
  e->bytes = bytes;
  e->tag = tag;
  e->host = host;
  DeviceBuffer buf;
  try {
    e->dev_ready = take_event_locked();
    e->host_ready = take_event_locked();
    if (initial == Tier::device) {
      // Room as an acquire gets it, from the other stores too when the budget is shared;
      // the entry is not in entries_ yet, so no other thread reaches it while the lock is
      // let go to ask them.
      auto allocate = [&](RoomFor why) -> void* {
        InsideStore inside(this);
        buf = device_allocate_locked(bytes, e.get(), why);
        return buf.ptr;
      };
      if (shared_) {
        with_room_from_peers(lock, bytes, allocate);
      } else {
        allocate(RoomFor::acquire);
      }
      e->dev = buf.ptr;
      const Stream s = copies_.stream(Direction::host_to_device);
      if (buf.wait) {
        backend_.stream_wait_event(s, buf.wait);
        give_event_locked(buf.wait);
        buf.wait = {};  // enqueued: the buffer is the H2D stream's now
      }
      backend_.memset_async(buf.ptr, 0, bytes, s);
      backend_.record_event(e->dev_ready, s);
    }
    resident_.reserve(entries_.size() + 1);  // Note [Resident handles]
    evictable_.reserve(entries_.size() + 1);  // Note [Eviction order]
    e->id = next_handle_;
    // Inside the try, and the slot made empty before `e` moves into it: an insert that
    // throws (the node, or a rehash's buckets) leaves `e` here for the catch to give back
    // what it holds (emplace(id, std::move(e)) may destroy it on the way out).
    entries_.try_emplace(e->id).first->second = std::move(e);
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();  // a failure while the other stores were asked
    if (buf.ptr != nullptr) give_back_failed_load_locked(buf, bytes);
    if (e->dev_ready) give_event_locked(e->dev_ready);
    if (e->host_ready) give_event_locked(e->host_ready);
    host_.deallocate(host);
    throw;
  }
  const Handle id = next_handle_++;
  Entry& added = *entries_.at(id);
  if (added.dev != nullptr) note_resident_locked(added);
  return id;
}

void TieredStore::destroy(Handle h) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  Entry& e = entry_locked(h, "destroy");
  if (e.pins > 0) throw TieringError("tiered store: destroy of an acquired handle");
  try {
    // Copies that read or write the host block must be done before it is reused; waited
    // for before the device copy is dropped (Note [Drop the device copy last]).
    backend_.event_synchronize(e.host_ready);
    backend_.event_synchronize(e.dev_ready);
    if (e.dev != nullptr) evict_locked(e, /*discard=*/true);  // the contents die with it
    host_.deallocate(e.host);
  } catch (...) {
    detail::rethrow_as_tiering_error(detail::of_handle("destroy", h, e.bytes));
  }
  // The host block is freed: from here the entry goes whatever fails (kept, it was freed
  // again at the store's teardown). A policy that cannot forget the handle for want of
  // heap starts its schedules over rather than keep one naming a handle that is gone.
  give_event_locked(e.dev_ready);
  give_event_locked(e.host_ready);
  try {
    policy_.forget(h);
  } catch (...) {
    policy_.reset_schedule();
  }
  entries_.erase(h);
}

// ---- moving data --------------------------------------------------------------------------

bool TieredStore::load_locked(Entry& e, RoomFor why, bool load) {
  const bool for_prefetch = why == RoomFor::prefetch;
  const DeviceBuffer buf = device_allocate_locked(e.bytes, &e, why);
  if (buf.ptr == nullptr) return false;
  promote_host_block_locked(e);  // Note [Pageable blocks are promoted]
  const Event waits[] = {e.host_ready, buf.wait};
  try {
    if (load) {
      copies_.transfer(buf.ptr, e.host.ptr, e.bytes, Direction::host_to_device, e.dev_ready,
                       waits);
    } else {  // Note [Acquiring to overwrite]: the load's ordering without its copy
      const Stream h2d = copies_.stream(Direction::host_to_device);
      if (buf.wait) backend_.stream_wait_event(h2d, buf.wait);
      backend_.record_event(e.dev_ready, h2d);
    }
  } catch (const BackendError& err) {
    give_back_failed_load_locked(buf, e.bytes);  // never throws: this error is the one
    throw TieringError(std::string("tiered store: copy to the device failed (the host copy is "
                                   "intact): ") + err.what());
  } catch (...) {
    give_back_failed_load_locked(buf, e.bytes);
    throw;
  }
  // The wait is enqueued; an event may be re-recorded after that (Note [Stream semantics]).
  if (buf.wait) give_event_locked(buf.wait);
  e.dev = buf.ptr;
  note_resident_locked(e);
  e.uncounted_load = !load          ? Entry::LoadBy::none
                     : for_prefetch ? Entry::LoadBy::prefetch
                                    : Entry::LoadBy::acquire;
  return true;
}

// Note [A failed acquire to overwrite]
// acquire_to_overwrite makes a handle on the host resident without its copy and marks the
// device copy the latest only once the acquire succeeds (Note [Acquiring to overwrite]).
// If a wait after the skipped load fails (the caller's stream is invalid, the device in a
// sticky error), no caller ever got the buffer, and its bytes are not the handle's: left
// resident, the next acquire would return them as the latest contents, and a release
// dirty after a partial write would copy them over the intact host copy. So the buffer is
// given back as a failed load's is, and the handle is as before the call: on the host,
// its host copy the latest.
void TieredStore::drop_skipped_load_locked(Entry& e) noexcept {
  note_not_resident_locked(e);
  // No wait event: the H2D stream, where dev_ready was recorded after the buffer's earlier
  // use, is what the give-back orders the free after.
  give_back_failed_load_locked(DeviceBuffer{e.dev, Event{}}, e.bytes);
  e.dev = nullptr;
  e.uncounted_load = Entry::LoadBy::none;
}

void TieredStore::evict_locked(Entry& e, bool discard) {
  const Stream d2h = copies_.stream(Direction::device_to_host);
  // The D2H stream must pass every use of the buffer and its own load.
  for (Stream s : e.use_streams) order_after_use_locked(d2h, s);
  backend_.stream_wait_event(d2h, e.dev_ready);
  const bool copy_back = e.dev_dirty && !discard;
  if (copy_back) {
    // A copy back that fails part-way may have enqueued chunks that host_ready does not
    // cover: they are waited for, whatever the failure (a std::bad_alloc too), before the
    // host block can be freed or reused (a destroy waits on host_ready alone).
    try {
      copies_.transfer(e.host.ptr, e.dev, e.bytes, Direction::device_to_host, e.host_ready);
    } catch (const BackendError& err) {
      backend_.stream_synchronize(d2h);
      throw TieringError(std::string("tiered store: copy back to the host failed (the device "
                                     "copy is kept): ") + err.what());
    } catch (...) {
      backend_.stream_synchronize(d2h);
      throw;
    }
  }
  // The list's room first, so that the push_back cannot lose the event taken (every
  // event goes back to the pool, store_events.cpp). A failed record leaves the handle
  // resident, as a failed copy does.
  pending_frees_.reserve(pending_frees_.size() + 1);
  const Event after = take_recorded_event_locked(d2h);
  pending_frees_.push_back(PendingFree{e.dev, e.bytes, after});
  note_not_resident_locked(e);
  e.dev = nullptr;
  e.dev_dirty = false;
  e.host_valid = true;
  e.uncounted_load = Entry::LoadBy::none;
  e.use_streams.clear();
  device_copies_dropped_++;
  if (!discard) {  // counted once enqueued: a failed eviction left the handle resident
    stats_.evictions++;
    if (!copy_back) stats_.evictions_clean++;
  }
}

void TieredStore::prefetch_ahead_locked() {
  if (!policy_.replaying()) return;
  // Note [Prefetch frontier]: the acquires the last walk passed, and that are still
  // ahead, have their handles on the device unless something was evicted since.
  const std::uint64_t drops = device_copies_dropped_;
  const std::size_t from = drops == drops_at_mark_ ? policy_.still_covered(prefetch_mark_) : 0;
  prefetch_mark_ = {};  // a walk that throws leaves no mark
  const std::size_t covered =
      policy_.visit_upcoming(from, options_.prefetch_lookahead, [&](PrefetchPolicy::HandleId id) {
        auto it = entries_.find(id);
        if (it == entries_.end() || it->second->dev != nullptr) return true;
        if (!load_locked(*it->second, RoomFor::prefetch)) {
          stats_.prefetch_skipped++;
          return false;  // back-pressure: later handles wait for the next acquire
        }
        stats_.prefetch_issued++;
        return true;
      });
  prefetch_mark_ = policy_.mark(covered);
  drops_at_mark_ = drops;
}

// ---- the public operations -------------------------------------------------------------------

void TieredStore::prefetch(Handle h, Stream stream) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  Entry& e = entry_locked(h, "prefetch");
  if (e.dev != nullptr) return;
  bool issued = false;
  try {
    issued = load_locked(e, RoomFor::prefetch);
  } catch (...) {
    detail::rethrow_as_tiering_error(detail::of_handle("prefetch", h, e.bytes));
  }
  if (issued) {
    stats_.prefetch_issued++;
  } else {
    stats_.prefetch_skipped++;
  }
}

void* TieredStore::acquire(Handle h, Stream stream) {
  return acquire_with_room(h, stream, /*load=*/true);
}

// Note [Acquiring to overwrite]
// A caller about to write every byte of a handle (AADL writing a new vector over the
// buffers of a column it dropped: Note [Reusing dropped columns] in
// optimizers/anderson_history.h) has no use for its old contents, and loading them would
// cost the link a copy of the handle's size for nothing. So a handle on the host gets its
// device buffer as a load would (the same room, the same waits on the H2D stream for the
// memory's earlier use, dev_ready recorded there) without the copy. Its device copy then
// becomes the latest (dirty, host copy stale) at once, so that a caller that fails
// half-way, or releases it clean, cannot leave a device copy that differs from a host
// copy still called valid: whatever the device holds is written back.
void* TieredStore::acquire_to_overwrite(Handle h, Stream stream) {
  return acquire_with_room(h, stream, /*load=*/false);
}

void* TieredStore::acquire_with_room(Handle h, Stream stream, bool load) {
  std::unique_lock lock(mutex_);
  if (!shared_) return acquire_locked(h, stream, RoomFor::acquire, load);
  const std::size_t bytes = entry_locked(h, "acquire").bytes;
  return with_room_from_peers(  // store_budget.cpp
      lock, bytes, [&](RoomFor why) { return acquire_locked(h, stream, why, load); });
}

void* TieredStore::acquire_locked(Handle h, Stream stream, RoomFor why, bool load) {
  InsideStore inside(this);
  Entry& e = entry_locked(h, "acquire");
  bool late = false;  // a prefetched copy still in flight
  bool skipped_load = false;  // a device buffer that holds nothing yet (load == false)
  try {
    if (e.dev == nullptr) {
      if (!load_locked(e, why, load)) return nullptr;  // the peers may give room
      skipped_load = !load;
    } else if (e.uncounted_load == Entry::LoadBy::prefetch) {
      late = !backend_.event_query(e.dev_ready);
    }
    backend_.stream_wait_event(stream, e.dev_ready);
    // "The latest contents" include work still queued on the streams that used the buffer
    // before (a release only ends the host's claim, not the stream's writes or reads): the
    // new stream waits for them, else its reads miss those writes and its writes race them.
    for (Stream used : e.use_streams) {
      if (used == stream) continue;
      order_after_use_locked(stream, used);
    }
    // The bookkeeping that can still throw (std::bad_alloc: the use-stream list, the
    // policy's record of the acquire order) comes before anything that makes the acquire
    // take effect, so that a throw leaves the handle unpinned, its counts as they were.
    if (e.pins == 0) {
      // With no other holder left, `stream` is now ordered after every earlier use, so
      // later waits (evict, read, the next acquire) need only this stream.
      std::vector<Stream> only{stream};
      e.use_streams.swap(only);
    } else if (std::find(e.use_streams.begin(), e.use_streams.end(), stream) ==
               e.use_streams.end()) {
      e.use_streams.push_back(stream);
    }
    policy_.on_acquire(h);
  } catch (...) {
    // Nothing is pinned yet: the handle is as a failed load or wait left it (resident or
    // not), never acquired — except a load skipped for an overwrite (Note [A failed
    // acquire to overwrite]), whose buffer goes. (std::bad_alloc passes through as it is.)
    if (skipped_load) drop_skipped_load_locked(e);
    detail::rethrow_as_tiering_error(detail::of_handle("acquire", h, e.bytes));
  }
  // The acquire succeeds: its load is counted now, once (Entry::uncounted_load).
  if (e.uncounted_load == Entry::LoadBy::prefetch) {
    stats_.prefetch_hits++;
    if (late) stats_.prefetch_late++;
  } else if (e.uncounted_load == Entry::LoadBy::acquire) {
    stats_.misses++;
  }
  // Here too (review finding: counted where skipped, a failed acquire counted it, and its
  // retry again).
  if (skipped_load) stats_.loads_skipped++;
  e.uncounted_load = Entry::LoadBy::none;
  if (!load) {  // Note [Acquiring to overwrite]
    e.dev_dirty = true;
    e.host_valid = false;
  }
  e.pins++;
  evictable_update_locked(e);
  stats_.acquires++;
  try {
    prefetch_ahead_locked();
  } catch (const std::exception&) {
    // A prefetch is a hint: its failure must not fail this acquire. The handle it was
    // for stays on the host and the next acquire of it reports the error.
  }
  return e.dev;
}

void TieredStore::release(Handle h, bool dirty) {
  std::lock_guard lock(mutex_);
  Entry& e = entry_locked(h, "release");
  if (e.pins == 0) throw TieringError("tiered store: release of a handle that is not acquired");
  e.pins--;
  evictable_update_locked(e);
  if (dirty) {
    e.dev_dirty = true;
    e.host_valid = false;
  }
}

void TieredStore::evict(Handle h) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  Entry& e = entry_locked(h, "evict");
  if (e.pins > 0) throw TieringError("tiered store: evict of an acquired handle");
  if (e.dev == nullptr) return;
  try {
    evict_locked(e);
  } catch (...) {
    detail::rethrow_as_tiering_error(detail::of_handle("evict", h, e.bytes));
  }
}

void TieredStore::evict_tag(int tag) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  for (auto& [id, e] : entries_) {
    if (e->tag != tag || e->dev == nullptr || e->pins > 0) continue;
    try {
      evict_locked(*e);
    } catch (...) {
      detail::rethrow_as_tiering_error(detail::of_handle("evict_tag", id, e->bytes));
    }
  }
}

void TieredStore::prefetch_tag(int tag, Stream /*stream: loads go on the copy engine's*/) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  // Soonest next use first (then oldest handle): a prefetch evicts only handles needed
  // later than itself, so this order fills the budget with the ones needed first. In the
  // map's order (review finding) the ones needed last could load first, each then evicted
  // by one needed sooner, a copy for nothing, or stop the loop before those were reached.
  std::vector<std::pair<std::size_t, Entry*>> wanted;
  for (auto& [id, e] : entries_) {
    if (e->tag != tag || e->dev != nullptr) continue;
    wanted.emplace_back(policy_.eviction_score(id), e.get());
  }
  std::sort(wanted.begin(), wanted.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second->id < b.second->id;
  });
  for (const auto& [score, e] : wanted) {
    bool issued = false;
    try {
      issued = load_locked(*e, RoomFor::prefetch);
    } catch (...) {
      detail::rethrow_as_tiering_error(detail::of_handle("prefetch_tag", e->id, e->bytes));
    }
    if (!issued) {
      stats_.prefetch_skipped++;
      return;
    }
    stats_.prefetch_issued++;
  }
}

// Note [Reclaim never throws] in tiered_store.h.
std::size_t TieredStore::reclaim(std::size_t bytes_needed,
                                 std::chrono::steady_clock::time_point wait_until) noexcept {
  if (InsideStore::holds(this)) return 0;  // Note [Locking]
  // Note [A busy registry in an OOM] in tiering_registry.cpp: a busy store is waited for,
  // not for ever (its holder may be waiting for this thread).
  std::unique_lock lock(mutex_, std::defer_lock);
  if (!detail::lock_before(lock, wait_until)) return 0;
  InsideStore inside(this);
  stats_.reclaim_calls++;
  std::size_t evicted = 0;
  const std::size_t freed =
      evict_released_locked(bytes_needed, evicted, "reclaim during an out-of-memory");
  stats_.reclaimed_bytes += freed;
  return freed;
}

// Note [Shared state budget] in device_budget_ledger.h: what an OOM's reclaim does, asked
// by another store's acquire, which holds no store lock while it waits for this one, so
// the lock is taken, not tried: a peer busy in an operation finishes it soon.
std::size_t TieredStore::give_back_for_peer(std::size_t bytes_needed) noexcept {
  if (InsideStore::holds(this)) return 0;  // cannot happen (the asker holds no store); safe
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  const std::uint64_t evictions_before = stats_.evictions;
  std::size_t evicted = 0;
  const std::size_t freed = evict_released_locked(
      bytes_needed, evicted, "eviction to give another store room in the shared state budget");
  stats_.peer_evictions += stats_.evictions - evictions_before;
  stats_.peer_evicted_bytes += evicted;
  return freed;
}

std::size_t TieredStore::evict_released_locked(std::size_t bytes_needed, std::size_t& evicted,
                                               const char* why) noexcept {
  const std::size_t before = device_bytes_;
  try {
    reclaim_locked(bytes_needed, evicted);
  } catch (const std::exception& e) {
    stats_.reclaim_failures++;
    warn_reclaim_failure(why, e.what());
  } catch (...) {
    stats_.reclaim_failures++;
    warn_reclaim_failure(why, "a non-standard exception");
  }
  return before > device_bytes_ ? before - device_bytes_ : 0;
}

void TieredStore::warn_reclaim_failure(const char* why, const char* what) noexcept {
  if (!warn_once_due(reclaim_failure_warned_)) return;
  std::fprintf(stderr,
               "tidepool: a tiered store's %s failed and freed less than asked (said once "
               "per store; counted in reclaim_failures): %s\n",
               why, what);
}

void TieredStore::reclaim_locked(std::size_t bytes_needed, std::size_t& scheduled) {
  // A victim whose eviction fails keeps its device copy and is passed over (Note [A victim
  // that cannot be evicted] in eviction_order.cpp); its failure is thrown once the others
  // are freed, when they were not enough.
  const SkippedVictims skipped(*this);
  while (scheduled < bytes_needed) {
    Entry* victim = eviction_victim_locked(std::nullopt);
    if (victim == nullptr) break;
    try {
      if (evict_or_skip_locked(*victim)) scheduled += victim->bytes;
    } catch (...) {  // out of heap: free what was evicted before it
      reap_frees_locked(/*wait_all=*/true);
      throw;
    }
  }
  reap_frees_locked(/*wait_all=*/true);
  if (scheduled < bytes_needed) skipped.rethrow_failure();
}

void TieredStore::begin_step(std::uint64_t schedule) {
  std::lock_guard lock(mutex_);
  policy_.begin_step(schedule);
}

void TieredStore::end_step() {
  std::lock_guard lock(mutex_);
  policy_.end_step();
}

void TieredStore::retire_schedule(std::uint64_t schedule) {
  std::lock_guard lock(mutex_);
  policy_.retire(schedule);
}

bool TieredStore::release_stream(Stream stream) {
  std::lock_guard lock(mutex_);
  const bool named = std::ranges::any_of(entries_, [&](const auto& entry) {
    return std::ranges::find(entry.second->use_streams, stream) != entry.second->use_streams.end();
  });
  if (!named) return false;  // Note [Use streams]: nothing to wait for, no backend call
  backend_.stream_synchronize(stream);  // throws for an unknown stream: nothing forgotten
  forget_stream_locked(stream);
  return true;
}

void TieredStore::forget_stream(Stream stream) {
  std::lock_guard lock(mutex_);
  forget_stream_locked(stream);
}

void TieredStore::forget_stream_locked(Stream stream) {
  for (auto& [id, e] : entries_) std::erase(e->use_streams, stream);
}

std::size_t TieredStore::schedule_count() const {
  std::lock_guard lock(mutex_);
  return policy_.schedule_count();
}

void TieredStore::read(Handle h, void* dst) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  Entry& e = entry_locked(h, "read");
  if (e.pins > 0) throw TieringError("tiered store: read of an acquired handle");
  try {
    read_locked(e, dst);
  } catch (...) {
    detail::rethrow_as_tiering_error(detail::of_handle("read", h, e.bytes));
  }
}

void TieredStore::read_locked(Entry& e, void* dst) {
  if (e.dev != nullptr && e.dev_dirty) {
    const Stream d2h = copies_.stream(Direction::device_to_host);
    // Room first: a push_back that threw would lose the event it was given.
    std::vector<Event> waits;
    waits.reserve(1 + e.use_streams.size());
    waits.push_back(e.dev_ready);
    Event done{};
    try {
      for (Stream s : e.use_streams) waits.push_back(record_use_event_locked(s));
      done = take_event_locked();  // after the use events: they go back if it fails
    } catch (...) {
      for (std::size_t i = 1; i < waits.size(); ++i) give_event_locked(waits[i]);
      throw;
    }
    auto give_back = [&] {
      for (std::size_t i = 1; i < waits.size(); ++i) give_event_locked(waits[i]);
      give_event_locked(done);
    };
    try {
      copies_.transfer(dst, e.dev, e.bytes, Direction::device_to_host, done, waits);
      backend_.event_synchronize(done);
    } catch (const BackendError& err) {
      give_back();  // before the wait, which may fail too (waits enqueued may be re-recorded)
      backend_.stream_synchronize(d2h);
      throw TieringError(std::string("tiered store: copy from the device failed: ") + err.what());
    } catch (...) {
      // std::bad_alloc from the copy engine's books, which may come after the copy was
      // enqueued: `dst` is the caller's again only once the D2H stream has passed it.
      give_back();
      backend_.stream_synchronize(d2h);
      throw;
    }
    give_back();
    return;
  }
  backend_.event_synchronize(e.host_ready);
  std::memcpy(dst, e.host.ptr, e.bytes);
}

// Note [Drop the device copy last]
// write() and destroy() drop a dirty device copy without copying it back, and must wait
// for the copies that use the host block (a copy-back writing it: host_ready; a load
// reading it: dev_ready) before they overwrite or free it. The waits come first: a wait
// can fail (a driver error, a backend that is going away), and once the device copy is
// dropped the host copy is stale, so a failure after the drop would leave no copy of
// the latest data, and the next read would return the stale host bytes as if they were
// current. Waiting first, a failed wait changes nothing: the dirty device copy stays the
// latest, acquire still hands it out, and read copies from it (or, while the backend
// keeps failing, throws). The drop itself fails cleanly (evict_locked), and after it
// nothing can fail: the discarding eviction enqueues no copy that touches the host block.
void TieredStore::write(Handle h, const void* src) {
  std::lock_guard lock(mutex_);
  InsideStore inside(this);
  Entry& e = entry_locked(h, "write");
  if (e.pins > 0) throw TieringError("tiered store: write of an acquired handle");
  try {
    backend_.event_synchronize(e.host_ready);
    backend_.event_synchronize(e.dev_ready);  // a load may still be reading the host block
    if (e.dev != nullptr) evict_locked(e, /*discard=*/true);  // overwritten below
  } catch (...) {
    detail::rethrow_as_tiering_error(detail::of_handle("write", h, e.bytes));
  }
  std::memcpy(e.host.ptr, src, e.bytes);
  e.host_valid = true;
}

// ---- queries ----------------------------------------------------------------------------------

std::size_t TieredStore::size(Handle h) const {
  std::lock_guard lock(mutex_);
  return const_cast<TieredStore*>(this)->entry_locked(h, "size").bytes;
}
int TieredStore::tag(Handle h) const {
  std::lock_guard lock(mutex_);
  return const_cast<TieredStore*>(this)->entry_locked(h, "tag").tag;
}
bool TieredStore::resident(Handle h) const {
  std::lock_guard lock(mutex_);
  return const_cast<TieredStore*>(this)->entry_locked(h, "resident").dev != nullptr;
}
HostTier TieredStore::host_tier(Handle h) const {
  std::lock_guard lock(mutex_);
  return const_cast<TieredStore*>(this)->entry_locked(h, "host_tier").host.tier;
}
std::size_t TieredStore::device_bytes() const {
  std::lock_guard lock(mutex_);
  return device_bytes_;
}

void TieredStore::synchronize() {
  std::lock_guard lock(mutex_);
  try {
    copies_.synchronize();
    reap_frees_locked(/*wait_all=*/true, /*streams_idle=*/true);
  } catch (...) {
    detail::rethrow_as_tiering_error("synchronize");
  }
}

TieredStoreStats TieredStore::stats() {
  std::lock_guard lock(mutex_);
  TieredStoreStats s = stats_;
  s.device_bytes = device_bytes_;
  s.handles = entries_.size();
  s.resident_handles = resident_.size();  // an acquired handle is resident
  for (const Entry* e : resident_) {
    if (e->pins > 0) s.acquired_handles++;
  }
  s.off_schedule_acquires = policy_.off_schedule_acquires();
  s.schedule_adoptions = policy_.schedule_adoptions();
  s.budget_shared = shared_ != nullptr;
  s.peer_bytes = peer_bytes_locked();
  s.host = host_.stats();
  s.copy = copies_.stats();
  return s;
}

std::string TieredStore::stats_json() { return to_json(stats()); }

}  // namespace tidepool
