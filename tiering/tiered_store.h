// The tiered store: buffers (optimizer state) that live in host memory and are on the
// device exactly while code uses them. The handle state machine is written at the top of
// tiered_store.cpp; the room a load gets within the budget in store_budget.cpp (a budget
// from the configuration is shared: Note [Shared state budget] in device_budget_ledger.h);
// which handle an eviction takes in eviction_order.cpp; the buffers on their way out in
// pending_frees.cpp; the wording of its errors in store_errors.cpp; its event pool in
// store_events.cpp; its memory source in memory_source.cpp; how a handle's host block
// leaves the pageable fallback in host_promotion.cpp; the policy is in
// prefetch_policy.h; the copies in copy_engine.h.
//
// Use:
//   TieredStore store(backend, {.device_budget_bytes = std::size_t{8} << 30});
//   Handle m = store.create(bytes, TIDEPOOL_TAG_OPTIMIZER_STATE);
//   store.begin_step();
//   float* p = static_cast<float*>(store.acquire(m, stream));  // valid on `stream`
//   ... kernels on `stream` read/write p ...
//   store.release(m, /*dirty=*/true);
//   store.end_step();
//
// Guarantees:
//   - the bytes the store holds on the device (resident handles + buffers whose release
//     waits on a stream) never exceed the budget, and with a budget from the
//     configuration neither do the bytes of all the device's stores and VMM ranges that
//     share it; prefetch never evicts a handle needed sooner than the one it brings in,
//     nor another store's, and never waits;
//   - acquire never blocks the host on a copy unless the budget forces it to wait for an
//     eviction to finish (counted as exposed copy time);
//   - a failed copy, registration or allocation throws TieringError and leaves the last
//     good copy of the data readable through read().
//
// Errors: every operation below that can fail throws TieringError, whatever failed
// underneath (the backend, the memory source, the host arena). Its message names the
// operation, the handle and its bytes, then the underlying error's message; the original
// exception is nested in it (std::rethrow_if_nested). Two exceptions: std::bad_alloc
// (host memory for the store's own bookkeeping) passes through, so that the C ABIs can
// still report it as out of memory; and release_stream's failed wait is a BackendError
// (documented there). Note [One error type] in store_errors.cpp.
//
// Note [Loads over write-backs]
// An eviction's buffer stays charged to the budget until its write-back (D2H) is done: a
// PendingFree. A load that finds no room within the budget, but would have it once those
// write-backs finish, does not wait on the host. It takes (1) a pending free of exactly
// its size, or else (2), with a stream-ordered memory source (the caching allocator:
// DeviceMemorySource::stream_ordered), the oldest pending frees whose bytes leave room:
// the H2D stream is made to wait for their write-back events, they are handed back to
// the source on the H2D stream (uncharged), and the load's buffer is allocated fresh on
// that stream, where the source may serve it from that very memory (its stream contract
// makes this safe: memory freed on a stream is reused by later work on that stream). So
// loads overlap write-backs of other sizes; the load's copy is always enqueued after the
// write-backs whose memory it may reuse, never before; and the bytes charged (resident
// buffers + pending frees) never exceed the budget, because (1) moves a charged buffer
// from one owner to another and (2) uncharges before it allocates. Only without such
// room (a non-stream-ordered source, e.g. the backend's device_alloc, and no pending
// free of the same size) does an acquire wait on the host for the oldest write-back and
// a prefetch get skipped. Taking over a larger pending free was rejected: the surplus
// would stay charged to a handle that may then be acquired, so an acquire could fail
// although the acquired handles' own sizes fit the budget.
//
// Thread-safety: every method may be called from any thread concurrently.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/export.h"
#include "tiering/copy_engine.h"
#include "tiering/device_budget_ledger.h"
#include "tiering/host_arena.h"
#include "tiering/prefetch_policy.h"

