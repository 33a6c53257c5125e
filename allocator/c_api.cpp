// The C ABI of allocator/c_api.h over the per-device caching allocators.
//
// Every entry point catches everything: a C++ exception must never unwind into PyTorch or
// a C caller. Failures return NULL / -1 and leave a message in a thread-local last-error
// string; misuse (bad pointer, double free, wrong size or device, bad tag calls) also
// prints one line on stderr, because a caller of tidepool_free (void) cannot see a status.
// Out-of-memory is reported only through the return value and the last error, except in
// tidepool_pytorch_malloc, which throws (Note [OOM into PyTorch] in c_api.h).
//
// tidepool_malloc / tidepool_free / tidepool_record_stream first offer the request to the
// tier route (tier_routing.h, Note [tier route]): tierable tags above the size threshold
// go to the tiering layer's pointer-stable ranges, the rest to the caching allocator.
#include "allocator/c_api.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "allocator/backend.h"
#include "allocator/c_api_guard.h"
#include "allocator/device_registry.h"
#include "allocator/errors.h"
#include "allocator/fork_guard.h"
#include "allocator/reclaim.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"

namespace {

// Note [A last-error slot that outlives thread exit]
// The calling thread's message for tidepool_last_error() lives on the heap, reached
// through a trivially destructible thread_local pointer, and is freed by a pthread key's
// destructor. A thread_local std::string is destroyed at thread exit in reverse order of
// first use, so a user's thread_local constructed earlier (a cache of tensors, a pool) was
// destroyed after it, and its destructor's tidepool_free (which the thread caches expect:
// Note [Thread caches] in thread_cache.cpp) wrote its error into a freed string. glibc
// runs every thread_local destructor before any pthread key destructor, so the message
// outlives them all. (Not a fixed buffer in TLS: libtidepool.so is dlopen()ed, and part
// of its TLS is initial-exec, so a large block no longer fits glibc's static TLS surplus.)
// A call made from another key's destructor after this one ran makes a new message, which
// glibc then frees in its next round of key destructors.
constinit thread_local std::string* t_last_error = nullptr;
// Whether t_last_error is an out-of-memory (an OutOfMemoryError, after the OOM policy).
constinit thread_local bool t_last_error_is_oom = false;
// The CUDA error code behind t_last_error (BackendError::cuda_error()), 0 when none.
constinit thread_local int t_last_error_cuda_code = 0;

pthread_key_t last_error_key() {
  static const pthread_key_t key = [] {
    pthread_key_t k;
    const int rc = pthread_key_create(&k, [](void* text) {
      delete static_cast<std::string*>(text);
      t_last_error = nullptr;
    });
    if (rc != 0) {
      std::fprintf(stderr, "tidepool: pthread_key_create failed (%d)\n", rc);
      std::abort();
    }
    return k;
  }();
  return key;
}
// Made when the library is loaded, not by the process's first error, which a fork in
// another thread could interrupt: the child would then wait for good, at its first error,
// on the one-time initialization's guard (as deeper_key in tags.cpp).
[[maybe_unused]] const pthread_key_t g_last_error_key_at_load = last_error_key();

// Replaces the calling thread's message; one that cannot be stored (no heap for it)
// leaves the message empty rather than the previous call's.
void store_last_error(std::string_view message) noexcept {
  try {
    if (t_last_error == nullptr) {
      auto text = std::make_unique<std::string>();
      if (pthread_setspecific(last_error_key(), text.get()) != 0) throw std::bad_alloc();
      t_last_error = text.release();
    }
    t_last_error->assign(message);
  } catch (...) {
    if (t_last_error != nullptr) t_last_error->clear();
  }
}

const char* last_error_text() noexcept {
  if (t_last_error != nullptr) return t_last_error->c_str();
  return "";
}

void set_error(const char* what, bool print) {
  store_last_error(what);
  t_last_error_is_oom = false;
  t_last_error_cuda_code = 0;
  if (print) std::fprintf(stderr, "%s\n", what);
}

// This ABI's errors: the message alone, misuse printed too (see the top of the file).
template <class R, class Fn>
R guarded(R failed, Fn&& fn) {
  return tidepool::detail::guarded(tidepool::detail::kAllocatorErrorStyle, failed,
                                   std::forward<Fn>(fn));
}

// The tag calls' errors: as guarded's, but they run in a forked child too (Note [Tags
// across fork] in tags.cpp).
template <class R, class Fn>
R guarded_tag_call(R failed, Fn&& fn) {
  constexpr tidepool::detail::CErrorStyle kTagCallStyle{nullptr, true, false};
  return tidepool::detail::guarded(kTagCallStyle, failed, std::forward<Fn>(fn));
}

// What tidepool_set_memory_fraction last set per device (the limit itself is the
// backend's, in bytes; PyTorch hands back the fraction as it was given).
std::atomic<double>& memory_fraction(int device) {
  struct Fractions {
    std::array<std::atomic<double>, tidepool::kMaxDevices> of;
    Fractions() {
      for (auto& f : of) f.store(1.0);
    }
  };
  static Fractions fractions;
  return fractions.of[static_cast<std::size_t>(device)];
}

// The device whose caching allocator owns `ptr`, or -1: for a free that the named device
// rejected, and for record_stream from PyTorch, which names no device.
int owning_device(const void* ptr) {
  for (int d = 0; d < tidepool::kMaxDevices; ++d)
    if (auto* a = tidepool::existing_device_allocator(d); a != nullptr && a->owns(ptr)) return d;
  return -1;
}

// The allocator of `device` for a call about a pointer on it (free, record_stream): only a
// device tidepool allocated on can own one, so a device it never used is not given an
// allocator (on CUDA, a context) for the question; the call fails as for any pointer the
// allocator does not hold, with `call` and the device named.
tidepool::CachingAllocator& allocator_holding_pointers_of(int device, const char* call) {
  tidepool::CachingAllocator* allocator = tidepool::checked_existing_allocator(device);
  if (allocator == nullptr) {
    throw tidepool::AllocatorUsageError(std::string("tidepool: ") + call +
                                        ": the pointer is not a live allocation of device " +
                                        std::to_string(device) +
                                        " (tidepool never allocated there); nothing changed");
  }
  return *allocator;
}

}  // namespace

