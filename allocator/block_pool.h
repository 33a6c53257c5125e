// BlockPool: the free blocks of one (stream, small|large) pool, ordered by (size,
// address) so best fit is one lower_bound, and the per-stream state that owns two of them.
// Internal to the allocator. Not thread-safe: the allocator's mutex guards it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "allocator/block.h"
#include "allocator/size_classes.h"

namespace tidepool::detail {

// Note [Blocks carry their pool node]
// A std::set allocates a node on insert, so putting a block back into a pool could fail
// for want of heap, and a free or the undoing of a failed allocation then lost the block
// (free, counted as cached, in no pool: no allocation ever found it again). So a block
// owns its node for life: erase moves the node out of the set into Block::pool_node,
// insert moves it back, and neither allocates. A block is given its node where it is made
// (make_node: carve_tail, or append_block's first insert, both of which may still fail
// before changing anything); a block merged away takes its node to the spare blocks.
// Every block handed out holds one, so no free and no failure path needs the heap here.
class BlockPool {
 public:
  using Set = FreeBlockSet;

  // A node for `b`, outside any pool (may throw std::bad_alloc).
  static Set::node_type make_node(Block* b) {
    Set scratch;
    scratch.insert(b);
    return scratch.extract(scratch.begin());
  }
  // Into the pool through the block's own node (allocates only if it has none).
  void insert(Block* b) {
    if (b->pool_node.empty()) {
      free_.insert(b);
      return;
    }
    b->pool_node.value() = b;
    free_.insert(std::move(b->pool_node));
  }
  // Out of the pool, the node kept by the block. A block not in the pool keeps its own.
  void erase(Block* b) {
    if (auto node = free_.extract(b); !node.empty()) b->pool_node = std::move(node);
  }
  bool empty() const { return free_.empty(); }
  const Set& blocks() const { return free_; }
  // Smallest free block of at least `size` bytes (lowest address among equals), or null.
  Block* best_fit(std::size_t size) const {
    auto it = free_.lower_bound(BySizeThenAddress::Key{size, nullptr});
    return it == free_.end() ? nullptr : *it;
  }
  Set::const_iterator lower_bound(std::size_t size) const {
    return free_.lower_bound(BySizeThenAddress::Key{size, nullptr});
  }
  // Best fit among blocks whose free_seq <= max_seq (blocks a cross-stream fence covers).
  Block* best_fit_freed_before(std::size_t size, std::uint64_t max_seq) const {
    for (auto it = free_.lower_bound(BySizeThenAddress::Key{size, nullptr}); it != free_.end();
         ++it)
      if ((*it)->free_seq <= max_seq) return *it;
    return nullptr;
  }

 private:
  Set free_;
};

// Exact-size LIFO lists of freed small blocks, kept uncoalesced so a cached alloc+free
// pair costs two list operations instead of a split and a merge (Note [Quick lists]).
class QuickLists {
 public:
  static constexpr std::uint8_t kPerClass = 8;

  bool push(Block* b) {
    const std::size_t c = small_class(b->size);
    if (count_[c] >= kPerClass) return false;
    b->quick_next = head_[c];
    head_[c] = b;
    ++count_[c];
    ++total_;
    return true;
  }
  Block* pop(std::size_t rounded) {
    const std::size_t c = small_class(rounded);
    Block* b = head_[c];
    if (b == nullptr) return nullptr;
    head_[c] = b->quick_next;
    b->quick_next = nullptr;
    --count_[c];
    --total_;
    return b;
  }
  bool empty() const { return total_ == 0; }
  // Empties every list, calling fn(block) for each block.
  template <class Fn>
  void drain(Fn&& fn) {
    if (total_ == 0) return;
    for (std::size_t c = 0; c < kSmallClasses; ++c) {
      while (Block* b = head_[c]) {
        head_[c] = b->quick_next;
        b->quick_next = nullptr;
        fn(b);
      }
      count_[c] = 0;
    }
    total_ = 0;
  }

 private:
  std::array<Block*, kSmallClasses> head_{};
  std::array<std::uint8_t, kSmallClasses> count_{};
  std::size_t total_ = 0;
};

// Everything the allocator keeps per stream.
struct StreamPools {
  Stream stream;
  BlockPool small;
  BlockPool large;
  QuickLists quick;
  // Expandable ranges this stream grows (the last one is grown first).
  std::vector<Segment*> small_ranges;
  std::vector<Segment*> large_ranges;
  // Cross-stream fence (Note [Cross-stream reuse]).
  std::uint64_t free_seq = 0;   // incremented on every free into this stream's pools
  std::uint64_t safe_seq = 0;   // blocks with free_seq <= safe_seq are safe for others
  std::uint64_t fence_seq = 0;  // free_seq covered by the fence in flight
  Event fence;                  // recorded on `stream`, created on first use
  bool fence_in_flight = false;

  BlockPool& pool(bool is_small_pool) { return is_small_pool ? small : large; }
};

}  // namespace tidepool::detail