namespace tidepool {

class TIDEPOOL_API TieringError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Tier : std::uint8_t { device, host };

// Where device buffers come from. Default (empty functions): the backend directly. The
// caching allocator plugs in here (allocate(bytes, stream) / deallocate(ptr, bytes,
// stream)); allocate returns nullptr when out of memory. A source sets nothing or both
// allocate and deallocate; the store's constructor refuses one in between with a
// TieringError naming what is missing (Note [A whole memory source] in memory_source.cpp).
// release_stream (optional): the store's copy streams are about to be destroyed; called
// by the destructor for both, after every buffer was freed (the caching allocator's
// release_stream: it must not keep anything under a dead stream's handle).
// stream_ordered: deallocate(p, n, s) may be called while work on other streams that s
// already waits for still uses p, and makes p reusable by work enqueued on s after the
// call (Note [Stream contract] in caching_allocator.h). The store then hands buffers
// whose write-back is in flight back in stream order, so a load can reuse their memory
// before the write-back has finished (Note [Loads over write-backs]). false: deallocate
// only once no stream uses p (the backend's device_free).
// Errors: deallocate may throw, and a throw means the buffer was not given back: it is
// still the store's, charged to the budget, and is handed back again later (as the
// caching allocator's deallocate does: BackendError or AllocatorUsageError with its state
// unchanged, Note [Failed frees] in allocator/frees.cpp; and the backend's device_free:
// BackendError before anything is freed). The store keeps its books under that: buffers
// handed back before the throw leave its lists before the error propagates, so none is
// ever handed back twice.
struct DeviceMemorySource {
  std::function<void*(std::size_t bytes, Stream stream)> allocate;
  // For a prefetch, which must not make others give memory up (it is a hint, and must
  // never cause the out-of-memory it is meant to avoid): memory that is free now, or
  // nullptr. Unset: allocate.
  std::function<void*(std::size_t bytes, Stream stream)> try_allocate;
  std::function<void(void* ptr, std::size_t bytes, Stream stream)> deallocate;
  std::function<void(Stream stream)> release_stream;
  bool stream_ordered = false;
};

class CachingAllocator;
// Device buffers from the caching allocator, tagged `tag` (optimizer_state by default) so
// its per-tag stats show the tiered state; its out-of-memory error becomes nullptr.
TIDEPOOL_API DeviceMemorySource caching_allocator_source(CachingAllocator& allocator,
                                                         int tag = TIDEPOOL_TAG_OPTIMIZER_STATE);

struct TieredStoreOptions {
  // kDeviceBudgetFromConfig: tidepool.state_budget (allocator/tier_routing.h) when the
  // configuration enables tidepool and the budget it gives is not 0 (0 means "keep no
  // state between steps", which the optimizer hooks implement by evicting; a store
  // still needs room within a step), else kDefaultDeviceBudget. The configured budget is
  // the device's: the store shares it with the device's other stores built this way and
  // its VMM ranges (Note [Shared state budget] in device_budget_ledger.h). Any other
  // value wins, and is the store's alone.
  static constexpr std::size_t kDeviceBudgetFromConfig = static_cast<std::size_t>(-1);
  static constexpr std::size_t kDefaultDeviceBudget = std::size_t{1} << 30;
  std::size_t device_budget_bytes = kDeviceBudgetFromConfig;
  // How far ahead of the current acquire the store prefetches, in acquires of the
  // schedule (a handle acquired twice in them counts twice).
  std::size_t prefetch_lookahead = 64;
  HostArenaOptions host;
  CopyEngineOptions copy;
};

struct TieredStoreStats {
  std::size_t device_budget_bytes = 0;
  std::size_t device_bytes = 0;  // held now (resident + waiting to be freed)
  std::size_t device_peak_bytes = 0;
  std::size_t handles = 0;
  std::size_t resident_handles = 0;
  std::size_t acquired_handles = 0;
  std::uint64_t acquires = 0;
  std::uint64_t prefetch_issued = 0;
  // A hit or a miss is counted by the acquire that succeeds; one that fails counts
  // neither, its retry does (once).
  std::uint64_t prefetch_hits = 0;   // acquire found the copy in flight or done
  std::uint64_t prefetch_late = 0;   // ... but the copy had not finished yet
  std::uint64_t misses = 0;          // acquire had to start the copy itself
  std::uint64_t loads_skipped = 0;   // acquire_to_overwrite found it on the host: no copy
  // Host blocks moved from the pageable fallback into pinned memory once it had room,
  // and their bytes (Note [Pageable blocks are promoted] in host_promotion.cpp).
  std::uint64_t host_promotions = 0;
  std::uint64_t host_promoted_bytes = 0;
  std::uint64_t prefetch_skipped = 0;  // back-pressure: no room without harming sooner uses
  // Device copies dropped to make room or on request; a destroy or a write, which throws
  // the device copy's contents away, is not an eviction.
  std::uint64_t evictions = 0;
  std::uint64_t evictions_clean = 0;  // of those, dropped without a copy back
  std::uint64_t reclaim_calls = 0;
  std::uint64_t reclaimed_bytes = 0;
  std::uint64_t reclaim_failures = 0;  // reclaims an eviction or a wait failed in
  std::uint64_t budget_waits = 0;  // acquire had to wait for a buffer to be freed
  std::uint64_t buffers_reused = 0;  // loads that took over a buffer on its way out
  // Buffers on their way out handed back to a stream-ordered source for a load, which
  // waits for their write-back on the H2D stream (Note [Loads over write-backs]).
  std::uint64_t frees_stream_ordered = 0;
  // The prefetch schedule (prefetch_policy.h): acquires that deviated from it, and
  // steps that changed a schedule: a handle merged in, an order adopted (Note [Adopting
  // a step]).
  std::uint64_t off_schedule_acquires = 0;
  std::uint64_t schedule_adoptions = 0;
  // Note [Shared state budget] in device_budget_ledger.h. budget_shared: the budget is
  // the device's tidepool.state_budget, shared with its other stores built from the
  // configuration and its VMM ranges, which hold peer_bytes of it now. peer_room_requests:
  // acquires (and creates on the device) of this store that asked the others for room,
  // each counted once however often it asked; peer_evictions and
  // peer_evicted_bytes: handles this store evicted (and their bytes) to give another
  // store room.
  bool budget_shared = false;
  std::size_t peer_bytes = 0;
  std::uint64_t peer_room_requests = 0;
  std::uint64_t peer_evictions = 0;
  std::uint64_t peer_evicted_bytes = 0;
  HostArenaStats host;
  CopyEngineStats copy;
};

class TIDEPOOL_API TieredStore {
 public:
  using Handle = std::uint64_t;  // 0 is never a valid handle