void tidepool::set_last_error(std::string_view message) {
  store_last_error(message);
  t_last_error_is_oom = false;
  t_last_error_cuda_code = 0;
}

void tidepool::detail::record_current_exception(const CErrorStyle& style) noexcept {
  const auto record = [&](const char* what, bool misuse) {
    if (style.prefix == nullptr) {
      set_error(what, style.print && misuse);
    } else {
      set_error((std::string(style.prefix) + ": " + what).c_str(), style.print && misuse);
    }
  };
  try {
    try {
      throw;
    } catch (const OutOfMemoryError& e) {
      record(e.what(), false);
      t_last_error_is_oom = true;
    } catch (const std::bad_alloc&) {
      record("tidepool: out of host memory for bookkeeping", true);
    } catch (const BackendError& e) {
      record(e.what(), true);
      t_last_error_cuda_code = e.cuda_error();
    } catch (const std::exception& e) {
      record(e.what(), true);
    } catch (...) {
      record("tidepool: unknown error", true);
    }
  } catch (...) {
    // No memory even for the message: the failure value alone reaches the caller.
  }
}

char* tidepool::detail::malloc_c_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) throw std::bad_alloc();
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

namespace {

// A failed tidepool_malloc of `size` on `device` that was not out of memory, thrown as
// tidepool's message, for PyTorch's entry points (never to a C caller).
[[noreturn]] void throw_failed_request(ssize_t size, int device) {
  if (*last_error_text() != '\0') throw std::runtime_error(last_error_text());
  throw std::runtime_error("tidepool: allocation of " + std::to_string(size) +
                           " bytes failed on device " + std::to_string(device));
}

}  // namespace

