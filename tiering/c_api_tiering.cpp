// The tiering C ABI (c_api_tiering.h): thin wrappers over the device's VmmPool and
// tiered stores (tiering_registry.h) that turn exceptions into status codes and a
// thread-local message.
#include "tiering/c_api_tiering.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "tiering/stats_json.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace {

thread_local std::string t_last_error;

// Runs `fn`, mapping exceptions to `on_error` and the thread's last error message.
template <typename Fn, typename R>
R guarded(const char* what, R on_error, Fn&& fn) {
  try {
    t_last_error.clear();
    return fn();
  } catch (const std::exception& e) {
    t_last_error = std::string(what) + ": " + e.what();
  } catch (...) {
    t_last_error = std::string(what) + ": unknown error";
  }
  return on_error;
}

tidepool::Stream as_stream(void* s) { return tidepool::Stream{s}; }

}  // namespace

using tidepool::MemoryLocation;
using tidepool::TieredStore;

extern "C" {

void* tidepool_vmm_malloc(size_t size, int device, int tag, void* /*stream*/) {
  return guarded("tidepool_vmm_malloc", static_cast<void*>(nullptr), [&]() -> void* {
    void* p = tidepool::tiering_vmm_pool(device).allocate(size, tag, MemoryLocation::device);
    if (p == nullptr) {
      t_last_error = "tidepool_vmm_malloc: device " + std::to_string(device) +
                     " is out of memory for " + std::to_string(size) + " bytes";
    }
    return p;
  });
}

int tidepool_vmm_free(void* ptr, int device) {
  return guarded("tidepool_vmm_free", -1, [&] {
    if (ptr != nullptr) tidepool::tiering_vmm_pool(device).deallocate(ptr);
    return 0;
  });
}

int tidepool_vmm_record_stream(void* ptr, int device, void* stream) {
  return guarded("tidepool_vmm_record_stream", -1, [&] {
    tidepool::tiering_vmm_pool(device).record_use(ptr, as_stream(stream));
    return 0;
  });
}

int tidepool_vmm_owns(const void* ptr, int device) {
  return guarded("tidepool_vmm_owns", 0,
                 [&] { return tidepool::tiering_vmm_pool(device).owns(ptr) ? 1 : 0; });
}

int tidepool_evict_tag(int device, int tag) {
  return guarded("tidepool_evict_tag", -1, [&] {
    tidepool::tiering_vmm_pool(device).migrate_tag(tag, MemoryLocation::host);
    tidepool::for_each_tiered_store(device, [&](TieredStore& s) { s.evict_tag(tag); });
    return 0;
  });
}

int tidepool_prefetch_tag(int device, int tag, void* stream) {
  return guarded("tidepool_prefetch_tag", -1, [&] {
    tidepool::tiering_vmm_pool(device).migrate_tag(tag, MemoryLocation::device);
    tidepool::for_each_tiered_store(device,
                                    [&](TieredStore& s) { s.prefetch_tag(tag, as_stream(stream)); });
    return 0;
  });
}

int tidepool_evict_ptr(int device, void* ptr) {
  return guarded("tidepool_evict_ptr", -1, [&] {
    tidepool::tiering_vmm_pool(device).migrate(ptr, MemoryLocation::host);
    return 0;
  });
}

int tidepool_prefetch_ptr(int device, void* ptr, void* /*stream*/) {
  return guarded("tidepool_prefetch_ptr", -1, [&] {
    tidepool::tiering_vmm_pool(device).migrate(ptr, MemoryLocation::device);
    return 0;
  });
}

int tidepool_get_tiering_stats_v1(int device, tidepool_tiering_stats_v1* out) {
  return guarded("tidepool_get_tiering_stats_v1", -1, [&] {
    if (out == nullptr || out->struct_size < sizeof(tidepool_tiering_stats_v1)) {
      throw tidepool::TieringError("out is NULL or out->struct_size is too small");
    }
    const uint32_t size = out->struct_size;
    std::memset(out, 0, sizeof *out);
    out->struct_size = size;
    out->version = 1;
    out->device = device;
    tidepool::for_each_tiered_store(device, [&](TieredStore& store) {
      const tidepool::TieredStoreStats s = store.stats();
      out->stores++;
      out->h2d_bytes += s.copy.h2d.bytes;
      out->d2h_bytes += s.copy.d2h.bytes;
      out->h2d_busy_ms += s.copy.h2d.busy_ms;
      out->d2h_busy_ms += s.copy.d2h.busy_ms;
      out->exposed_wait_ms += s.copy.exposed_wait_ms;
      out->hidden_ms += s.copy.hidden_ms();
      out->device_bytes += s.device_bytes;
      out->device_budget_bytes += s.device_budget_bytes;
      out->acquires += s.acquires;
      out->prefetch_issued += s.prefetch_issued;
      out->prefetch_hits += s.prefetch_hits;
      out->prefetch_late += s.prefetch_late;
      out->misses += s.misses;
      out->prefetch_skipped += s.prefetch_skipped;
      out->evictions += s.evictions;
      out->evictions_clean += s.evictions_clean;
      out->reclaim_calls += s.reclaim_calls;
      out->reclaimed_bytes += s.reclaimed_bytes;
      out->pinned_host_bytes += s.host.pinned_in_use_bytes;
      out->pageable_host_bytes += s.host.pageable_in_use_bytes;
      out->pageable_fallbacks += s.host.pageable_allocs;
    });
    if (out->h2d_busy_ms > 0) out->h2d_gb_per_s = double(out->h2d_bytes) / (out->h2d_busy_ms * 1e6);
    if (out->d2h_busy_ms > 0) out->d2h_gb_per_s = double(out->d2h_bytes) / (out->d2h_busy_ms * 1e6);
    const tidepool::VmmStats v = tidepool::tiering_vmm_pool(device).stats();
    out->vmm_ranges = v.ranges;
    out->vmm_device_bytes = v.device_backed_bytes;
    out->vmm_host_bytes = v.host_backed_bytes;
    out->vmm_bytes_to_host = v.bytes_to_host;
    out->vmm_bytes_to_device = v.bytes_to_device;
    out->vmm_failed_migrations = v.failed_migrations;
    out->vmm_migration_ms = v.migration_ms;
    return 0;
  });
}

char* tidepool_tiering_snapshot_json(int device) {
  return guarded("tidepool_tiering_snapshot_json", static_cast<char*>(nullptr), [&]() -> char* {
    std::string json = "{\"device\":" + std::to_string(device) + ",\"stores\":[";
    bool first = true;
    tidepool::for_each_tiered_store(device, [&](TieredStore& s) {
      json += first ? "" : ",";
      json += s.stats_json();
      first = false;
    });
    json += "],\"vmm\":" + tidepool::to_json(tidepool::tiering_vmm_pool(device).stats()) + "}";
    char* out = static_cast<char*>(std::malloc(json.size() + 1));
    if (out == nullptr) throw std::bad_alloc();
    std::memcpy(out, json.c_str(), json.size() + 1);
    return out;
  });
}

const char* tidepool_tiering_last_error(void) { return t_last_error.c_str(); }

}  // extern "C"