  TieredStore(Backend& backend, TieredStoreOptions options, DeviceMemorySource device = {});
  // Waits for all transfers, frees every buffer, then releases the copy streams from the
  // memory source (DeviceMemorySource::release_stream) before the copy engine destroys
  // them. Handles still acquired are a caller bug but are freed too. Never throws: when the backend
  // fails (e.g. its CUDA context is already gone at process exit) the error is reported once on
  // stderr, events and streams are released, and buffers a transfer might still use are leaked
  // (teardown.h).
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  // A zero-filled buffer of `bytes`, tagged `tag`, resident in `initial`.
  // Throws TieringError (bytes == 0, larger than the budget, no memory, a failed backend
  // call); nothing is created then.
  Handle create(std::size_t bytes, int tag, Tier initial = Tier::host);
  // Pre: not acquired. Frees both copies once the streams that used them are done.
  // Throws TieringError; the handle then stays, with its latest contents.
  void destroy(Handle h);

  // A hint: start moving `h` to the device now if the budget allows without evicting a
  // handle that is needed sooner. Never blocks. `stream` is the stream that will use it.
  // Throws TieringError when starting the copy fails (`h` stays on the host, intact).
  void prefetch(Handle h, Stream stream);
  // A device pointer to the latest contents of `h`, valid for work enqueued on `stream`
  // after this call until release(). Acquires nest (count). Throws TieringError. With a
  // shared budget, another store may be made to evict released handles for it, with
  // this store's lock let go meanwhile (Note [Shared state budget]).
  void* acquire(Handle h, Stream stream);
  // acquire() for a caller that writes every byte of `h` before anything reads it: a
  // handle on the host gets its device buffer without being loaded (Note [Acquiring to
  // overwrite] in tiered_store.cpp). The device copy is the latest from this call on,
  // whatever is written: release it dirty or not, it is written back when evicted.
  void* acquire_to_overwrite(Handle h, Stream stream);
  // Ends one acquire. dirty: the device copy was written, the host copy is now stale.
  // Throws TieringError (an unknown handle, one not acquired); makes no backend call.
  void release(Handle h, bool dirty);
  // Drops the device copy, copying it back first only if it is dirty. Pre: not acquired.
  // Throws TieringError; a failed copy-back keeps the device copy.
  void evict(Handle h);