extern "C" {

void* tidepool_malloc(ssize_t size, int device, void* stream) {
  if (size == 0) {
    // Not a failure: an earlier call's error must not be read as this NULL's reason.
    tidepool_clear_error();
    return nullptr;
  }
  return guarded<void*>(nullptr, [&]() -> void* {
    if (size < 0) {
      throw tidepool::AllocatorUsageError("tidepool: tidepool_malloc called with negative size " +
                                          std::to_string(size) + " on device " +
                                          std::to_string(device));
    }
    const auto bytes = static_cast<std::size_t>(size);
    // First: a device that does not exist is the caller's error, said as such (the tier
    // route took it for a failure of its own, and used up its one report); the route's
    // ranges are on the device's allocator's backend anyway.
    tidepool::CachingAllocator& allocator = tidepool::device_allocator(device);
    if (void* routed = tidepool::detail::route_allocate(bytes, device, stream)) return routed;
    return allocator.allocate(bytes, tidepool::Stream{stream});
  });
}

void tidepool_free(void* ptr, size_t size, int device, void* stream) {
  // Note [Forked child]: the parent's memory; nothing to give back here.
  if (ptr == nullptr || tidepool::in_forked_child()) return;
  guarded<int>(-1, [&] {
    if (tidepool::detail::route_free(ptr, size, device, /*always_ask=*/false)) return 0;
    try {
      allocator_holding_pointers_of(device, "free").deallocate(ptr, size,
                                                               tidepool::Stream{stream});
    } catch (const tidepool::AllocatorUsageError&) {
      if (tidepool::detail::route_free(ptr, size, device, /*always_ask=*/true)) return 0;
      const int owner = owning_device(ptr);
      if (owner < 0 || owner == device) throw;
      throw tidepool::AllocatorUsageError(
          "tidepool: free of a pointer on device " + std::to_string(device) +
          ", but it was allocated on device " + std::to_string(owner) +
          "; the block was not freed");
    }
    return 0;
  });
}

void* tidepool_pytorch_malloc(ssize_t size, int device, void* stream) {
  void* p = tidepool_malloc(size, device, stream);
  if (p == nullptr && size != 0) {  // Note [OOM into PyTorch]
    if (t_last_error_is_oom && size > 0)
      throw std::runtime_error(tidepool::pytorch_out_of_memory_message(
          static_cast<std::size_t>(size), last_error_text()));
    throw_failed_request(size, device);
  }
  return p;
}

void* tidepool_pytorch_pool_malloc(ssize_t size, int device, void* stream) {
  void* p = tidepool_malloc(size, device, stream);
  // Note [OOM into a MemPool]: NULL for running out only; any other failure throws.
  if (p == nullptr && size != 0 && !(t_last_error_is_oom && size > 0))
    throw_failed_request(size, device);
  return p;
}

void tidepool_pytorch_free(void* ptr, size_t size, int device, void* stream) {
  tidepool_free(ptr, size, device, stream);
}

int tidepool_record_stream(void* ptr, int device, void* stream) {
  return guarded(-1, [&] {
    if (tidepool::detail::route_record_stream(ptr, device, stream, /*always_ask=*/false)) return 0;
    try {
      allocator_holding_pointers_of(device, "record_stream")
          .record_stream(ptr, tidepool::Stream{stream});
    } catch (const tidepool::AllocatorUsageError&) {
      if (!tidepool::detail::route_record_stream(ptr, device, stream, /*always_ask=*/true)) throw;
    }
    return 0;
  });
}

int tidepool_pytorch_record_stream(void* ptr, void* stream) {
  // Note [record_stream from PyTorch]: PyTorch does not say the device; the owner does.
  if (ptr == nullptr) return 1;
  return guarded(-1, [&] {
    if (const int owner = owning_device(ptr); owner >= 0)
      return tidepool_record_stream(ptr, owner, stream);
    for (int d = 0; d < tidepool::kMaxDevices; ++d)  // a pointer-stable range
      if (tidepool::detail::route_record_stream(ptr, d, stream, /*always_ask=*/true)) return 0;
    return 1;
  });
}

int tidepool_empty_cache(int device) {
  return guarded(-1, [&] {
    // A device whose allocator was never made has no cache of it to empty; made here, it
    // would only cost that device a context (review finding). The index is checked all
    // the same, and the layers above may hold caches there (tidepool_empty_cache_all).
    tidepool::checked_existing_allocator(device);
    // The higher layers' caches first, with no allocator lock held (Note [Empty-cache
    // hooks] in reclaim.cpp): what they free through the allocator goes back below.
    tidepool::detail::run_empty_cache_hooks(device);
    if (auto* allocator = tidepool::existing_device_allocator(device)) allocator->empty_cache();
    return 0;
  });
}

int tidepool_cache_info(int device, size_t* largest_block) {
  if (largest_block == nullptr) {
    set_error("tidepool: tidepool_cache_info given a NULL largest_block", true);
    return -1;
  }
  return guarded(-1, [&] {
    tidepool::CachingAllocator& allocator = tidepool::device_allocator(device);
    tidepool::Backend& backend = allocator.backend();
    // As c10's allocator: free device memory (within this process's share, when a memory
    // fraction is set) is the optimistic first guess, a larger free cached block wins.
    const std::size_t limit = backend.device_limit();
    const std::size_t in_use = std::min(limit, backend.device_bytes_in_use());
    const std::size_t free_bytes = std::min(backend.mem_info().free_bytes, limit - in_use);
    *largest_block = std::max(free_bytes, allocator.largest_free_block());
    return 0;
  });
}

int tidepool_set_memory_fraction(double fraction, int device) {
  return guarded(-1, [&] {
    if (!(fraction >= 0.0 && fraction <= 1.0)) {  // NaN fails both
      throw tidepool::AllocatorUsageError("tidepool: memory fraction " + std::to_string(fraction) +
                                          " for device " + std::to_string(device) +
                                          " is outside [0, 1]");
    }
    tidepool::Backend& backend = tidepool::device_allocator(device).backend();
    const double total = static_cast<double>(backend.mem_info().total_bytes);
    backend.set_device_limit(fraction == 1.0 ? std::numeric_limits<std::size_t>::max()
                                             : static_cast<std::size_t>(fraction * total));
    memory_fraction(device).store(fraction);
    return 0;
  });
}

double tidepool_get_memory_fraction(int device) {
  return guarded(-1.0, [&] {
    tidepool::check_device(device);
    return memory_fraction(device).load();
  });
}

int tidepool_release_stream(int device, void* stream) {
  return guarded(-1, [&] {
    // The allocator first: it refuses a bad device, the NULL stream and a destroyed
    // stream before anything changed, and it waits for the stream's work. A device
    // tidepool never allocated on has nothing cached for any stream: its allocator (on
    // CUDA, a context on that device) is not created just to find that out.
    const tidepool::Stream s{stream};
    if (tidepool::CachingAllocator* allocator = tidepool::checked_existing_allocator(device)) {
      allocator->release_stream(s);
    } else {
      tidepool::CachingAllocator::require_releasable(device, s);
    }
    tidepool::detail::route_release_stream(device, stream);
    return 0;
  });
}

namespace {

// Whether `ptr` lies in one of the backed ranges of `device`'s allocator; false for an
// index with no allocator (none is created).
bool device_holds(int device, const void* ptr) {
  const tidepool::CachingAllocator* allocator = tidepool::existing_device_allocator(device);
  if (allocator == nullptr) return false;
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  for (const tidepool::MemoryRange& range : allocator->backed_ranges()) {
    if (range.address <= address && address - range.address < range.size) return true;
  }
  return false;
}

}  // namespace

int tidepool_holds_address(const void* ptr) {
  return guarded(-1, [&] {
    for (int d = 0; d < tidepool::kMaxDevices; ++d) {
      if (device_holds(d, ptr)) return 1;
    }
    return 0;
  });
}

int tidepool_device_holds_address(int device, const void* ptr) {
  return guarded(-1, [&] { return device_holds(device, ptr) ? 1 : 0; });
}

int tidepool_enable_peer_access(int device, int peer) {
  return guarded(-1, [&] {
    tidepool::enable_peer_access(device, peer);
    return 0;
  });
}

int tidepool_peer_access_enabled(int device, int peer) {
  return guarded(-1, [&] { return tidepool::peer_access_enabled(device, peer) ? 1 : 0; });
}

int tidepool_empty_cache_all(void) {
  return guarded(-1, [] {
    for (int d = 0; d < tidepool::kMaxDevices; ++d) {
      // Every index: a layer above may hold a cache on a device whose allocator was never
      // made (its objects over a backend of their own); the hooks create nothing.
      tidepool::detail::run_empty_cache_hooks(d);
      if (auto* a = tidepool::existing_device_allocator(d)) a->empty_cache();
    }
    return 0;
  });
}

int tidepool_flush_thread_caches(void) {
  return guarded(-1, [] {
    for (int d = 0; d < tidepool::kMaxDevices; ++d)
      if (auto* a = tidepool::existing_device_allocator(d)) a->flush_thread_caches();
    return 0;
  });
}

int tidepool_tag_id(const char* name) {
  if (name == nullptr) {
    set_error("tidepool: tidepool_tag_id(NULL)", true);
    return -1;
  }
  return guarded_tag_call(-1, [&] { return tidepool::tag_id(name); });
}

const char* tidepool_tag_name(int tag) { return tidepool::tag_name(tag); }

int tidepool_tag_push(int tag) {
  return guarded_tag_call(-1, [&] {
    tidepool::push_tag(tag);
    return 0;
  });
}

int tidepool_tag_pop(void) {
  return guarded_tag_call(-1, [&] {
    tidepool::pop_tag();
    return 0;
  });
}

int tidepool_tag_current(void) { return tidepool::current_tag(); }

int tidepool_get_stats_v1(int device, tidepool_stats_v1* out) {
  return guarded(-1, [&] {
    tidepool::detail::check_versioned_struct(out, offsetof(tidepool_stats_v1, device),
                                             "tidepool_stats_v1");
    // A device tidepool has not allocated on has no figures, and reading them creates no
    // allocator there (on CUDA, no context), as tidepool_get_pytorch_stats_v1.
    const tidepool::CachingAllocator* a = tidepool::checked_existing_allocator(device);
    const tidepool::AllocatorStats s = a != nullptr ? a->stats() : tidepool::AllocatorStats{};
    const tidepool::BackendKind kind =
        a != nullptr ? a->backend().kind() : tidepool::selected_backend();
    tidepool_stats_v1 full{};
    full.version = 1;
    full.device = device;
    full.backend = kind == tidepool::BackendKind::cuda ? 1 : 0;
    full.allocated = tidepool::detail::to_c_stat(s.allocated);
    full.reserved = tidepool::detail::to_c_stat(s.reserved);
    full.cached_bytes = s.cached_bytes;
    full.segments_acquired = s.segments.allocated;
    full.segments_released = s.segments.freed;
    full.alloc_count = s.allocations.allocated;
    full.free_count = s.allocations.freed;
    full.cache_hits = s.cache_hits;
    full.cache_misses = s.cache_misses;
    full.oom_count = s.oom_count;
    full.reclaim_calls = s.reclaim_calls;
    full.reclaimed_bytes = s.reclaimed_bytes;
    full.fragmentation = s.fragmentation;
    for (int t = 0; t < TIDEPOOL_TAG_MAX; ++t) {
      full.tags[t].bytes = tidepool::detail::to_c_stat(s.tags[t].bytes);
      full.tags[t].count = s.tags[t].count;
      full.tags[t].total_count = s.tags[t].total_count;
    }
    full.requested = tidepool::detail::to_c_stat(s.requested);
    full.cross_stream_reuses = s.cross_stream_reuses;
    full.allocations = tidepool::detail::to_c_stat(s.allocations);
    full.segments = tidepool::detail::to_c_stat(s.segments);
    full.largest_free_block = s.largest_free_block;
    for (int t = 0; t < TIDEPOOL_TAG_MAX; ++t) {
      full.tag_cache[t].cached_bytes = s.tags[t].cached_bytes;
      full.tag_cache[t].largest_free_block = s.tags[t].largest_free_block;
      full.tag_cache[t].fragmentation = s.tags[t].fragmentation;
    }
    tidepool::detail::copy_versioned_struct(out, full);
    return 0;
  });
}

int tidepool_reset_peak_stats(int device) {
  return guarded(-1, [&] {
    // A device tidepool never allocated on has no peaks: nothing is created there.
    if (tidepool::CachingAllocator* a = tidepool::checked_existing_allocator(device))
      a->reset_peak_stats();
    return 0;
  });
}

char* tidepool_snapshot_json(int device) {
  return guarded<char*>(nullptr, [&] {
    // A device tidepool has not allocated on gets an empty snapshot, and no allocator is
    // created for it (on CUDA, no context), as tidepool_get_stats_v1.
    const tidepool::CachingAllocator* a = tidepool::checked_existing_allocator(device);
    return tidepool::detail::malloc_c_string(
        a != nullptr ? a->snapshot_json()
                     : tidepool::snapshot_json_of_unused_device(device,
                                                                tidepool::selected_backend()));
  });
}

void tidepool_string_free(char* s) { std::free(s); }

const char* tidepool_last_error(void) { return last_error_text(); }

void tidepool_clear_error(void) {
  if (t_last_error != nullptr) t_last_error->clear();
  t_last_error_is_oom = false;
  t_last_error_cuda_code = 0;
}

int tidepool_last_error_is_out_of_memory(void) { return t_last_error_is_oom ? 1 : 0; }

int tidepool_last_error_cuda_code(void) { return t_last_error_cuda_code; }

int tidepool_in_forked_child(void) { return tidepool::in_forked_child() ? 1 : 0; }

int tidepool_set_backend(const char* name) {
  if (name == nullptr) {
    set_error("tidepool: tidepool_set_backend(NULL)", true);
    return -1;
  }
  return guarded(-1, [&] {
    tidepool::set_backend(name);
    return 0;
  });
}

const char* tidepool_backend_name(int device) {
  return guarded<const char*>(nullptr, [&]() -> const char* {
    // An index outside 0..kMaxDevices-1 is an error, as everywhere in this ABI (not one
    // beyond the device count: the host backend's tests name devices a GPU machine lacks).
    tidepool::check_device_index(device);
    if (auto* a = tidepool::existing_device_allocator(device)) return a->backend().name();
    return tidepool::selected_backend() == tidepool::BackendKind::cuda ? "cuda" : "host";
  });
}

}  // extern "C"
