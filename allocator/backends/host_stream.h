// The host backend's stream executor (private to allocator/backends/).
//
// A HostStream is a FIFO of closures run in enqueue order by one worker thread of its
// own, so work enqueued on it really is asynchronous to the caller, as on a GPU. Events
// are built from StreamMarkers: a marker is a closure that, when the stream reaches it,
// stamps the time and wakes everyone waiting for it. Cross-stream ordering
// (stream_wait_event) is a closure on the consumer stream that blocks its worker until
// the producer's marker has passed; this cannot deadlock because a wait always refers to
// a marker that was enqueued before the wait itself.
//
// All state is guarded by a mutex and condition variables (no lock-free tricks), so the
// backend is clean under ThreadSanitizer and every happens-before edge is visible to it:
// work done on a worker thread happens-before whatever returns from a wait on it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace tidepool::host_detail {

// One completion point on one stream: set exactly once, when the stream passes it.
class StreamMarker {
 public:
  using Clock = std::chrono::steady_clock;

  // Called by the stream's worker: stamps the time, marks done, wakes waiters.
  void complete();
  bool done() const;
  // Blocks until done().
  void wait() const;
  // Pre: done(). The steady_clock time at which the stream passed the marker.
  Clock::time_point completed_at() const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable done_cv_;
  bool done_ = false;
  Clock::time_point completed_at_{};
};

class HostStream {
 public:
  explicit HostStream(std::string name);
  // Drains every closure already enqueued, then stops and joins the worker.
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  const std::string& name() const { return name_; }

  // Appends `work` to the FIFO. An exception thrown by `work` is caught on the worker
  // and rethrown (as BackendError) by the next synchronize().
  void enqueue(std::function<void()> work);
  // Appends a marker and returns it; it completes once everything before it has run.
  std::shared_ptr<StreamMarker> enqueue_marker();
  // Appends a wait: closures enqueued after it start only once `marker` is done.
  void enqueue_wait(std::shared_ptr<StreamMarker> marker);

  // Blocks until everything enqueued before the call has finished. Throws BackendError
  // when called from this stream's own worker (it would wait for itself forever) or when
  // an enqueued closure threw since the last synchronize.
  void synchronize();

 private:
  void run_worker();

  const std::string name_;
  std::mutex mutex_;
  std::condition_variable work_cv_;  // the worker waits here for work or stop
  std::condition_variable idle_cv_;  // synchronize() waits here for progress
  std::deque<std::function<void()>> queue_;
  std::uint64_t enqueued_ = 0;   // closures ever enqueued
  std::uint64_t completed_ = 0;  // closures ever finished (in FIFO order)
  bool stopping_ = false;
  std::string first_error_;  // what the first failed closure threw, until reported
  std::thread worker_;       // declared last: it starts once everything above exists
};

}  // namespace tidepool::host_detail