  // evict / prefetch of every handle tagged `tag` (prefetch_tag loads the soonest needed
  // first and stops at the first without room). Throw TieringError naming the handle that
  // failed; those before it were moved.
  void evict_tag(int tag);
  void prefetch_tag(int tag, Stream stream);
  // Evicts released handles (furthest next use first) until `bytes_needed` device bytes
  // are freed, and waits for them to be freed. Returns the bytes freed. Safe to call from
  // an allocator's OOM path: a busy store is waited for until `wait_until` at most (the
  // default: not at all), then gives 0 instead of blocking, and it never throws.
  // Note [Reclaim never throws]: it runs inside another allocation's OOM path, walked
  // over every store of the device; a throw would end that walk before the other stores
  // were asked and lose the count of what this one freed. A failure of any type
  // (the wrapping into TieringError is the public entries', Note [One error type]) stops
  // it: it returns what it freed until then, the handle that failed keeps its device
  // copy, and the failure is counted (reclaim_failures) and said once on stderr.
  std::size_t reclaim(std::size_t bytes_needed,
                      std::chrono::steady_clock::time_point wait_until = {}) noexcept;
  // The host arena's empty pinned slabs are unregistered (Note [Empty slabs are unpinned]
  // in host_arena.h); returns their bytes. Never throws. The empty-cache hook calls it.
  std::size_t release_empty_host_slabs() noexcept { return host_.release_empty_slabs(); }

  // Step boundaries for the recorded prefetch schedule (see prefetch_policy.h): each
  // `schedule` key (one per optimizer sharing the store) records and replays its own,
  // and follows its steps when they change for good (Note [Adopting a step]).
  void begin_step(std::uint64_t schedule = 0);
  void end_step();
  // The optimizer behind `schedule` is gone: its recorded schedule is dropped
  // (PrefetchPolicy::retire), so a store outliving many optimizers (a sweep in one
  // process) keeps no schedules of dead ones and does not predict their steps.
  void retire_schedule(std::uint64_t schedule);
  // How many schedule keys the store keeps (its own key 0 included).
  std::size_t schedule_count() const;

  // Copies the latest contents of `h` to host memory `dst` (waits). Pre: not acquired.
  // Throws TieringError.
  void read(Handle h, void* dst);
  // Replaces the contents of `h` with `src` (the device copy, if any, is dropped).
  // Throws TieringError; the old contents then stay (Note [Drop the device copy last]).
  void write(Handle h, const void* src);

  std::size_t size(Handle h) const;
  int tag(Handle h) const;
  bool resident(Handle h) const;
  HostTier host_tier(Handle h) const;
  std::size_t device_bytes() const;
  std::size_t device_budget_bytes() const { return options_.device_budget_bytes; }
  // Blocks until all transfers and pending frees are done. Throws TieringError.
  void synchronize();
  // Note [Use streams]: a stream that used a handle (acquire) stays one of its users until
  // the handle is next evicted or acquired with no other holder: evict, read and acquire
  // on another stream wait for it. Before destroying such a stream, call release_stream:
  // it waits for the stream's work and forgets it on every handle, and returns true. An
  // operation that has to wait for a stream destroyed without it throws TieringError
  // saying so. A wait that fails (a stream the backend does not know) throws BackendError
  // with nothing changed. A stream no handle names as a user is not waited for: it
  // returns false at once with no backend call, since tidepool_release_stream reaches the
  // stores on every stream a program destroys and most never used one (as the allocator
  // does: Note [Releasing a stream tidepool never saw], allocator/stream_ordering.cpp).
  bool release_stream(Stream stream);
  // release_stream for a caller that has already waited for the stream's work (the
  // allocator's tidepool_release_stream): forgets it without a backend call.
  void forget_stream(Stream stream);

  TieredStoreStats stats();
  std::string stats_json();

  Backend& backend() const { return backend_; }

