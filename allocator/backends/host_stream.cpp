// The host backend's stream executor: one worker thread per stream running a FIFO of
// closures in order; markers for events. See host_stream.h for the design.
#include "allocator/backends/host_stream.h"

#include <exception>
#include <utility>

#include "allocator/backend.h"

namespace tidepool::host_detail {

// --- StreamMarker ---------------------------------------------------------------------

void StreamMarker::complete() {
  {
    std::lock_guard lock(mutex_);
    completed_at_ = Clock::now();
    done_ = true;
  }
  done_cv_.notify_all();
}

bool StreamMarker::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

void StreamMarker::wait() const {
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [this] { return done_; });
}

StreamMarker::Clock::time_point StreamMarker::completed_at() const {
  std::lock_guard lock(mutex_);
  return completed_at_;
}

// --- HostStream -----------------------------------------------------------------------

HostStream::HostStream(std::string name)
    : name_(std::move(name)), worker_([this] { run_worker(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  // The worker leaves only once the queue is empty, so this also drains the stream.
  worker_.join();
}

void HostStream::enqueue(std::function<void()> work) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(work));
    ++enqueued_;
  }
  work_cv_.notify_one();
}

std::shared_ptr<StreamMarker> HostStream::enqueue_marker() {
  auto marker = std::make_shared<StreamMarker>();
  {
    std::lock_guard lock(mutex_);
    if (completed_ != enqueued_) {
      queue_.push_back([marker] { marker->complete(); });
      ++enqueued_;
    } else {
      // An idle stream has already passed every earlier point: complete the marker now
      // instead of waking the worker for it (the allocator records events on every
      // cross-stream free, mostly on idle streams).
      marker->complete();
      return marker;
    }
  }
  work_cv_.notify_one();
  return marker;
}

void HostStream::enqueue_wait(std::shared_ptr<StreamMarker> marker) {
  enqueue([marker = std::move(marker)] { marker->wait(); });
}

void HostStream::synchronize() {
  if (std::this_thread::get_id() == worker_.get_id())
    throw BackendError("tidepool host backend: synchronize on stream '" + name_ +
                       "' called from a host function running on that same stream "
                       "(it would wait for itself forever)");
  std::unique_lock lock(mutex_);
  const std::uint64_t target = enqueued_;
  idle_cv_.wait(lock, [&] { return completed_ >= target; });
  if (!first_error_.empty()) {
    std::string error = std::move(first_error_);
    first_error_.clear();
    throw BackendError("tidepool host backend: work on stream '" + name_ + "' failed: " + error);
  }
}

void HostStream::run_worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping and drained
    std::function<void()> work = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::string error;
    try {
      work();
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "unknown exception";
    }
    // Destroy the closure (and what it captured) before reporting progress, so nothing
    // it owned outlives the point where a synchronize() returns.
    work = nullptr;
    lock.lock();
    if (!error.empty() && first_error_.empty()) first_error_ = std::move(error);
    ++completed_;
    idle_cv_.notify_all();
  }
}

}  // namespace tidepool::host_detail
