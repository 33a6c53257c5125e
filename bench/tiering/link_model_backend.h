// LinkModelBackend: a backend (the host backend, in practice) whose copies between host
// and device take the time a PCIe link of a given rate would give them, one copy at a
// time per direction, both directions at once, as a GPU's copy engines do. The copy itself
// still runs (fast, host memory to host memory), within its modelled time: the stream is
// held until the copy's turn on its direction's lane has passed its bytes at the rate.
//
// What it is for: the tiered optimizer steps on the CPU, timed over such a link, say
// whether their pipeline keeps the link busy (a step near max(H2D, D2H bytes) / rate) or
// leaves it idle while the host waits, without a GPU. The rate is set far below the
// host's memcpy rate, so that the modelled time dominates and the comparison is the
// pipeline's, not the machine's.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "allocator/forwarding_backend.h"

namespace tidepool::bench_state {

class LinkModelBackend final : public ForwardingBackend {
 public:
  LinkModelBackend(std::unique_ptr<Backend> inner, double bytes_per_second_each_way)
      : ForwardingBackend(std::move(inner)), rate_(bytes_per_second_each_way) {}

  double bytes_per_second_each_way() const { return rate_; }

 private:
  using Clock = std::chrono::steady_clock;
  // One direction of the link: busy until free_at.
  struct Lane {
    std::mutex mutex;
    Clock::time_point free_at{};
  };
  struct Turn {
    Lane* lane;
    Clock::duration length;
    Clock::time_point done;  // set by take_turn
  };

  // On the copy's stream, just before the copy: takes the copy's turn on its direction's
  // lane (from when the lane is free, for the copy's bytes at the rate). The copy itself
  // then runs within that time, and finish_turn holds the stream to the turn's end, so
  // that the real memcpy's time is part of the modelled time, not added to it.
  static void take_turn(void* arg) {
    auto* turn = static_cast<Turn*>(arg);
    std::lock_guard lock(turn->lane->mutex);
    turn->done = std::max(Clock::now(), turn->lane->free_at) + turn->length;
    turn->lane->free_at = turn->done;
  }
  static void finish_turn(void* arg) {
    const std::unique_ptr<Turn> turn(static_cast<Turn*>(arg));
    std::this_thread::sleep_until(turn->done);
  }

  void do_copy_async(void* dst, const void* src, std::size_t b, CopyKind k, Stream s) override {
    if (k != CopyKind::host_to_device && k != CopyKind::device_to_host) {
      ForwardingBackend::do_copy_async(dst, src, b, k, s);
      return;
    }
    const auto length = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(b) / rate_));
    auto turn = std::make_unique<Turn>(
        Turn{k == CopyKind::host_to_device ? &h2d_ : &d2h_, length, Clock::time_point{}});
    inner().launch_host_func(s, &take_turn, turn.get());
    // From here take_turn may use the turn: it is finish_turn's to free, or, if even
    // enqueuing that fails, left (a leak, never a dangling pointer).
    Turn* queued = turn.release();
    try {
      ForwardingBackend::do_copy_async(dst, src, b, k, s);
    } catch (...) {
      inner().launch_host_func(s, &finish_turn, queued);
      throw;
    }
    inner().launch_host_func(s, &finish_turn, queued);
  }

  double rate_;
  Lane h2d_;
  Lane d2h_;
};

}  // namespace tidepool::bench_state
