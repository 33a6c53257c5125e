// Size classes of the caching allocator: how a request is rounded and which pool serves
// it. Kept in one place so the allocator, the replay tool and the tests agree.
//
// Requests are rounded up to kMinBlockSize (512 B) so every block starts 512-aligned
// inside a segment (segments are at least 256-aligned, so blocks are too). Requests up
// to kSmallMax (1 MiB) come from the small pool, whose segments are kSmallSegment
// (2 MiB); larger ones from the large pool. Keeping small blocks apart stops them from
// pinning the middle of large free ranges, the main source of fragmentation.
#pragma once

#include <cstddef>

namespace tidepool {

inline constexpr std::size_t kMinBlockSize = 512;
inline constexpr std::size_t kSmallMax = std::size_t{1} << 20;
inline constexpr std::size_t kSmallSegment = std::size_t{2} << 20;
// Plain (non-expandable) large segments: requests up to kMidMax share a kMidSegment
// segment; larger requests get a segment rounded up to kLargeRound.
inline constexpr std::size_t kMidMax = std::size_t{10} << 20;
inline constexpr std::size_t kMidSegment = std::size_t{20} << 20;
inline constexpr std::size_t kLargeRound = std::size_t{2} << 20;
// Anything above this is a caller bug (a negative size cast to size_t, garbage), not a
// real request: it is rejected as invalid rather than reported as out-of-memory.
inline constexpr std::size_t kMaxRequest = std::size_t{1} << 50;
// Number of exact small size classes (class i holds blocks of i * kMinBlockSize bytes).
inline constexpr std::size_t kSmallClasses = kSmallMax / kMinBlockSize + 1;

constexpr std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Pre: 0 < bytes <= kMaxRequest.
constexpr std::size_t round_request(std::size_t bytes) { return round_up(bytes, kMinBlockSize); }
constexpr bool is_small(std::size_t rounded) { return rounded <= kSmallMax; }
constexpr std::size_t small_class(std::size_t rounded) { return rounded / kMinBlockSize; }

// Size of a plain segment for a rounded request.
constexpr std::size_t plain_segment_size(std::size_t rounded) {
  if (is_small(rounded)) return kSmallSegment;
  if (rounded <= kMidMax) return kMidSegment;
  return round_up(rounded, kLargeRound);
}

}  // namespace tidepool
