// JSON renderings of the tiering stats. A tiny writer is enough: the values are numbers,
// booleans and one free-text reason, written by the allocator's json_number and
// json_quoted (json_text.h), which read the same in every locale.
#include "tiering/stats_json.h"

#include "allocator/json_text.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {

namespace {

// Appends `"key": value` pairs, comma-separated, inside braces.
class JsonObject {
 public:
  JsonObject& num(const char* key, double v) { return raw(key, json_number(v)); }
  JsonObject& num(const char* key, unsigned long long v) { return raw(key, std::to_string(v)); }
  JsonObject& boolean(const char* key, bool v) { return raw(key, v ? "true" : "false"); }
  JsonObject& str(const char* key, const std::string& v) { return raw(key, json_quoted(v)); }
  JsonObject& raw(const char* key, const std::string& json) {
    body_ += body_.empty() ? "" : ",";
    body_ += "\"";
    body_ += key;
    body_ += "\":";
    body_ += json;
    return *this;
  }
  std::string done() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

using ull = unsigned long long;

std::string direction_json(const DirectionStats& d) {
  return JsonObject()
      .num("bytes", ull(d.bytes))
      .num("transfers", ull(d.transfers))
      .num("chunks", ull(d.chunks))
      .num("timed_bytes", ull(d.timed_bytes))
      .num("busy_ms", d.busy_ms)
      .num("gb_per_s", d.gb_per_s())
      .done();
}

}  // namespace

std::string to_json(const HostArenaStats& s) {
  return JsonObject()
      .num("pinned_budget_bytes", ull(s.pinned_budget_bytes))
      .num("pinned_budget_requested_bytes", ull(s.pinned_budget_requested_bytes))
      .boolean("budget_capped_by_memlock", s.budget_capped_by_memlock)
      .boolean("budget_from_config", s.budget_from_config)
      .boolean("budget_shared", s.budget_shared)
      .num("pinned_registered_bytes", ull(s.pinned_registered_bytes))
      .num("slab_count", ull(s.slab_count))
      .num("direct_count", ull(s.direct_count))
      .num("direct_after_no_arena", ull(s.direct_after_no_arena))
      .num("direct_budget_below_slab", ull(s.direct_budget_below_slab))
      .num("pinned_in_use_bytes", ull(s.pinned_in_use_bytes))
      .num("pinned_peak_bytes", ull(s.pinned_peak_bytes))
      .num("pinned_allocs", ull(s.pinned_allocs))
      .num("pageable_in_use_bytes", ull(s.pageable_in_use_bytes))
      .num("pageable_peak_bytes", ull(s.pageable_peak_bytes))
      .num("pageable_allocs", ull(s.pageable_allocs))
      .num("fallback_budget", ull(s.fallback_budget))
      .num("fallback_register_failed", ull(s.fallback_register_failed))
      .num("fallback_no_mimalloc", ull(s.fallback_no_mimalloc))
      .num("fallback_other", ull(s.fallback_other))
      .num("register_failures", ull(s.register_failures))
      .num("slabs_released", ull(s.slabs_released))
      .num("slab_release_failures", ull(s.slab_release_failures))
      .num("direct_release_failures", ull(s.direct_release_failures))
      .num("direct_held_after_failure_bytes", ull(s.direct_held_after_failure_bytes))
      .str("last_fallback_reason", s.last_fallback_reason)
      .boolean("fallback_warned", s.fallback_warned)
      .done();
}

std::string to_json(const CopyEngineStats& s) {
  return JsonObject()
      .raw("h2d", direction_json(s.h2d))
      .raw("d2h", direction_json(s.d2h))
      .num("exposed_wait_ms", s.exposed_wait_ms)
      .num("exposed_waits", ull(s.exposed_waits))
      .num("hidden_ms", s.hidden_ms())
      .done();
}

std::string to_json(const TieredStoreStats& s) {
  return JsonObject()
      .num("device_budget_bytes", ull(s.device_budget_bytes))
      .num("device_bytes", ull(s.device_bytes))
      .num("device_peak_bytes", ull(s.device_peak_bytes))
      .num("handles", ull(s.handles))
      .num("resident_handles", ull(s.resident_handles))
      .num("acquired_handles", ull(s.acquired_handles))
      .num("acquires", ull(s.acquires))
      .num("prefetch_issued", ull(s.prefetch_issued))
      .num("prefetch_hits", ull(s.prefetch_hits))
      .num("prefetch_late", ull(s.prefetch_late))
      .num("misses", ull(s.misses))
      .num("loads_skipped", ull(s.loads_skipped))
      .num("host_promotions", ull(s.host_promotions))
      .num("host_promoted_bytes", ull(s.host_promoted_bytes))
      .num("prefetch_skipped", ull(s.prefetch_skipped))
      .num("evictions", ull(s.evictions))
      .num("evictions_clean", ull(s.evictions_clean))
      .num("reclaim_calls", ull(s.reclaim_calls))
      .num("reclaimed_bytes", ull(s.reclaimed_bytes))
      .num("reclaim_failures", ull(s.reclaim_failures))
      .num("budget_waits", ull(s.budget_waits))
      .num("buffers_reused", ull(s.buffers_reused))
      .num("frees_stream_ordered", ull(s.frees_stream_ordered))
      .num("off_schedule_acquires", ull(s.off_schedule_acquires))
      .num("schedule_adoptions", ull(s.schedule_adoptions))
      .boolean("budget_shared", s.budget_shared)
      .num("peer_bytes", ull(s.peer_bytes))
      .num("peer_room_requests", ull(s.peer_room_requests))
      .num("peer_evictions", ull(s.peer_evictions))
      .num("peer_evicted_bytes", ull(s.peer_evicted_bytes))
      .raw("host", to_json(s.host))
      .raw("copy", to_json(s.copy))
      .done();
}

std::string to_json(const VmmStats& s) {
  return JsonObject()
      .num("ranges", ull(s.ranges))
      .num("device_backed_bytes", ull(s.device_backed_bytes))
      .num("host_backed_bytes", ull(s.host_backed_bytes))
      .num("migrations_to_host", ull(s.migrations_to_host))
      .num("migrations_to_device", ull(s.migrations_to_device))
      .num("bytes_to_host", ull(s.bytes_to_host))
      .num("bytes_to_device", ull(s.bytes_to_device))
      .num("migration_ms", s.migration_ms)
      .num("failed_migrations", ull(s.failed_migrations))
      .boolean("has_device_budget", s.has_device_budget)
      .num("device_budget_bytes", ull(s.device_budget_bytes))
      .num("budget_stops", ull(s.budget_stops))
      .num("bytes_left_on_host", ull(s.bytes_left_on_host))
      .boolean("budget_shared", s.budget_shared)
      .num("budget_peer_bytes", ull(s.budget_peer_bytes))
      .num("budget_room_requests", ull(s.budget_room_requests))
      .num("budget_room_given_bytes", ull(s.budget_room_given_bytes))
      .num("deferred_releases", ull(s.deferred_releases))
      .num("deferred_release_bytes", ull(s.deferred_release_bytes))
      .num("lost_stream_syncs", ull(s.lost_stream_syncs))
      .num("migration_batches", ull(s.migration_batches))
      .num("migration_backend_calls", ull(s.migration_backend_calls))
      .num("backings_created", ull(s.backings_created))
      .num("spare_host_reuses", ull(s.spare_host_reuses))
      .num("create_ms", s.create_ms)
      .num("create_wait_ms", s.create_wait_ms)
      .num("copy_wait_ms", s.copy_wait_ms)
      .num("remap_ms", s.remap_ms)
      .num("release_ms", s.release_ms)
      .num("spare_host_backings", ull(s.spare_host_backings))
      .num("spare_host_bytes", ull(s.spare_host_bytes))
      .boolean("pinned_budget_shared", s.pinned_budget_shared)
      .num("pinned_budget_bytes", ull(s.pinned_budget_bytes))
      .num("pinned_bytes", ull(s.pinned_bytes))
      .num("pinned_budget_stops", ull(s.pinned_budget_stops))
      .num("bytes_left_on_device", ull(s.bytes_left_on_device))
      .num("pinned_budget_refusals", ull(s.pinned_budget_refusals))
      .done();
}

}  // namespace tidepool