 private:
  struct Entry;
  // `source` as given when allocate and deallocate are both set, the backend's device
  // memory when nothing is set; anything in between throws TieringError naming what is
  // missing (Note [A whole memory source] in memory_source.cpp).
  static DeviceMemorySource whole_memory_source(Backend& backend, DeviceMemorySource source);
  // A device buffer freed once the D2H stream passes `after` (still charged to the budget
  // until then).
  struct PendingFree {
    void* ptr;
    std::size_t bytes;
    Event after;
    // `after` was recorded on the D2H stream when the free was queued, so the pending
    // frees so marked complete in list order (Note [Reaping in stream order] in
    // pending_frees.cpp).
    bool in_d2h_order = true;
  };
  // A device buffer for a load: fresh, or a pending free of the same size taken over in
  // stream order (`wait`: the H2D stream must wait on it, then it goes back to the pool).
  struct DeviceBuffer {
    void* ptr = nullptr;
    Event wait;
  };
  // What a load may do for room: a prefetch neither waits nor asks; an acquire waits for
  // its own write-backs, and with a shared budget (Note [Shared state budget]) may come
  // back without room once, to ask the other stores with its lock let go.
  enum class RoomFor : std::uint8_t { prefetch, acquire, acquire_may_ask_peers };
  // How a load gets its room (Note [Loads over write-backs]).
  struct Room {
    enum class Kind : std::uint8_t {
      fresh,            // within the budget now: allocate
      take_over,        // pending_frees_[n] becomes the load's buffer
      release_pending,  // the first n pending frees go back to the source in stream
                        // order, then allocate
      none,             // no room (for a prefetch: not without waiting)
    };
    Kind kind = Kind::none;
    std::size_t n = 0;
  };

  // `waiter` waits for the work queued on `used` so far (an event recorded there and given
  // back at once, also when the wait fails).
  void order_after_use_locked(Stream waiter, Stream used);
  Entry& entry_locked(Handle h, const char* op);
  // create() and read() past their argument checks; the public ones turn what these
  // throw into TieringError (Note [One error type] in store_errors.cpp).
  Handle create_checked(std::size_t bytes, int tag, Tier initial);
  void read_locked(Entry& e, void* dst);
  // False: no room (a prefetch: skipped; RoomFor::acquire_may_ask_peers: ask the peers).
  // load: copy the host contents in (false: Note [Acquiring to overwrite]).
  bool load_locked(Entry& e, RoomFor why, bool load = true);
  // Note [Pageable blocks are promoted] (host_promotion.cpp). Pre: e is on the host, about
  // to be loaded. Never throws.
  void promote_host_block_locked(Entry& e) noexcept;
  // acquire() (acquire_to_overwrite() when !load) under the lock; nullptr: no room but
  // the other stores may give it (RoomFor::acquire_may_ask_peers), to be asked with the
  // lock let go.
  void* acquire_locked(Handle h, Stream stream, RoomFor why, bool load = true);
  void* acquire_with_room(Handle h, Stream stream, bool load);
  // discard: the contents are dropped (destroy, write), no copy back. The dirty flag is
  // cleared only once the eviction is enqueued, so a failed one keeps the latest copy.
  void evict_locked(Entry& e, bool discard = false);
  // fresh: `bytes` are reserved (reserved_); release_pending: the pending frees' charge
  // plus the reservation cover `bytes` (store_budget.cpp).
  // `others_first`: keep the handles this step uses again while the other stores sharing
  // the budget may give room (Note [Shared state budget], step 1).
  Room make_room_locked(std::size_t bytes, const Entry* incoming, bool may_wait,
                        bool others_first = false);
  // make_room_locked's search, skipping victims that cannot be evicted (Note [A victim
  // that cannot be evicted]); none when there is no room without them.
  Room find_room_locked(std::size_t bytes, const Entry* incoming, bool may_wait,
                        bool others_first);
  // Room from the pending frees alone, without waiting; none if they cannot give it.
  Room room_from_pending_locked(std::size_t bytes) const;
  // Hands the first `count` pending frees back in stream order; their charge becomes the
  // reservation of the load they make room for (Note [Shared state budget]).
  void release_pending_locked(std::size_t count);
  // A failed load's buffer goes back: to the pending frees when it was taken over from a
  // write-back it may not be ordered after, else to the memory source. Never throws, so
  // the load's own error is what propagates; a buffer it cannot hand back stays among the
  // pending frees (Note [A failed load's buffer] in pending_frees.cpp).
  void give_back_failed_load_locked(const DeviceBuffer& buf, std::size_t bytes) noexcept;
  // Note [A failed acquire to overwrite] (tiered_store.cpp).
  void drop_skipped_load_locked(Entry& e) noexcept;
  // Hands back the pending frees whose write-backs are done (all of them with wait_all,
  // waiting; with streams_idle, the caller has just synchronized both copy streams, so
  // every one is done and none is asked).
  void reap_frees_locked(bool wait_all, bool streams_idle = false);
  // reclaim() past its lock: evicts until `bytes_needed` are scheduled (counted in
  // `scheduled` as it goes), then waits for the frees; throws what fails (reclaim catches
  // it, Note [Reclaim never throws]).
  void reclaim_locked(std::size_t bytes_needed, std::size_t& scheduled);
  // ---- which handle an eviction takes (eviction_order.cpp) ----
  // Note [Resident handles]: the resident, unacquired handle whose next use is furthest
  // (PrefetchPolicy::eviction_score), among those scoring above `above` when given;
  // nullptr when there is none. (A handle being loaded is not resident: never a victim of
  // its own load.)
  Entry* eviction_victim_locked(std::optional<std::size_t> above);
  // Note [A victim that cannot be evicted] (eviction_order.cpp): evicts `victim`; when
  // that fails, keeps the failure, takes `victim` out of the victims until the operation
  // ends (SkippedVictims) and returns false.
  bool evict_or_skip_locked(Entry& victim);
  // For the length of one operation that evicts to make room: the victims it skipped go
  // back among the victims when it ends; rethrow_failure throws the first of their
  // failures, if any, for an operation that found no room without them.
  class SkippedVictims {
   public:
    explicit SkippedVictims(TieredStore& store) noexcept : store_(store) {}
    ~SkippedVictims();
    SkippedVictims(const SkippedVictims&) = delete;
    SkippedVictims& operator=(const SkippedVictims&) = delete;
    void rethrow_failure() const;

