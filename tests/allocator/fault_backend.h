// FaultBackend: a test backend that owns a host backend and forwards every call to it
// (ForwardingBackend), except that chosen operations fail with BackendError a counted
// number of times. The seam's own fault injection (Backend::inject_fault) covers the calls
// that obtain memory (device_alloc, create_physical, map, ...); this one covers those a
// caller cannot avoid once it holds memory or events: recording and querying events,
// synchronizing the device (a free's fallback), giving memory back.
// (tests/tiering/failing_backend.h fails every call for good, for teardown tests.)
//
// fail(op, count, after): after `after` more successful calls of `op`, the next `count`
// calls of it throw without reaching the host backend. Calls are counted per operation.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "allocator/backend.h"
#include "allocator/forwarding_backend.h"

namespace tidepool::test {

class FaultBackend final : public ForwardingBackend {
 public:
  enum class Op : std::uint8_t {
    device_free,
    record_event,
    event_query,
    event_synchronize,
    device_synchronize,
    stream_synchronize,
    unmap,
    release_physical,
    count_  // number of operations, not one
  };

  explicit FaultBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}

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

 private:
  struct Plan {
    std::atomic<int> pass{0};  // successful calls still to let through before failing
    std::atomic<int> fail{0};  // calls still to fail after those
    std::atomic<int> failed{0};
    std::atomic<int> succeeded{0};
  };

  static constexpr std::optional<Op> op_of(Call call) {
    switch (call) {
      case Call::device_free: return Op::device_free;
      case Call::record_event: return Op::record_event;
      case Call::event_query: return Op::event_query;
      case Call::event_synchronize: return Op::event_synchronize;
      case Call::device_synchronize: return Op::device_synchronize;
      case Call::stream_synchronize: return Op::stream_synchronize;
      case Call::unmap: return Op::unmap;
      case Call::release_physical: return Op::release_physical;
      default: return std::nullopt;
    }
  }
  // Throws when the call's operation is to fail now (before it reaches the host backend).
  void on_call(Call call) override {
    const std::optional<Op> op = op_of(call);
    if (!op) return;
    Plan& p = plans_[static_cast<std::size_t>(*op)];
    if (p.fail.load() == 0) return;
    if (p.pass.load() > 0) {
      p.pass.fetch_sub(1);
      return;
    }
    p.fail.fetch_sub(1);
    p.failed.fetch_add(1);
    throw BackendError(std::string("fault backend: ") + call_name(call) + ": injected failure");
  }
  void succeeded(Op op) { plans_[static_cast<std::size_t>(op)].succeeded.fetch_add(1); }

  void do_device_free(void* p, std::size_t b) override {
    ForwardingBackend::do_device_free(p, b);
    succeeded(Op::device_free);
  }
  void do_device_synchronize() override {
    ForwardingBackend::do_device_synchronize();
    succeeded(Op::device_synchronize);
  }
  void do_stream_synchronize(Stream s) override {
    ForwardingBackend::do_stream_synchronize(s);
    succeeded(Op::stream_synchronize);
  }
  Event do_create_event() override {
    const Event e = ForwardingBackend::do_create_event();
    events_->created.fetch_add(1);
    return e;
  }
  void do_destroy_event(Event e) override {
    ForwardingBackend::do_destroy_event(e);
    events_->destroyed.fetch_add(1);
  }
  void do_record_event(Event e, Stream s) override {
    ForwardingBackend::do_record_event(e, s);
    succeeded(Op::record_event);
  }
  bool do_event_query(Event e) override {
    const bool done = ForwardingBackend::do_event_query(e);
    succeeded(Op::event_query);
    return done;
  }
  void do_event_synchronize(Event e) override {
    ForwardingBackend::do_event_synchronize(e);
    succeeded(Op::event_synchronize);
  }
  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    const PhysicalHandle h = ForwardingBackend::do_create_physical(b, w);
    if (h) physicals_->created.fetch_add(1);
    return h;
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    ForwardingBackend::do_release_physical(h, b);
    succeeded(Op::release_physical);
    physicals_->released.fetch_add(1);
  }
  void do_unmap(void* va, std::size_t b) override {
    ForwardingBackend::do_unmap(va, b);
    succeeded(Op::unmap);
  }

  std::array<Plan, static_cast<std::size_t>(Op::count_)> plans_;
  std::shared_ptr<EventCounts> events_ = std::make_shared<EventCounts>();
  std::shared_ptr<PhysicalCounts> physicals_ = std::make_shared<PhysicalCounts>();
};

}  // namespace tidepool::test
