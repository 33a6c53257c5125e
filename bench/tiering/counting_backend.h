// CountingBackend: a backend that forwards every call to the one it owns and counts the
// calls per operation, so a benchmark can say how many backend calls (copies, event
// records, stream waits, event queries, synchronizations) a pass of the tiered store made
// per tensor against the plain copy_async baseline, and a VMM migration per chunk. A
// relaxed atomic increment per call: the baseline pays it too.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "allocator/backend.h"

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

class CountingBackend final : public Backend {
 public:
  explicit CountingBackend(std::unique_ptr<Backend> inner)
      : Backend(inner->kind(), inner->device(), inner->granularity()), inner_(std::move(inner)) {}

  CallCounts counts() const {
    CallCounts c;
    for (std::size_t i = 0; i < c.n.size(); ++i) {
      c.n[i] = counts_[i].load(std::memory_order_relaxed);
    }
    return c;
  }

 private:
  void count(Op op) {
    counts_[static_cast<std::size_t>(op)].fetch_add(1, std::memory_order_relaxed);
  }

  void* do_device_alloc(std::size_t b) override {
    return count(Op::other), inner_->device_alloc(b);
  }
  void do_device_free(void* p, std::size_t b) override {
    count(Op::other);
    inner_->device_free(p, b);
  }
  MemInfo do_mem_info() override { return count(Op::other), inner_->mem_info(); }
  Stream do_create_stream() override { return count(Op::other), inner_->create_stream(); }
  void do_destroy_stream(Stream s) override {
    count(Op::other);
    inner_->destroy_stream(s);
  }
  void do_stream_synchronize(Stream s) override {
    count(Op::stream_synchronize);
    inner_->stream_synchronize(s);
  }
  void do_device_synchronize() override {
    count(Op::other);
    inner_->device_synchronize();
  }
  Event do_create_event() override { return count(Op::other), inner_->create_event(); }
  void do_destroy_event(Event e) override {
    count(Op::other);
    inner_->destroy_event(e);
  }
  void do_record_event(Event e, Stream s) override {
    count(Op::record_event);
    inner_->record_event(e, s);
  }
  bool do_event_query(Event e) override { return count(Op::event_query), inner_->event_query(e); }
  void do_event_synchronize(Event e) override {
    count(Op::event_synchronize);
    inner_->event_synchronize(e);
  }
  void do_stream_wait_event(Stream s, Event e) override {
    count(Op::stream_wait_event);
    inner_->stream_wait_event(s, e);
  }
  float do_event_elapsed_ms(Event a, Event b) override {
    return count(Op::other), inner_->event_elapsed_ms(a, b);
  }
  void do_copy_async(void* dst, const void* src, std::size_t b, CopyKind k, Stream s) override {
    count(Op::copy);
    inner_->copy_async(dst, src, b, k, s);
  }
  void do_memset_async(void* dst, int v, std::size_t b, Stream s) override {
    count(Op::other);
    inner_->memset_async(dst, v, b, s);
  }
  void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) override {
    count(Op::other);
    inner_->launch_host_func(s, fn, arg);
  }
  void do_host_register(void* p, std::size_t b) override {
    count(Op::other);
    inner_->host_register(p, b);
  }
  void do_host_unregister(void* p) override {
    count(Op::other);
    inner_->host_unregister(p);
  }
  void* do_reserve_address(std::size_t b) override {
    return count(Op::other), inner_->reserve_address(b);
  }
  void do_release_address(void* va, std::size_t b) override {
    count(Op::other);
    inner_->release_address(va, b);
  }
  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    return count(Op::create_physical), inner_->create_physical(b, w);
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    count(Op::release_physical);
    inner_->release_physical(h, b);
  }
  void do_map(void* va, std::size_t b, PhysicalHandle h) override {
    count(Op::map);
    inner_->map(va, b, h);
  }
  void do_unmap(void* va, std::size_t b) override {
    count(Op::unmap);
    inner_->unmap(va, b);
  }
  void do_grant_peer_access(void*, std::size_t, const std::vector<int>& peers) override {
    count(Op::other);
    for (const int peer : peers) inner_->enable_peer_access(peer);
  }
  bool do_peer_has_access(const void* a, int peer) override {
    return count(Op::other), inner_->peer_has_access(a, peer);
  }

  std::unique_ptr<Backend> inner_;
  std::array<std::atomic<std::uint64_t>, static_cast<std::size_t>(Op::count_)> counts_{};
};

}  // namespace tidepool::bench_state