   private:
    TieredStore& store_;
  };
  // `e`'s device copy was just set / is being dropped: it joins / leaves resident_ (and
  // evictable_).
  void note_resident_locked(Entry& e) noexcept;
  void note_not_resident_locked(Entry& e) noexcept;
  // Note [Eviction order]: `e` became evictable or stopped being so (loaded, evicted,
  // acquired, released): it joins or leaves evictable_.
  void evictable_update_locked(Entry& e) noexcept;
  void evictable_build_locked();
  void evictable_drop_locked() noexcept;
  void evictable_place_locked(std::size_t slot, Entry* e) noexcept;
  void evictable_sift_locked(std::size_t slot) noexcept;
  // Whether `a` goes before `b` in evictable_: the higher key, then the higher id.
  static bool evicted_sooner(const Entry* a, const Entry* b) noexcept;
  void warn_reclaim_failure(const char* why, const char* what) noexcept;
  DeviceBuffer device_allocate_locked(std::size_t bytes, const Entry* incoming, RoomFor why);
  // Allocates the buffer `reserved_` holds room for (make_room_locked); gives the
  // reservation back when that fails.
  DeviceBuffer allocate_reserved_locked(std::size_t bytes, bool may_wait);
  [[noreturn]] void throw_no_room_locked(std::size_t bytes);
  // Bytes of this store's acquired handles: they stay on the device whatever is evicted.
  std::size_t acquired_bytes_locked() const noexcept;
  // Whether `bytes` more cannot fit beside the acquired handles: then no eviction,
  // write-back or other store can make room for them.
  bool never_fits_beside_acquired_locked(std::size_t bytes) const noexcept;

