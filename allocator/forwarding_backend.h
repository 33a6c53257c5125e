// ForwardingBackend: a backend that passes every call through to another one. The base of
// backend decorators: one that counts calls (on_call), one that models the PCIe link's
// time for the copies that cross it (overrides do_copy_async), and the like, each
// overriding only what it changes instead of restating the whole seam.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "allocator/backend.h"

namespace tidepool {

// Every seam operation a ForwardingBackend passes on, in one list: X(name) for each.
#define TIDEPOOL_FORWARDED_CALLS(X)                                                          \
  X(device_alloc) X(device_free) X(mem_info) X(create_stream) X(destroy_stream)              \
  X(stream_synchronize) X(device_synchronize) X(create_event) X(destroy_event)               \
  X(record_event) X(event_query) X(event_synchronize) X(stream_wait_event)                   \
  X(event_elapsed_ms) X(copy_async) X(memset_async) X(launch_host_func) X(host_register)     \
  X(host_unregister) X(reserve_address) X(release_address) X(create_physical)                \
  X(release_physical) X(map) X(unmap) X(grant_peer_access) X(peer_has_access)

class ForwardingBackend : public Backend {
 public:
  // Every seam operation a ForwardingBackend passes on, for on_call.
#define TIDEPOOL_CALL_ENUMERATOR(name) name,
  enum class Call : std::uint8_t { TIDEPOOL_FORWARDED_CALLS(TIDEPOOL_CALL_ENUMERATOR) };
#undef TIDEPOOL_CALL_ENUMERATOR

  // Passes the calls to `inner`, which it owns.
  // (Members initialise in declaration order: inner_ is bound before owned_ takes it.)
  explicit ForwardingBackend(std::unique_ptr<Backend> inner)
      : Backend(inner->kind(), inner->device(), inner->granularity()),
        inner_(*inner),
        owned_(std::move(inner)) {}
  // Passes the calls to `inner`, which must outlive it.
  explicit ForwardingBackend(Backend& inner)
      : Backend(inner.kind(), inner.device(), inner.granularity()), inner_(inner) {}

  Backend& inner() const { return inner_; }

  // The seam method's name ("create_physical"), for decorators that report or choose
  // calls by name.
  static const char* call_name(Call call) {
#define TIDEPOOL_CALL_NAME(name) #name,
    static constexpr const char* kNames[] = {TIDEPOOL_FORWARDED_CALLS(TIDEPOOL_CALL_NAME)};
#undef TIDEPOOL_CALL_NAME
    return kNames[static_cast<std::size_t>(call)];
  }

 protected:
  // Called before each call is passed on (from any thread that calls the backend).
  virtual void on_call(Call) {}

  void* do_device_alloc(std::size_t b) override {
    return on_call(Call::device_alloc), inner_.device_alloc(b);
  }
  void do_device_free(void* p, std::size_t b) override {
    on_call(Call::device_free);
    inner_.device_free(p, b);
  }
  MemInfo do_mem_info() override { return on_call(Call::mem_info), inner_.mem_info(); }
  Stream do_create_stream() override {
    return on_call(Call::create_stream), inner_.create_stream();
  }
  void do_destroy_stream(Stream s) override {
    on_call(Call::destroy_stream);
    inner_.destroy_stream(s);
  }
  void do_stream_synchronize(Stream s) override {
    on_call(Call::stream_synchronize);
    inner_.stream_synchronize(s);
  }
  void do_device_synchronize() override {
    on_call(Call::device_synchronize);
    inner_.device_synchronize();
  }
  Event do_create_event() override { return on_call(Call::create_event), inner_.create_event(); }
  void do_destroy_event(Event e) override {
    on_call(Call::destroy_event);
    inner_.destroy_event(e);
  }
  void do_record_event(Event e, Stream s) override {
    on_call(Call::record_event);
    inner_.record_event(e, s);
  }
  bool do_event_query(Event e) override {
    return on_call(Call::event_query), inner_.event_query(e);
  }
  void do_event_synchronize(Event e) override {
    on_call(Call::event_synchronize);
    inner_.event_synchronize(e);
  }
  void do_stream_wait_event(Stream s, Event e) override {
    on_call(Call::stream_wait_event);
    inner_.stream_wait_event(s, e);
  }
  float do_event_elapsed_ms(Event a, Event b) override {
    return on_call(Call::event_elapsed_ms), inner_.event_elapsed_ms(a, b);
  }
  void do_copy_async(void* dst, const void* src, std::size_t b, CopyKind k, Stream s) override {
    on_call(Call::copy_async);
    inner_.copy_async(dst, src, b, k, s);
  }
  void do_memset_async(void* dst, int v, std::size_t b, Stream s) override {
    on_call(Call::memset_async);
    inner_.memset_async(dst, v, b, s);
  }
  void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) override {
    on_call(Call::launch_host_func);
    inner_.launch_host_func(s, fn, arg);
  }
  void do_host_register(void* p, std::size_t b) override {
    on_call(Call::host_register);
    inner_.host_register(p, b);
  }
  void do_host_unregister(void* p) override {
    on_call(Call::host_unregister);
    inner_.host_unregister(p);
  }
  void* do_reserve_address(std::size_t b) override {
    return on_call(Call::reserve_address), inner_.reserve_address(b);
  }
  void do_release_address(void* va, std::size_t b) override {
    on_call(Call::release_address);
    inner_.release_address(va, b);
  }
  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    return on_call(Call::create_physical), inner_.create_physical(b, w);
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    on_call(Call::release_physical);
    inner_.release_physical(h, b);
  }
  void do_map(void* va, std::size_t b, PhysicalHandle h) override {
    on_call(Call::map);
    inner_.map(va, b, h);
  }
  void do_unmap(void* va, std::size_t b) override {
    on_call(Call::unmap);
    inner_.unmap(va, b);
  }
  // The inner backend grants its own mappings (the seam's public call for that is
  // enable_peer_access, which records the peer for later mappings too).
  void do_grant_peer_access(void*, std::size_t, const std::vector<int>& peers) override {
    on_call(Call::grant_peer_access);
    for (const int peer : peers) inner_.enable_peer_access(peer);
  }
  bool do_peer_has_access(const void* a, int peer) override {
    return on_call(Call::peer_has_access), inner_.peer_has_access(a, peer);
  }

 private:
  Backend& inner_;
  std::unique_ptr<Backend> owned_;
};

}  // namespace tidepool
