// BlockPool: the free blocks of one (stream, small|large) pool, ordered by (size,
// address) so best fit is one lower_bound, and the per-stream state that owns two of them.
// Internal to the allocator. Not thread-safe: the allocator's mutex guards it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "allocator/block.h"
#include "allocator/size_classes.h"

namespace tidepool::detail {

struct BySizeThenAddress {
  using is_transparent = void;
  struct Key {
    std::size_t size;
    const char* ptr;
  };
  static Key key(const Block* b) { return {b->size, b->ptr}; }
  static bool less(Key a, Key b) { return a.size != b.size ? a.size < b.size : a.ptr < b.ptr; }
  bool operator()(const Block* a, const Block* b) const { return less(key(a), key(b)); }
  bool operator()(const Block* a, Key b) const { return less(key(a), b); }
  bool operator()(Key a, const Block* b) const { return less(a, key(b)); }
};

class BlockPool {
 public:
  using Set = std::set<Block*, BySizeThenAddress>;

  void insert(Block* b) { free_.insert(b); }
  void erase(Block* b) { free_.erase(b); }
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
