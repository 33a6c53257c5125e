// CountingBackend: a backend that forwards every call to the one it owns
// (ForwardingBackend) and counts the calls per operation, so a benchmark can say how many
// backend calls (copies, event records, stream waits, event queries, synchronizations) a
// pass of the tiered store made per tensor against the plain copy_async baseline, and a
// VMM migration per chunk. A relaxed atomic increment per call: the baseline pays it too.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "allocator/backend.h"
#include "allocator/forwarding_backend.h"

namespace tidepool::bench_state {

enum class Op : std::uint8_t {
  copy,
  record_event,
  stream_wait_event,
  event_query,
  event_synchronize,
  stream_synchronize,
  create_physical,
  release_physical,
  map,
  unmap,
  other,
  count_
};

// A snapshot of the counts; subtract two to get a pass's.
struct CallCounts {
  std::array<std::uint64_t, static_cast<std::size_t>(Op::count_)> n{};
  std::uint64_t operator[](Op op) const { return n[static_cast<std::size_t>(op)]; }
  std::uint64_t total() const {
    std::uint64_t t = 0;
    for (const std::uint64_t v : n) t += v;
    return t;
  }
  CallCounts operator-(const CallCounts& before) const {
    CallCounts d;
    for (std::size_t i = 0; i < n.size(); ++i) d.n[i] = n[i] - before.n[i];
    return d;
  }
};

class CountingBackend final : public ForwardingBackend {
 public:
  explicit CountingBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}

  CallCounts counts() const {
    CallCounts c;
    for (std::size_t i = 0; i < c.n.size(); ++i) {
      c.n[i] = counts_[i].load(std::memory_order_relaxed);
    }
    return c;
  }

 private:
  static Op op_of(Call call) {
    switch (call) {
      case Call::copy_async: return Op::copy;
      case Call::record_event: return Op::record_event;
      case Call::stream_wait_event: return Op::stream_wait_event;
      case Call::event_query: return Op::event_query;
      case Call::event_synchronize: return Op::event_synchronize;
      case Call::stream_synchronize: return Op::stream_synchronize;
      case Call::create_physical: return Op::create_physical;
      case Call::release_physical: return Op::release_physical;
      case Call::map: return Op::map;
      case Call::unmap: return Op::unmap;
      default: return Op::other;
    }
  }
  void on_call(Call call) override {
    counts_[static_cast<std::size_t>(op_of(call))].fetch_add(1, std::memory_order_relaxed);
  }

  std::array<std::atomic<std::uint64_t>, static_cast<std::size_t>(Op::count_)> counts_{};
};

}  // namespace tidepool::bench_state