  // ---- the budget's books (store_budget.cpp; Note [Shared state budget]) ----
  // The store's charge is device_bytes_ + reserved_: in its own budget, or in the
  // device's ledger when shared_ is set.
  // Room within the budget for `bytes` more: reserved, true; else nothing changes.
  bool reserve_locked(std::size_t bytes);
  void unreserve_locked(std::size_t bytes) noexcept;
  // A reserved buffer was allocated: its bytes move from reserved_ to device_bytes_.
  void commit_reserved_locked(std::size_t bytes);
  // A buffer of `bytes` went back to the memory source: no longer charged.
  void uncharge_locked(std::size_t bytes) noexcept;
  // Bytes the other participants of a shared budget hold (0 for a budget of its own).
  std::size_t peer_bytes_locked() const noexcept;
  // The budget's bytes held (the other participants', this store's charge) once this
  // store's own buffers on their way out are freed.
  std::size_t held_once_written_back_locked() const noexcept;
  // The bytes the other participants would have to give back for `bytes` to fit, once
  // this store's own buffers on their way out are freed.
  std::size_t peer_shortfall_locked(std::size_t bytes) const;
  // The seat's GiveBack (Note [Shared state budget]): evicts released handles and waits
  // for their write-backs until `bytes_needed` are given back. Never throws.
  std::size_t give_back_for_peer(std::size_t bytes_needed) noexcept;
  // reclaim() and give_back_for_peer() past their locks: reclaim_locked, its failure
  // counted and said once (Note [Reclaim never throws]; `why` names the caller). Returns
  // the bytes freed; adds the bytes of the handles evicted to `evicted`.
  std::size_t evict_released_locked(std::size_t bytes_needed, std::size_t& evicted,
                                    const char* why) noexcept;
  // With a budget shared with other stores (Note [Shared state budget]): calls
  // `attempt(RoomFor::acquire_may_ask_peers)` under `lock` and, while it returns nullptr
  // (no room for `bytes` from this store's own handles), asks the other stores for room
  // with `lock` let go and tries again; once asking has stopped giving room, the last
  // attempt gets RoomFor::acquire, which throws the no-room error. Returns what the
  // attempt that succeeded returned. Used by acquire() and create() on the device.
  void* with_room_from_peers(std::unique_lock<std::mutex>& lock, std::size_t bytes,
                             const std::function<void*(RoomFor)>& attempt);
  void prefetch_ahead_locked();
  Event take_event_locked();
  // Back to the pool; destroyed instead when the pool cannot grow (never throws).
  void give_event_locked(Event e) noexcept;
  // An event of the pool recorded now on `s`; given back to the pool if the record fails.
  Event take_recorded_event_locked(Stream s);
  // The same on a stream that used a handle (Note [Use streams]), a failed record said as
  // such (TieringError).
  Event record_use_event_locked(Stream s);
  // Note [Use streams]: drops `stream` from every handle's users (release_stream,
  // forget_stream).
  void forget_stream_locked(Stream stream);
  void note_device_bytes_locked();

  Backend& backend_;
  TieredStoreOptions options_;
  DeviceMemorySource device_;
  HostArena host_;
  CopyEngine copies_;
  PrefetchPolicy policy_;
  // Note [Prefetch frontier] in prefetch_policy.h: where the last prefetch walk got to,
  // and device_copies_dropped_ when it started (one since: a walk from the front). Under
  // mutex_.
  PrefetchPolicy::LookAheadMark prefetch_mark_;
  std::uint64_t drops_at_mark_ = 0;
  // Every device copy evict_locked dropped: evictions, and the discards of destroy and
  // write (which stats_.evictions does not count). Under mutex_.
  std::uint64_t device_copies_dropped_ = 0;
  // Note [Pageable blocks are promoted]: the arena's pinned_room_epoch when a promotion
  // was last refused for another reason than the budget (none yet: nullopt). Under mutex_.
  std::optional<std::uint64_t> promotion_refused_at_;

  mutable std::mutex mutex_;
  std::unordered_map<Handle, std::unique_ptr<Entry>> entries_;
  // Note [Resident handles]: the entries whose device copy is set, in no order. Its
  // capacity never falls below entries_.size() (create reserves it), so adding to it
  // cannot fail.
  std::vector<Entry*> resident_;
  // Note [Eviction order]: the resident, unacquired entries, a max-heap by eviction key,
  // while evictable_valid_; built for the policy's key epoch evictable_epoch_. Its
  // capacity follows resident_'s.
  std::vector<Entry*> evictable_;
  bool evictable_valid_ = false;
  std::uint64_t evictable_epoch_ = 0;
  std::vector<PendingFree> pending_frees_;
  std::vector<Event> free_events_;
  Handle next_handle_ = 1;
  std::size_t device_bytes_ = 0;
  std::size_t reserved_ = 0;  // charged for the buffer being allocated (make_room_locked)
  // Note [A victim that cannot be evicted]: the operation's skipped victims, and the
  // first of their failures.
  std::vector<Entry*> skipped_victims_;
  std::exception_ptr victim_failure_;
  TieredStoreStats stats_;
  bool reclaim_failure_warned_ = false;  // warn_once_due, under mutex_
  // The store's seat in the device's ledger when its budget is the configured one (Note
  // [Shared state budget]), else null. Last: built once the store can be asked for room,
  // and destroyed first, giving back what is still charged.
  std::unique_ptr<DeviceBudgetLedger::Seat> shared_;
};

}  // namespace tidepool
