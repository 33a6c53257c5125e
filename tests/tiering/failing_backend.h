// FailingBackend: a test backend that forwards every call to a real backend (the host
// backend) until it is told to die; from then on every call throws BackendError, as the
// cuda backend does once its context is destroyed at process exit.
//
// fail_after(n) lets n more calls through, then fails all of them, so a test can sweep n
// and make a teardown fail at each of its steps in turn. The seam's own fault injection
// (Backend::inject_fault) fails one kind of operation a counted number of times; this
// one fails everything, for good. fail_calls_to(op, count, skip) fails chosen calls of
// one operation, of any kind (release_physical, unmap: those inject_fault cannot reach),
// so a test can fail each call an operation makes in turn. live_physicals() counts the
// physical handles created and not released, so a test sees one leaked or released twice.
// calls_to(op) counts the calls made to one operation, so a test sees one that should
// not have been made (a release_stream that waits for a stream nothing used).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "allocator/backend.h"

namespace tidepool::tiering_test {

class FailingBackend final : public Backend {
 public:
  explicit FailingBackend(Backend& inner)
      : Backend(inner.kind(), inner.device(), inner.granularity()), inner_(inner) {}

  // After `calls` more calls, every call throws. Negative: never fail (the default).
  void fail_after(long calls) { remaining_.store(calls); }
  // Calls that failed so far.
  long failed_calls() const { return failed_.load(); }
  // Of the next calls to `op` (the Backend method's name: "release_physical"), lets `skip`
  // through, then fails `count`. Replaces what was set for `op` before; count 0 clears it.
  void fail_calls_to(const std::string& op, int count, int skip = 0) {
    std::lock_guard lock(mutex_);
    if (count <= 0) {
      chosen_.erase(op);
    } else {
      chosen_[op] = ChosenFailures{skip, count};
    }
  }
  // Calls to `op` (the Backend method's name) so far, failed ones included.
  long calls_to(const std::string& op) const {
    std::lock_guard lock(mutex_);
    auto it = calls_.find(op);
    return it == calls_.end() ? 0 : it->second;
  }
  // Physical handles created through this backend and not released yet.
  std::size_t live_physicals() const {
    std::lock_guard lock(mutex_);
    return live_.size();
  }

 private:
  struct ChosenFailures {
    int skip;
    int count;
  };

  // Consumes a failure chosen for `op` by fail_calls_to, if one is due.
  bool chosen_failure(const char* op) {
    std::lock_guard lock(mutex_);
    auto it = chosen_.find(op);
    if (it == chosen_.end()) return false;
    if (it->second.skip > 0) {
      it->second.skip--;
      return false;
    }
    if (--it->second.count == 0) chosen_.erase(it);
    return true;
  }

  void gate(const char* op) {
    {
      std::lock_guard lock(mutex_);
      ++calls_[op];
    }
    if (chosen_failure(op)) {
      failed_.fetch_add(1);
      throw BackendError(std::string("failing backend: ") + op + ": a chosen failure");
    }
    if (remaining_.load() < 0) return;
    if (remaining_.fetch_sub(1) > 0) return;
    remaining_.store(0);
    failed_.fetch_add(1);
    throw BackendError(std::string("failing backend: ") + op + ": the backend is gone");
  }

  void* do_device_alloc(std::size_t b) override {
    return gate("device_alloc"), inner_.device_alloc(b);
  }
  void do_device_free(void* p, std::size_t b) override {
    gate("device_free");
    inner_.device_free(p, b);
  }
  MemInfo do_mem_info() override { return gate("mem_info"), inner_.mem_info(); }
  Stream do_create_stream() override { return gate("create_stream"), inner_.create_stream(); }
  void do_destroy_stream(Stream s) override { gate("destroy_stream"); inner_.destroy_stream(s); }
  void do_stream_synchronize(Stream s) override {
    gate("stream_synchronize");
    inner_.stream_synchronize(s);
  }
  void do_device_synchronize() override { gate("device_synchronize"); inner_.device_synchronize(); }
  Event do_create_event() override { return gate("create_event"), inner_.create_event(); }
  void do_destroy_event(Event e) override { gate("destroy_event"); inner_.destroy_event(e); }
  void do_record_event(Event e, Stream s) override {
    gate("record_event");
    inner_.record_event(e, s);
  }
  bool do_event_query(Event e) override { return gate("event_query"), inner_.event_query(e); }
  void do_event_synchronize(Event e) override {
    gate("event_synchronize");
    inner_.event_synchronize(e);
  }
  void do_stream_wait_event(Stream s, Event e) override {
    gate("stream_wait_event");
    inner_.stream_wait_event(s, e);
  }
  float do_event_elapsed_ms(Event a, Event b) override {
    return gate("event_elapsed_ms"), inner_.event_elapsed_ms(a, b);
  }
  void do_copy_async(void* dst, const void* src, std::size_t b, CopyKind k, Stream s) override {
    gate("copy_async");
    inner_.copy_async(dst, src, b, k, s);
  }
  void do_memset_async(void* dst, int v, std::size_t b, Stream s) override {
    gate("memset_async");
    inner_.memset_async(dst, v, b, s);
  }
  void do_launch_host_func(Stream s, void (*fn)(void*), void* arg) override {
    gate("launch_host_func");
    inner_.launch_host_func(s, fn, arg);
  }
  void do_host_register(void* p, std::size_t b) override {
    gate("host_register");
    inner_.host_register(p, b);
  }
  void do_host_unregister(void* p) override { gate("host_unregister"); inner_.host_unregister(p); }
  void* do_reserve_address(std::size_t b) override {
    return gate("reserve_address"), inner_.reserve_address(b);
  }
  void do_release_address(void* va, std::size_t b) override {
    gate("release_address");
    inner_.release_address(va, b);
  }
  PhysicalHandle do_create_physical(std::size_t b, MemoryLocation w) override {
    gate("create_physical");
    const PhysicalHandle h = inner_.create_physical(b, w);
    std::lock_guard lock(mutex_);
    if (h) live_.insert(h.value);
    return h;
  }
  void do_release_physical(PhysicalHandle h, std::size_t b) override {
    gate("release_physical");
    inner_.release_physical(h, b);
    std::lock_guard lock(mutex_);
    live_.erase(h.value);
  }
  void do_map(void* va, std::size_t b, PhysicalHandle h) override {
    gate("map");
    inner_.map(va, b, h);
  }
  void do_unmap(void* va, std::size_t b) override { gate("unmap"); inner_.unmap(va, b); }
  // The inner backend holds the real mappings: it becomes the peers' too.
  void do_grant_peer_access(void*, std::size_t, const std::vector<int>& peers) override {
    gate("grant_peer_access");
    for (const int peer : peers) inner_.enable_peer_access(peer);
  }
  bool do_peer_has_access(const void* a, int peer) override {
    return gate("peer_has_access"), inner_.peer_has_access(a, peer);
  }

  Backend& inner_;
  std::atomic<long> remaining_{-1};
  std::atomic<long> failed_{0};
  mutable std::mutex mutex_;  // chosen_, calls_, live_
  std::map<std::string, ChosenFailures, std::less<>> chosen_;
  std::map<std::string, long, std::less<>> calls_;
  std::set<std::uint64_t> live_;
};

}  // namespace tidepool::tiering_test
