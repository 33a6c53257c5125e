// Allocator statistics: one `Stat` per counter (current, peak, total added, total
// removed, as c10 and mimalloc keep them), totals and a per-tag breakdown. The C ABI's
// tidepool_stats_v1 is filled from this struct.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "allocator/export.h"
#include "allocator/tags.h"

namespace tidepool {

struct Stat {
  std::uint64_t current = 0;
  std::uint64_t peak = 0;
  std::uint64_t allocated = 0;  // total ever added
  std::uint64_t freed = 0;      // total ever removed

  void add(std::uint64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void sub(std::uint64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
};

struct TagStats {
  Stat bytes;                    // live bytes (rounded block sizes) under this tag
  std::uint64_t count = 0;       // live allocations
  std::uint64_t total_count = 0; // allocations ever made
  // Cached memory kept under this tag (Note [Cached memory by tag], snapshot.cpp): free
  // backed bytes whose last use was this tag's; the tags' figures add up to cached_bytes.
  std::uint64_t cached_bytes = 0;
  std::uint64_t largest_free_block = 0;  // largest free contiguous range among them
  double fragmentation = 0;  // 1 - largest_free_block / cached_bytes; 0 when none cached
};

struct AllocatorStats {
  Stat allocated;  // bytes in live blocks (rounded sizes)
  Stat requested;  // bytes live callers asked for (unrounded)
  Stat reserved;   // bytes backed by the backend (plain segments + mapped granules)
  std::uint64_t cached_bytes = 0;  // reserved - allocated
  // Counts, not bytes. allocations: live blocks handed out (allocated = allocations ever
  // made, freed = ever freed). segments: live backend allocations (device_alloc /
  // create_physical; allocated = acquired from the backend, freed = given back).
  Stat allocations;
  Stat segments;
  std::uint64_t cache_hits = 0;    // served without asking the backend for memory
  std::uint64_t cache_misses = 0;  // needed new backend memory
  std::uint64_t oom_count = 0;     // OutOfMemoryError thrown
  std::uint64_t reclaim_calls = 0; // reclaim hook invocations
  std::uint64_t reclaimed_bytes = 0;
  std::uint64_t cross_stream_reuses = 0;  // blocks handed from one stream to another
  // Frees that synchronized the device because recording an event on a stream that used
  // the block failed (a record_stream stream destroyed without release_stream).
  std::uint64_t free_device_syncs = 0;
  // Largest free contiguous backed range (what one request could get without new memory).
  std::uint64_t largest_free_block = 0;
  // 1 - (largest_free_block / cached bytes); 0 when nothing is cached.
  double fragmentation = 0;
  std::array<TagStats, kTagCount> tags{};
};

// "1.50 GiB": human-readable bytes for messages and reports.
TIDEPOOL_API std::string format_bytes(std::uint64_t bytes);

}  // namespace tidepool
