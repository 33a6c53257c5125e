// Blocks and segments: the bookkeeping the caching allocator keeps about device memory.
// Internal to the allocator (not installed).
//
// A Segment is one contiguous address range from the backend: either a plain segment
// (one device_alloc, fully backed) or an expandable range (reserve_address, backed slot
// by slot by create_physical + map on demand, or by moving a free slot's handle; see
// Notes [Expandable segments] and [Moving free runs] in segments.cpp). A segment is cut into Blocks
// that tile [base, used_end) in address order (prev/next); each block is allocated, free (in its
// owner's BlockPool), quick (freed, parked uncoalesced in an exact-size quick list), or pending
// (freed, but waiting for events recorded on other streams). A block held by a thread cache (Note
// [Thread caches], thread_cache.cpp) stays `allocated` here while its thread parks and
// reuses it; Block::in_thread_cache says which.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "allocator/backend.h"

namespace tidepool::detail {

struct StreamPools;
struct Segment;
struct ThreadCache;

enum class BlockState : std::uint8_t { allocated, free, quick, pending };

struct Block;

// The order of a BlockPool's free blocks: by size, then address, so best fit is one
// lower_bound. Here, not in block_pool.h, because a Block carries a node of that set.
struct BySizeThenAddress {
  using is_transparent = void;
  struct Key {
    std::size_t size;
    const char* ptr;
  };
  static Key key(const Block* b);
  static bool less(Key a, Key b) { return a.size != b.size ? a.size < b.size : a.ptr < b.ptr; }
  bool operator()(const Block* a, const Block* b) const { return less(key(a), key(b)); }
  bool operator()(const Block* a, Key b) const { return less(key(a), b); }
  bool operator()(Key a, const Block* b) const { return less(a, key(b)); }
};
using FreeBlockSet = std::set<Block*, BySizeThenAddress>;

struct Block {
  char* ptr = nullptr;
  std::size_t size = 0;       // rounded, a multiple of kMinBlockSize
  std::size_t requested = 0;  // what the caller asked for (allocated blocks)
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address neighbours inside the segment
  Block* next = nullptr;
  StreamPools* owner = nullptr;  // stream whose pool holds (or last held) the block
  BlockState state = BlockState::free;
  std::uint8_t tag = 0;
  // Value of owner->free_seq when the block was freed: the cross-stream fence covers it
  // once the fence's sequence number reaches it (Note [Cross-stream reuse]).
  std::uint64_t free_seq = 0;
  Block* quick_next = nullptr;        // quick-list link
  std::vector<Stream> extra_streams;  // record_stream() streams besides the owner
  std::vector<Event> pending_events;  // recorded at free on extra_streams
  // Non-null while a thread cache is responsible for the block (Note [Thread caches]):
  // the block is `allocated` to the shared state, and the holder's mutex guards
  // requested, tag, extra_streams, quick_next and in_thread_cache.
  ThreadCache* holder = nullptr;
  bool in_thread_cache = false;  // freed by its holder's thread, parked in its lists
  // Note [Blocks carry their pool node] (block_pool.h): the node that holds the block in
  // its pool's set, kept here while it is out of the pool; empty while it is in it.
  FreeBlockSet::node_type pool_node;
};

inline BySizeThenAddress::Key BySizeThenAddress::key(const Block* b) { return {b->size, b->ptr}; }

struct Segment {
  char* base = nullptr;
  std::size_t size = 0;  // bytes of address space (plain: all backed)
  bool expandable = false;
  bool small = false;            // small-pool segment
  StreamPools* creator = nullptr; // stream that created it (expandable: whose range grows)
  Block* first = nullptr;
  Block* last = nullptr;
  char* used_end = nullptr;      // end of the tiled part ([base, used_end) has blocks)
  // The tag of the request the backed memory past used_end was backed for (Note [Cached
  // memory by tag], snapshot.cpp): on a range, the rest of its last mapping slot; on a
  // plain segment, the whole of one whose block could not be made.
  std::uint8_t tail_tag = 0;
  std::size_t mapped_bytes = 0;  // expandable: bytes backed now; plain: size
  // Expandable only: granules per mapping slot. The range is backed slot by slot, each
  // slot by one physical handle of the slot's size, so any free slot's handle can back
  // any unmapped slot of the same length (Note [Moving free runs] in segments.cpp). Near
  // the device's capacity a slot may be backed by shorter runs instead; those never move.
  std::size_t slot_granules = 1;
  // Expandable only, one entry per granule: index of the first granule of the mapping run
  // that backs it, or -1 when unmapped. Run heads also hold the run's handle and length.
  std::vector<std::int32_t> run_head;
  std::vector<PhysicalHandle> run_handle;
  std::vector<std::uint32_t> run_granules;
  // Expandable only, one entry per slot: how many of its granules are mapped. Whether a
  // slot is fully backed, empty or in between is asked on every allocation (choose_fit,
  // back_block); the count answers without a walk over the slot's granules.
  std::vector<std::uint32_t> slot_mapped;
  // Expandable only: the head granule of every mapping run, in address order, so scans
  // for free runs visit the runs instead of every granule of the (device-sized) range.
  std::set<std::uint32_t> mapped_runs;
};

}  // namespace tidepool::detail
