// Streams and events of tidepool's host backend for the shim's stream tests: the fake
// libcudart (fake_cudart.c) hands them out and works them when this library is loaded,
// so that tidepool, on the host backend, can wait for a "CUDA" stream as it waits for a
// program's stream on a GPU, and a dead handle is an error to it. Loaded by the test
// after the shim set libtidepool up (it resolves to the copy the shim loaded).
//
// Each device's host backend knows only its own streams and events, as CUDA records an
// event only on a stream of the event's device. What CUDA allows across devices and
// threads is emulated here:
//   - an event is this library's, not a backend's: a record enqueues, on the stream, the
//     completion of a new signal; a wait enqueues a wait for the signal of the latest
//     record (taken at the call, as cudaStreamWaitEvent takes it), so a stream of any
//     device may wait, and destroying the event does not disturb waits already enqueued;
//   - 0 and cudaStreamLegacy (0x1) name the device's default stream, cudaStreamPerThread
//     (0x2) a stream of the calling thread's own (created at first use, never destroyed);
//   - a gate: host_streams_hold enqueues a wait for it, host_streams_open opens it, so a
//     test holds a stream's work back for as long as it needs, with no timing.
//   - a failure: host_streams_fail enqueues work that fails, so the stream's next
//     synchronize (and the device's) fails once, as after a kernel's error;
//     host_streams_fail_next_map makes the device's next mapping of memory fail with a
//     CUDA error code, as a driver call after a kernel faulted.
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <mutex>
#include <unordered_map>

#include "allocator/device_registry.h"
#include "tests/support/signal.h"

namespace {

using tidepool::test_support::Signal;

struct HostEvent {
  std::shared_ptr<Signal> latest;  // the last record's; null before any
};

std::mutex g_mutex;  // guards g_stream_devices
std::unordered_map<void*, int> g_stream_devices;
thread_local std::unordered_map<int, void*> t_per_thread_streams;
const std::shared_ptr<Signal> g_gate = std::make_shared<Signal>();

tidepool::Backend& backend_of(int device) { return tidepool::device_allocator(device).backend(); }

void* create_on(int device) {
  void* handle = backend_of(device).create_stream().handle;
  std::lock_guard lock(g_mutex);
  g_stream_devices.emplace(handle, device);
  return handle;
}

int device_of(void* stream) {
  std::lock_guard lock(g_mutex);
  const auto it = g_stream_devices.find(stream);
  return it == g_stream_devices.end() ? -1 : it->second;
}

// The backend stream `stream` names, and its device (`current` for the special handles).
tidepool::Stream resolve(void* stream, int current, int& device) {
  const auto handle = reinterpret_cast<std::uintptr_t>(stream);
  device = current;
  if (handle == 0 || handle == 1) return tidepool::Stream{nullptr};
  if (handle == 2) {
    void*& own = t_per_thread_streams[current];
    if (own == nullptr) own = create_on(current);
    return tidepool::Stream{own};
  }
  device = device_of(stream);
  return tidepool::Stream{stream};
}

// Enqueues on `stream` a wait for `signal` (a copy of the pointer travels with the work).
int enqueue_wait(void* stream, int current, const std::shared_ptr<Signal>& signal) {
  int device = 0;
  const tidepool::Stream s = resolve(stream, current, device);
  if (device < 0) return 400;  // cudaErrorInvalidResourceHandle
  if (signal == nullptr) return 0;  // an event never recorded: nothing to wait for
  auto* held = new std::shared_ptr<Signal>(signal);
  backend_of(device).launch_host_func(
      s,
      [](void* arg) {
        std::unique_ptr<std::shared_ptr<Signal>> own(static_cast<std::shared_ptr<Signal>*>(arg));
        (*own)->wait();
      },
      held);
  return 0;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* host_streams_create(int device) {
  return create_on(device);
}

__attribute__((visibility("default"))) void host_streams_destroy(void* stream) {
  const int device = device_of(stream);
  backend_of(device).destroy_stream(tidepool::Stream{stream});
  std::lock_guard lock(g_mutex);
  g_stream_devices.erase(stream);
}

// The device of a stream this library created, or -1.
__attribute__((visibility("default"))) int host_streams_device(void* stream) {
  return device_of(stream);
}

__attribute__((visibility("default"))) void* host_events_create() { return new HostEvent; }

__attribute__((visibility("default"))) void host_events_destroy(void* event) {
  delete static_cast<HostEvent*>(event);
}

// cudaEventRecord: 0, or cudaErrorInvalidResourceHandle for a stream it does not know.
__attribute__((visibility("default"))) int host_events_record(void* event, void* stream,
                                                              int current) {
  int device = 0;
  const tidepool::Stream s = resolve(stream, current, device);
  if (device < 0) return 400;
  auto signal = std::make_shared<Signal>();
  static_cast<HostEvent*>(event)->latest = signal;
  backend_of(device).launch_host_func(
      s,
      [](void* arg) {
        std::unique_ptr<std::shared_ptr<Signal>> own(static_cast<std::shared_ptr<Signal>*>(arg));
        (*own)->set();
      },
      new std::shared_ptr<Signal>(std::move(signal)));
  return 0;
}

// cudaStreamWaitEvent.
__attribute__((visibility("default"))) int host_streams_wait_event(void* stream, void* event,
                                                                   int current) {
  return enqueue_wait(stream, current, static_cast<HostEvent*>(event)->latest);
}

__attribute__((visibility("default"))) int host_streams_hold(void* stream, int current) {
  return enqueue_wait(stream, current, g_gate);
}

__attribute__((visibility("default"))) void host_streams_open() { g_gate->set(); }

// 0, or cudaErrorInvalidResourceHandle for a stream it does not know.
__attribute__((visibility("default"))) int host_streams_fail(void* stream, int current) {
  int device = 0;
  const tidepool::Stream s = resolve(stream, current, device);
  if (device < 0) return 400;
  backend_of(device).launch_host_func(
      s, [](void*) { throw std::runtime_error("injected failure (host_streams_fail)"); },
      nullptr);
  return 0;
}

// cudaEventQuery: 0 once the latest record has completed (or for an event never
// recorded), else cudaErrorNotReady.
__attribute__((visibility("default"))) int host_events_query(void* event) {
  const std::shared_ptr<Signal>& latest = static_cast<HostEvent*>(event)->latest;
  return latest == nullptr || latest->is_set() ? 0 : 600;
}

// cudaStreamSynchronize: 0, cudaErrorInvalidResourceHandle for a stream it does not know,
// or cudaErrorLaunchFailure when work on it failed (host_streams_fail).
__attribute__((visibility("default"))) int host_streams_synchronize(void* stream, int current) {
  int device = 0;
  const tidepool::Stream s = resolve(stream, current, device);
  if (device < 0) return 400;
  try {
    backend_of(device).stream_synchronize(s);
  } catch (const tidepool::BackendError&) {
    return 719;
  }
  return 0;
}

// cudaDeviceSynchronize of `device`: every stream of its backend, held ones included.
__attribute__((visibility("default"))) void host_streams_synchronize_device(int device) {
  backend_of(device).device_synchronize();
}

// The next `count` mappings of memory on `device` fail with the CUDA error `code`.
__attribute__((visibility("default"))) void host_streams_fail_next_map(int device, int count,
                                                                       int code) {
  tidepool::device_allocator(device).backend().inject_fault(tidepool::FaultPoint::map, count,
                                                            code);
}

}  // extern "C"
