// LinkModelBackend: a backend (the host backend, in practice) whose copies between host
// and device take the time a PCIe link of a given rate would give them, one copy at a
// time per direction, both directions at once, as a GPU's copy engines do. The copy itself
// still runs (fast, host memory to host memory), within its modelled time: the stream is
// held until the copy's turn on its direction's lane has passed its bytes at the rate.
//
// Which copies cross the link: host_to_device and device_to_host ones, and, as on a GPU,
// device_to_device ones between memory mapped from a host backing (create_physical with
// MemoryLocation::host, as a VMM migration's host-NUMA memory) and device memory: the
// decorator remembers the host backings it created and where they are mapped.
//
// What it is for: the tiered optimizer steps on the CPU, timed over such a link, say
// whether their pipeline keeps the link busy (a step near max(H2D, D2H bytes) / rate) or
// leaves it idle while the host waits, without a GPU. The rate is set far below the
// host's memcpy rate, so that the modelled time dominates and the comparison is the
// pipeline's, not the machine's.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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
  // Sleeps, then spins the last stretch: a sleep overshoots by the scheduler's wake-up
  // latency (~0.1 ms here), which would put a gap the modelled link does not have between
  // back-to-back copies of a lane, about 5% of a step of 2 MiB copies.
  static void finish_turn(void* arg) {
    const std::unique_ptr<Turn> turn(static_cast<Turn*>(arg));
    constexpr auto kSpin = std::chrono::microseconds(300);
    std::this_thread::sleep_until(turn->done - kSpin);
    while (Clock::now() < turn->done) {
    }
  }

  // The lane a copy crosses the link on, if any.
  Lane* lane_of(void* dst, const void* src, CopyKind k) {
    if (k == CopyKind::host_to_device) return &h2d_;
    if (k == CopyKind::device_to_host) return &d2h_;
    if (k != CopyKind::device_to_device) return nullptr;
    std::lock_guard lock(maps_mutex_);
    const bool from_host = in_host_mapping_locked(src);
    const bool to_host = in_host_mapping_locked(dst);
    if (from_host == to_host) return nullptr;
    return from_host ? &h2d_ : &d2h_;
  }
  bool in_host_mapping_locked(const void* p) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = host_mappings_.upper_bound(a);
    if (it == host_mappings_.begin()) return false;
    --it;
    return a < it->first + it->second;
  }

  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    const PhysicalHandle h = ForwardingBackend::do_create_physical(b, w);
    if (h && w == MemoryLocation::host) {
      std::lock_guard lock(maps_mutex_);
      host_handles_.insert(h.value);
    }
    return h;
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    ForwardingBackend::do_release_physical(h, b);
    std::lock_guard lock(maps_mutex_);
    host_handles_.erase(h.value);
  }
  void do_map(void* va, std::size_t b, PhysicalHandle h) override {
    ForwardingBackend::do_map(va, b, h);
    std::lock_guard lock(maps_mutex_);
    if (host_handles_.count(h.value) != 0) {
      host_mappings_[reinterpret_cast<std::uintptr_t>(va)] = b;
    }
  }
  void do_unmap(void* va, std::size_t b) override {
    ForwardingBackend::do_unmap(va, b);
    std::lock_guard lock(maps_mutex_);
    const auto lo = reinterpret_cast<std::uintptr_t>(va);
    host_mappings_.erase(host_mappings_.lower_bound(lo), host_mappings_.lower_bound(lo + b));
  }

  void do_copy_async(void* dst, const void* src, std::size_t b, CopyKind k, Stream s) override {
    Lane* lane = lane_of(dst, src, k);
    if (lane == nullptr) {
      ForwardingBackend::do_copy_async(dst, src, b, k, s);
      return;
    }
    const auto length = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(b) / rate_));
    auto turn = std::make_unique<Turn>(Turn{lane, length, Clock::time_point{}});
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
  std::mutex maps_mutex_;  // host_handles_, host_mappings_
  std::set<std::uint64_t> host_handles_;                 // host backings alive
  std::map<std::uintptr_t, std::size_t> host_mappings_;  // where they are mapped: va -> bytes
};

}  // namespace tidepool::bench_state
