// The copy engine: one H2D and one D2H stream of its own, chunked copies, and telemetry.
//
// Prefetches go on the H2D stream and evictions on the D2H stream, so the two directions
// overlap (93 GB/s both ways on the H200 against 55 GB/s one way). Copies larger than
// chunk_bytes are split into chunks of that size. The default, 64 MiB, leaves optimizer
// state tensors whole, as the plain copy_async baseline copies them: every chunk is one
// more copy for the copy engine to start and for the host to enqueue, and work on the same
// stream runs in order whatever the chunk size, so smaller chunks let nothing overtake.
// (It was 8 MiB; store/bidir reached 0.88 of the baseline on the H200 with it.)
//
// Ordering is by events only: a transfer first makes its stream wait on the events it
// depends on (e.g. the last use of a buffer on a compute stream), then records its own
// completion event, which consumers wait on.
//
// Telemetry: bytes and copies per direction, busy time per direction measured with
// backend timing events (per batch of transfers, collected lazily once they complete), and the
// exposed time: host wall time a caller spent blocked on a transfer (wait_exposed).
//
// Note [Exposed and hidden copy time]
// "Exposed" is host-side waiting only: the time a host thread sat in wait_exposed (the
// tiered store waiting for a write-back: an acquire under budget pressure, a reclaim).
// Hidden time = busy time - exposed time, an upper bound on the copy time that overlapped
// other work, not a measurement of it. A copy that a GPU stream waited for is counted as
// hidden: an acquire that misses (or finds its prefetch still in flight) makes the
// caller's stream wait for the load on the device (stream_wait_event) and returns at
// once, so the compute stream may stall behind the copy while the host never blocks; no
// device-side stall is measured or separated. Read a small exposed time as "the host
// rarely waited", and the prefetch counters (misses, prefetch_late) for how often the
// device may have.
//
// Note [Rates from timed bytes]
// A transfer's bytes are counted (DirectionStats::bytes) when it is enqueued, but its time
// only when its timing batch completes and is collected, which may be much later. The
// rate is therefore computed from timed_bytes, the bytes of the batches whose time is in
// busy_ms, never from bytes: bytes still in flight would inflate it. Each direction keeps
// its own pending batches, collected in their stream's order, so a batch of one
// direction held back (an H2D load waiting on an event) does not hold back the
// collection of the other's.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <vector>

#include "allocator/backend.h"
#include "allocator/export.h"

namespace tidepool {

enum class Direction : std::uint8_t { host_to_device, device_to_host };

struct CopyEngineOptions {
  std::size_t chunk_bytes = std::size_t{64} << 20;
  // Record timing events around transfers. Transfers are timed in batches of at least
  // timing_batch_bytes (one event pair per batch): timing each 64 KiB copy would cost more
  // host time than the copy takes on the link. A batch's time includes any idle gap
  // between its transfers, so busy time errs high and GB/s low, never the other way.
  bool time_transfers = true;
  std::size_t timing_batch_bytes = std::size_t{1} << 20;
};

struct DirectionStats {
  std::uint64_t bytes = 0;  // enqueued (the bytes moved, once the streams are idle)
  std::uint64_t transfers = 0;
  std::uint64_t chunks = 0;
  // Note [Rates from timed bytes]: the bytes whose device time busy_ms holds.
  std::uint64_t timed_bytes = 0;
  double busy_ms = 0;  // sum of completed transfers' device time
  double gb_per_s() const { return busy_ms > 0 ? double(timed_bytes) / (busy_ms * 1e6) : 0.0; }
};

struct CopyEngineStats {
  DirectionStats h2d;
  DirectionStats d2h;
  // Host time callers spent blocked on transfers; a GPU stream's wait for a copy is not
  // in it (Note [Exposed and hidden copy time]).
  double exposed_wait_ms = 0;
  std::uint64_t exposed_waits = 0;
  // Busy time not exposed on the host: it includes copies a GPU stream waited for.
  double hidden_ms() const {
    const double busy = h2d.busy_ms + d2h.busy_ms;
    return busy > exposed_wait_ms ? busy - exposed_wait_ms : 0.0;
  }
};

class TIDEPOOL_API CopyEngine {
 public:
  explicit CopyEngine(Backend& backend, CopyEngineOptions options = {});
  // Drains both streams, then destroys them and the timing events. Never throws: a
  // backend failure is reported on stderr and the rest is still released (teardown.h).
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Enqueues a copy of `bytes` from `src` to `dst` on the stream of `direction`, after
  // every event in `wait_for` (null events are skipped), and records `done` after it.
  // Pre: both ranges valid until `done` completes. Throws BackendError if the backend
  // refuses to enqueue; then `done` is not recorded and no chunk after the failure runs.
  void transfer(void* dst, const void* src, std::size_t bytes, Direction direction, Event done,
                std::span<const Event> wait_for = {});

  Stream stream(Direction direction) const {
    return direction == Direction::host_to_device ? h2d_ : d2h_;
  }
  Backend& backend() const { return backend_; }

  // Blocks until `e` completes; the time spent blocked counts as exposed copy time.
  void wait_exposed(Event e);
  // Blocks until both streams are idle.
  void synchronize();

  // Collects finished timing events, then returns a snapshot.
  CopyEngineStats stats();

 private:
  struct Timing {
    Event start, end;
    std::size_t bytes;  // of the transfers the batch holds (Note [Rates from timed bytes])
  };
  struct OpenBatch {
    Event start;
    std::size_t bytes = 0;
    bool open = false;
  };
  void collect_timings_locked(bool wait);
  void collect_timings_locked(Direction direction, bool wait);
  void close_batch_locked(Direction direction);
  Event take_event_locked();
  Event take_recorded_event_locked(Stream s);

  Backend& backend_;
  CopyEngineOptions options_;
  Stream h2d_, d2h_;
  std::mutex mutex_;
  std::deque<Timing> pending_timings_[2];  // by Direction, each in its stream's order
  OpenBatch batches_[2];  // by Direction
  std::vector<Event> free_events_;
  CopyEngineStats stats_;
};

}  // namespace tidepool
