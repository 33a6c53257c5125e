// CopyEngine: chunked transfers on dedicated H2D / D2H streams with lazy timing.
// See copy_engine.h for the contract.
#include "tiering/copy_engine.h"

#include <algorithm>

#include "tiering/teardown.h"

namespace tidepool {

namespace {
CopyKind copy_kind(Direction d) {
  return d == Direction::host_to_device ? CopyKind::host_to_device : CopyKind::device_to_host;
}
// A transfer's timing events are kept until they complete; past this many pending ones
// the oldest are waited for, so the list cannot grow without bound.
constexpr std::size_t kMaxPendingTimings = 4096;
}  // namespace

CopyEngine::CopyEngine(Backend& backend, CopyEngineOptions options)
    : backend_(backend), options_(options) {
  if (options_.chunk_bytes == 0) throw BackendError("copy engine: chunk_bytes must be > 0");
  h2d_ = backend_.create_stream();
  try {
    d2h_ = backend_.create_stream();
  } catch (...) {
    backend_.destroy_stream(h2d_);
    throw;
  }
}

// Each step runs even when an earlier one failed (teardown.h): a backend that is gone
// (a CUDA context destroyed at exit) costs a line on stderr, never an abort.
CopyEngine::~CopyEngine() {
  Teardown teardown("copy engine");
  std::lock_guard lock(mutex_);
  teardown.attempt("closing the timing batches", [&] {
    close_batch_locked(Direction::host_to_device);
    close_batch_locked(Direction::device_to_host);
  });
  const bool h2d_idle = teardown.attempt("draining the H2D stream",
                                         [&] { backend_.stream_synchronize(h2d_); });
  const bool d2h_idle = teardown.attempt("draining the D2H stream",
                                         [&] { backend_.stream_synchronize(d2h_); });
  // Collecting waits on events: only worth it (and only safe) on streams that drained.
  if (h2d_idle && d2h_idle) {
    teardown.attempt("collecting timings", [&] { collect_timings_locked(/*wait=*/true); });
  }
  // Each event destroyed where it is met: gathered into free_events_ first, a push_back
  // that ran out of heap would leave this noexcept destructor (std::terminate).
  const auto destroy_event = [&](Event e) {
    teardown.attempt("destroying an event", [&] { backend_.destroy_event(e); });
  };
  for (const std::deque<Timing>& pending : pending_timings_) {
    for (const Timing& t : pending) {
      destroy_event(t.start);
      destroy_event(t.end);
    }
  }
  for (const OpenBatch& b : batches_) {
    if (b.open) destroy_event(b.start);
  }
  for (Event e : free_events_) destroy_event(e);
  teardown.attempt("destroying the H2D stream", [&] { backend_.destroy_stream(h2d_); });
  teardown.attempt("destroying the D2H stream", [&] { backend_.destroy_stream(d2h_); });
}

Event CopyEngine::take_event_locked() {
  if (free_events_.empty()) return backend_.create_event();
  Event e = free_events_.back();
  free_events_.pop_back();
  return e;
}

// An event of the pool recorded now on `s`; back in the pool if the record fails (else it
// is never destroyed).
Event CopyEngine::take_recorded_event_locked(Stream s) {
  const Event ev = take_event_locked();
  try {
    backend_.record_event(ev, s);
  } catch (...) {
    free_events_.push_back(ev);
    throw;
  }
  return ev;
}

// Ends the open timing batch of `direction`: its end event goes after everything enqueued
// so far, and the pair waits in pending_timings_ until it completes. When that fails, the
// end event goes back to the pool and the batch stays open, to be closed by a later call.
void CopyEngine::close_batch_locked(Direction direction) {
  OpenBatch& batch = batches_[static_cast<int>(direction)];
  if (!batch.open) return;
  std::deque<Timing>& pending = pending_timings_[static_cast<int>(direction)];
  const Event end = take_recorded_event_locked(stream(direction));
  try {
    pending.push_back(Timing{batch.start, end, batch.bytes});
  } catch (...) {
    free_events_.push_back(end);
    throw;
  }
  batch.open = false;
  if (pending.size() > kMaxPendingTimings) collect_timings_locked(direction, /*wait=*/true);
}

// Note [A transfer's bytes and time in one batch]
// With timing on, the lock is held from the batch's opening (or the transfer's joining an
// open one) to its bytes being added: a stats() call on another thread in between closed
// the batch with the time of this transfer's copies but not its bytes (the rate read
// low, and the bytes, added to the closed batch, were never timed), or closed it and a
// later transfer opened the next one, which then got these bytes without their time (the
// rate read high). copy_async only enqueues, so the hold is short; without timing the
// lock is taken for the counters alone.
void CopyEngine::transfer(void* dst, const void* src, std::size_t bytes, Direction direction,
                          Event done, std::span<const Event> wait_for) {
  const Stream s = stream(direction);
  std::unique_lock lock(mutex_, std::defer_lock);
  if (options_.time_transfers) lock.lock();
  for (Event e : wait_for) {
    if (e) backend_.stream_wait_event(s, e);
  }
  OpenBatch& batch = batches_[static_cast<int>(direction)];
  if (options_.time_transfers && !batch.open) {
    batch.start = take_recorded_event_locked(s);
    batch.open = true;
    batch.bytes = 0;
  }
  std::size_t chunks = 0;
  try {
    for (std::size_t off = 0; off < bytes; off += options_.chunk_bytes) {
      const std::size_t n = std::min(options_.chunk_bytes, bytes - off);
      backend_.copy_async(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, n,
                          copy_kind(direction), s);
      chunks++;
    }
  } catch (...) {
    if (options_.time_transfers) close_batch_locked(direction);
    throw;
  }
  if (done) backend_.record_event(done, s);
  if (!lock.owns_lock()) lock.lock();
  DirectionStats& d = direction == Direction::host_to_device ? stats_.h2d : stats_.d2h;
  d.bytes += bytes;
  d.transfers++;
  d.chunks += chunks;
  if (options_.time_transfers) {
    batch.bytes += bytes;
    // The copy is enqueued and `done` recorded: the transfer has happened, and must not be
    // reported failed because its timing could not be closed now (a caller would drop a
    // device copy that is there). A batch that does not close stays open, with these
    // bytes, and the next transfer or stats() closes it.
    if (batch.bytes >= options_.timing_batch_bytes) {
      try {
        close_batch_locked(direction);
      } catch (...) {
      }
    }
  }
}

void CopyEngine::collect_timings_locked(bool wait) {
  collect_timings_locked(Direction::host_to_device, wait);
  collect_timings_locked(Direction::device_to_host, wait);
}

// Note [Rates from timed bytes] in copy_engine.h: a batch's bytes enter the rate with its
// time, and each direction is collected on its own.
void CopyEngine::collect_timings_locked(Direction direction, bool wait) {
  std::deque<Timing>& pending = pending_timings_[static_cast<int>(direction)];
  DirectionStats& d = direction == Direction::host_to_device ? stats_.h2d : stats_.d2h;
  while (!pending.empty()) {
    Timing& t = pending.front();
    if (wait) {
      backend_.event_synchronize(t.end);
    } else if (!backend_.event_query(t.end)) {
      break;  // the stream runs in order: its later timings are not done either
    }
    const float ms = backend_.event_elapsed_ms(t.start, t.end);
    // Room for both events first: a push_back that threw after the stats had counted the
    // batch (or between the two pushes) counted it twice, or left its start event both
    // spare and pending, to be handed to two batches and destroyed twice.
    free_events_.reserve(free_events_.size() + 2);
    d.busy_ms += std::max(0.0f, ms);
    d.timed_bytes += t.bytes;
    free_events_.push_back(t.start);
    free_events_.push_back(t.end);
    pending.pop_front();
    wait = false;  // only the oldest is waited for; the rest as far as they are done
  }
}

void CopyEngine::wait_exposed(Event e) {
  if (!e || backend_.event_query(e)) return;
  const auto t0 = std::chrono::steady_clock::now();
  backend_.event_synchronize(e);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard lock(mutex_);
  stats_.exposed_wait_ms += ms;
  stats_.exposed_waits++;
}

void CopyEngine::synchronize() {
  backend_.stream_synchronize(h2d_);
  backend_.stream_synchronize(d2h_);
}

CopyEngineStats CopyEngine::stats() {
  std::lock_guard lock(mutex_);
  close_batch_locked(Direction::host_to_device);
  close_batch_locked(Direction::device_to_host);
  collect_timings_locked(/*wait=*/false);
  return stats_;
}

}  // namespace tidepool
