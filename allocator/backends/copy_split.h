// Where the cuda backend cuts a copy (Note [Copies across host-NUMA mappings] in
// cuda_backend.cpp): into pieces none of which crosses, on either side, an edge of one of
// the given mappings. Header-only and free of CUDA, so that it is tested on any machine
// (tests/allocator/gpu_test_backend.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <vector>

namespace tidepool::backend_detail {

// Mapped ranges, start -> bytes, none overlapping another.
using MappingMap = std::map<std::uintptr_t, std::size_t>;

// Adds to `cuts` the offsets in (0, bytes) at which [p, p + bytes) crosses an edge (start
// or end) of a mapping.
inline void add_mapping_edges(const MappingMap& mappings, std::uintptr_t p, std::size_t bytes,
                              std::vector<std::size_t>& cuts) {
  const std::uintptr_t end = p + bytes;
  auto it = mappings.upper_bound(p);
  if (it != mappings.begin()) it = std::prev(it);  // the mapping holding p, if any
  for (; it != mappings.end() && it->first < end; ++it) {
    for (const std::uintptr_t edge : {it->first, it->first + it->second}) {
      if (edge > p && edge < end) cuts.push_back(edge - p);
    }
  }
}

// The ends of the pieces a copy of `bytes` from `src` to `dst` is cut into, ascending and
// distinct, the last one `bytes`: within each piece, neither side crosses a mapping's edge.
inline std::vector<std::size_t> copy_piece_ends(const MappingMap& mappings, std::uintptr_t dst,
                                                std::uintptr_t src, std::size_t bytes) {
  std::vector<std::size_t> ends;
  add_mapping_edges(mappings, dst, bytes, ends);
  add_mapping_edges(mappings, src, bytes, ends);
  ends.push_back(bytes);
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
  return ends;
}

}  // namespace tidepool::backend_detail
