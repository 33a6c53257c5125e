// Shared helpers of the allocator tests: which backends to run on, allocators over a
// fresh backend, an iteration scale (TIDEPOOL_TEST_SCALE), a small JSON checker, and
// reclaim and empty-cache hooks registered for a test's scope.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/forwarding_backend.h"
#include "allocator/reclaim.h"
#include "tests/support/test_backend.h"
#include "tests/support/test_scale.h"
#include "tests/support/test_seed.h"

namespace tidepool::test {

// A hook of allocator/reclaim.h, registered from construction to destruction.
template <class Hook, int (*Register)(Hook), void (*Unregister)(int)>
class ScopedHook {
 public:
  explicit ScopedHook(Hook hook) : id_(Register(std::move(hook))) {}
  ~ScopedHook() { Unregister(id_); }
  ScopedHook(const ScopedHook&) = delete;
  ScopedHook& operator=(const ScopedHook&) = delete;
  int id() const { return id_; }

 private:
  int id_;
};
using ScopedReclaimHook = ScopedHook<ReclaimHook, register_reclaim_hook, unregister_reclaim_hook>;
using ScopedEmptyCacheHook =
    ScopedHook<EmptyCacheHook, register_empty_cache_hook, unregister_empty_cache_hook>;

// Iteration counts times TIDEPOOL_TEST_SCALE (tests/support/test_scale.h).
inline int scaled(int n) { return static_cast<int>(test_support::scaled(n)); }

// A backend of the named kind ("host" or "cuda"), or nullptr (and a GTEST_SKIP by the
// caller) when "cuda" is asked for on a machine without a GPU.
inline std::unique_ptr<Backend> make_backend(const std::string& kind,
                                             std::size_t host_capacity = std::size_t{1} << 30) {
  return test_support::make_test_backend(kind == "cuda" ? BackendKind::cuda : BackendKind::host,
                                         host_capacity);
}

// The parameter of the batteries that run on each backend with either kind of segment:
// the backend kind (as make_backend takes it) and whether segments are expandable.
using BackendAndSegments = std::tuple<std::string, bool>;
// Every such pair, and the name of one in test listings ("host_expandable", "cuda_plain").
// The backends the parametrised suites run on: the host backend in the test_*.cpp
// binaries (CI has no GPU), the cuda one in the gpu_test_*.cpp binaries that include
// them (label gpu, which scripts/device-check builds and runs).
#ifndef TIDEPOOL_ALLOCATOR_TEST_BACKENDS
#define TIDEPOOL_ALLOCATOR_TEST_BACKENDS ::testing::Values(std::string("host"))
#endif
inline auto backends_and_segment_kinds() {
  return ::testing::Combine(TIDEPOOL_ALLOCATOR_TEST_BACKENDS, ::testing::Bool());
}
inline std::string backend_and_segments_name(
    const ::testing::TestParamInfo<BackendAndSegments>& info) {
  return std::get<0>(info.param) + (std::get<1>(info.param) ? "_expandable" : "_plain");
}

// An allocator over a fresh backend of the parameter's kind, with its kind of segments and
// `o` otherwise; nullptr where that backend does not exist (cuda without a GPU).
inline std::unique_ptr<CachingAllocator> make_allocator(const BackendAndSegments& param,
                                                        AllocatorOptions o = {}) {
  auto backend = make_backend(std::get<0>(param));
  if (!backend) return nullptr;
  o.expandable_segments = std::get<1>(param);
  return std::make_unique<CachingAllocator>(std::move(backend), o);
}

#define TIDEPOOL_BACKEND_OR_SKIP(var, kind, ...)                   \
  auto var = ::tidepool::test::make_backend(kind, ##__VA_ARGS__);  \
  if (!var) {                                                      \
    GTEST_SKIP() << "no CUDA device on this machine";              \
  }                                                                \
  static_assert(true)

// Lets a held stream go when the allocator synchronizes with any stream, so that the work
// held is still queued when the allocator decides whether to wait for it (a timer letting
// it go could fire first on a loaded machine, and there was then nothing to wait for).
class ReleasesOnSynchronize : public ForwardingBackend {
 public:
  ReleasesOnSynchronize(std::unique_ptr<Backend> inner, std::atomic<bool>& go)
      : ForwardingBackend(std::move(inner)), go_(go) {}

 protected:
  void on_call(Call call) override {
    if (call == Call::stream_synchronize) go_ = true;
  }

 private:
  std::atomic<bool>& go_;
};

// Holds a stream busy: everything enqueued on it after construction waits until release()
// (a host function that spins on a flag), so "work still pending on the stream" is real.
class StreamHold {
 public:
  StreamHold(Backend& b, Stream s) { b.launch_host_func(s, &StreamHold::wait, this); }
  // The host function reads this object until it returns: the object must outlive it (the
  // stream's worker otherwise spins on freed stack memory, which may never read "open").
  ~StreamHold() {
    release();
    while (!finished_.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  StreamHold(const StreamHold&) = delete;
  StreamHold& operator=(const StreamHold&) = delete;
  void release() { open_.store(true); }

 private:
  static void wait(void* self) {
    auto* h = static_cast<StreamHold*>(self);
    while (!h->open_.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    h->finished_.store(true);  // the last access to *h
  }
  std::atomic<bool> open_{false};
  std::atomic<bool> finished_{false};
};

// Minimal recursive-descent JSON validator (RFC 8259 grammar, no semantic checks).
class JsonChecker {
 public:
  static bool valid(std::string_view text) {
    JsonChecker c(text);
    c.ws();
    if (!c.value()) return false;
    c.ws();
    return c.i_ == text.size();
  }

 private:
  explicit JsonChecker(std::string_view t) : t_(t) {}
  bool eof() const { return i_ >= t_.size(); }
  char peek() const { return eof() ? '\0' : t_[i_]; }
  void ws() {
    while (!eof() && (peek() == ' ' || peek() == '\n' || peek() == '\t' || peek() == '\r')) ++i_;
  }
  bool lit(std::string_view w) {
    if (t_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  bool value() {
    switch (peek()) {
      case '{': return object();
      case '[': return array();
      case '"': return string();
      case 't': return lit("true");
      case 'f': return lit("false");
      case 'n': return lit("null");
      default: return number();
    }
  }
  bool object() {
    ++i_;
    ws();
    if (peek() == '}') return ++i_, true;
    for (;;) {
      ws();
      if (!string()) return false;
      ws();
      if (peek() != ':') return false;
      ++i_;
      ws();
      if (!value()) return false;
      ws();
      if (peek() == ',') { ++i_; continue; }
      if (peek() == '}') return ++i_, true;
      return false;
    }
  }
  bool array() {
    ++i_;
    ws();
    if (peek() == ']') return ++i_, true;
    for (;;) {
      ws();
      if (!value()) return false;
      ws();
      if (peek() == ',') { ++i_; continue; }
      if (peek() == ']') return ++i_, true;
      return false;
    }
  }
  bool string() {
    if (peek() != '"') return false;
    ++i_;
    while (!eof()) {
      const char c = t_[i_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c == '\\') {
        const char e = peek();
        ++i_;
        if (e == 'u') {
          for (int k = 0; k < 4; ++k, ++i_)
            if (!std::isxdigit(static_cast<unsigned char>(peek()))) return false;
        } else if (std::string_view("\"\\/bfnrt").find(e) == std::string_view::npos) {
          return false;
        }
      }
    }
    return false;
  }
  bool number() {
    const std::size_t start = i_;
    if (peek() == '-') ++i_;
    if (!std::isdigit(static_cast<unsigned char>(peek()))) return false;
    while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
    if (peek() == '.') {
      ++i_;
      if (!std::isdigit(static_cast<unsigned char>(peek()))) return false;
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
    }
    if (peek() == 'e' || peek() == 'E') {
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (!std::isdigit(static_cast<unsigned char>(peek()))) return false;
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
    }
    return i_ > start;
  }
  std::string_view t_;
  std::size_t i_ = 0;
};

// Occurrences of `what` in `text` (blocks of a state in a snapshot, lines of a message).
inline std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++n;
  return n;
}

}  // namespace tidepool::test
