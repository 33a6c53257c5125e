// FaultBackend: a test backend that owns a host backend and forwards every call to it,
// except that chosen operations fail with BackendError a counted number of times. The
// seam's own fault injection (Backend::inject_fault) covers the calls that obtain memory
// (device_alloc, create_physical, map, ...); this one covers those a caller cannot avoid
// once it holds memory or events: recording and querying events, synchronizing the device
// (a free's fallback), giving memory back.
// (tests/tiering/failing_backend.h fails every call for good, for teardown tests.)
//
// fail(op, count, after): after `after` more successful calls of `op`, the next `count`
// calls of it throw without reaching the host backend. Calls are counted per operation.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "allocator/backend.h"

namespace tidepool::test {

class FaultBackend final : public Backend {
 public:
  enum class Op : std::uint8_t {
    device_free,
    record_event,
    event_query,
    event_synchronize,
    device_synchronize,
    unmap,
    release_physical,
    count_  // number of operations, not one
  };

  explicit FaultBackend(std::unique_ptr<Backend> inner)
      : Backend(inner->kind(), inner->device(), inner->granularity()), inner_(std::move(inner)) {}

  void fail(Op op, int count = 1, int after = 0) {
    Plan& p = plans_[static_cast<std::size_t>(op)];
    p.pass.store(after);
    p.fail.store(count);
  }
  // Events created and destroyed through this backend; outlives it, so a test can check
  // after the allocator (and with it the backend) is gone that no event leaked.
  struct EventCounts {
    std::atomic<int> created{0};
    std::atomic<int> destroyed{0};
  };
  std::shared_ptr<const EventCounts> event_counts() const { return events_; }
  // Calls of `op` that failed so far, and that reached the host backend and returned.
  int failures(Op op) const { return plans_[static_cast<std::size_t>(op)].failed.load(); }
  int successes(Op op) const { return plans_[static_cast<std::size_t>(op)].succeeded.load(); }
  // Physical handles created and released through this backend; outlives it, like
  // event_counts, so a test can check after the allocator is gone that none leaked.
  struct PhysicalCounts {
    std::atomic<int> created{0};
    std::atomic<int> released{0};
  };
  std::shared_ptr<const PhysicalCounts> physical_counts() const { return physicals_; }
  Backend& inner() { return *inner_; }

 private:
  struct Plan {
    std::atomic<int> pass{0};  // successful calls still to let through before failing
    std::atomic<int> fail{0};  // calls still to fail after those
    std::atomic<int> failed{0};
    std::atomic<int> succeeded{0};
  };

  // Throws when `op` is to fail now; otherwise runs `call` (the host backend's) and counts it.
  template <class Call>
  decltype(auto) gate(Op op, const char* name, Call&& call) {
    check(op, name);
    if constexpr (std::is_void_v<decltype(call())>) {
      call();
      plans_[static_cast<std::size_t>(op)].succeeded.fetch_add(1);
    } else {
      decltype(auto) r = call();
      plans_[static_cast<std::size_t>(op)].succeeded.fetch_add(1);
      return r;
    }
  }
  void check(Op op, const char* name) {
    Plan& p = plans_[static_cast<std::size_t>(op)];
    if (p.fail.load() == 0) return;
    if (p.pass.load() > 0) {
      p.pass.fetch_sub(1);
      return;
    }
    p.fail.fetch_sub(1);
    p.failed.fetch_add(1);
    throw BackendError(std::string("fault backend: ") + name + ": injected failure");
  }

  void* do_device_alloc(std::size_t b) override { return inner_->device_alloc(b); }
  void do_device_free(void* p, std::size_t b) override {
    gate(Op::device_free, "device_free", [&] { inner_->device_free(p, b); });
  }
  MemInfo do_mem_info() override { return inner_->mem_info(); }
  Stream do_create_stream() override { return inner_->create_stream(); }
  void do_destroy_stream(Stream s) override { inner_->destroy_stream(s); }
  void do_stream_synchronize(Stream s) override { inner_->stream_synchronize(s); }
  void do_device_synchronize() override {
    gate(Op::device_synchronize, "device_synchronize", [&] { inner_->device_synchronize(); });
  }
  Event do_create_event() override {
    const Event e = inner_->create_event();
    events_->created.fetch_add(1);
    return e;
  }
  void do_destroy_event(Event e) override {
    inner_->destroy_event(e);
    events_->destroyed.fetch_add(1);
  }
  void do_record_event(Event e, Stream s) override {
    gate(Op::record_event, "record_event", [&] { inner_->record_event(e, s); });
  }
  bool do_event_query(Event e) override {
    return gate(Op::event_query, "event_query", [&] { return inner_->event_query(e); });
  }
  void do_event_synchronize(Event e) override {
    gate(Op::event_synchronize, "event_synchronize", [&] { inner_->event_synchronize(e); });
  }
  void do_stream_wait_event(Stream s, Event e) override { inner_->stream_wait_event(s, e); }
  float do_event_elapsed_ms(Event a, Event b) override { return inner_->event_elapsed_ms(a, b); }
  void do_copy_async(void* dst, const void* src, std::size_t b, CopyKind k, Stream s) override {
    inner_->copy_async(dst, src, b, k, s);
  }
  void do_memset_async(void* dst, int v, std::size_t b, Stream s) override {
    inner_->memset_async(dst, v, b, s);
  }
  void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) override {
    inner_->launch_host_func(s, fn, arg);
  }
  void do_host_register(void* p, std::size_t b) override { inner_->host_register(p, b); }
  void do_host_unregister(void* p) override { inner_->host_unregister(p); }
  void* do_reserve_address(std::size_t b) override { return inner_->reserve_address(b); }
  void do_release_address(void* va, std::size_t b) override { inner_->release_address(va, b); }
  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    const PhysicalHandle h = inner_->create_physical(b, w);
    if (h) physicals_->created.fetch_add(1);
    return h;
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    gate(Op::release_physical, "release_physical", [&] { inner_->release_physical(h, b); });
    physicals_->released.fetch_add(1);
  }
  void do_map(void* va, std::size_t b, PhysicalHandle h) override { inner_->map(va, b, h); }
  void do_unmap(void* va, std::size_t b) override {
    gate(Op::unmap, "unmap", [&] { inner_->unmap(va, b); });
  }
  // The inner backend holds the real mappings (do_map maps there): it becomes the peers'
  // too and grants its own ranges.
  void do_grant_peer_access(void*, std::size_t, const std::vector<int>& peers) override {
    for (const int peer : peers) inner_->enable_peer_access(peer);
  }
  bool do_peer_has_access(const void* a, int peer) override {
    return inner_->peer_has_access(a, peer);
  }

  std::unique_ptr<Backend> inner_;
  std::array<Plan, static_cast<std::size_t>(Op::count_)> plans_;
  std::shared_ptr<EventCounts> events_ = std::make_shared<EventCounts>();
  std::shared_ptr<PhysicalCounts> physicals_ = std::make_shared<PhysicalCounts>();
};

}  // namespace tidepool::test
