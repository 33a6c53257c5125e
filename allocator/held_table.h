// HeldTable: the set of blocks one thread cache holds, by address (Note [Thread caches]
// in thread_cache.cpp). Internal to the allocator (not installed); not thread-safe: the
// owning cache's mutex guards it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "allocator/block.h"

namespace tidepool::detail {

// The blocks one thread cache holds, by address: an open-addressing table (linear
// probing, power-of-two size, backward-shift deletion, at most half full), because the
// fast free path looks a pointer up on every call and std::unordered_map's prime-modulo
// hashing cost more than the rest of the free (perf, Mixed64Live).
class HeldTable {
 public:
  static constexpr std::size_t kMax = 1024;  // blocks held at most
  std::size_t size() const { return size_; }
  Block* find(const void* p) const {
    if (size_ == 0) return nullptr;
    for (std::size_t i = home(p);; i = (i + 1) & kMask) {
      Block* b = slots_[i];
      if (b == nullptr || b->ptr == p) return b;
    }
  }
  // Pre: b->ptr is not in the table. False when the table is full.
  bool insert(Block* b) {
    if (size_ >= kMax) return false;
    if (!slots_) slots_ = std::make_unique<Block*[]>(kSlots);
    std::size_t i = home(b->ptr);
    while (slots_[i] != nullptr) i = (i + 1) & kMask;
    slots_[i] = b;
    ++size_;
    return true;
  }
  void erase(const void* p) {
    if (size_ == 0) return;
    std::size_t hole = home(p);
    while (slots_[hole] != nullptr && slots_[hole]->ptr != p) hole = (hole + 1) & kMask;
    if (slots_[hole] == nullptr) return;
    // Shift later entries of the probe run back over the hole when their home allows.
    for (std::size_t j = (hole + 1) & kMask; slots_[j] != nullptr; j = (j + 1) & kMask) {
      const std::size_t h = home(slots_[j]->ptr);
      const bool movable = hole <= j ? (h <= hole || h > j) : (h <= hole && h > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = nullptr;
    --size_;
  }
  template <class Fn>
  void for_each(Fn&& fn) const {
    if (size_ == 0) return;
    for (std::size_t i = 0; i < kSlots; ++i)
      if (slots_[i] != nullptr) fn(slots_[i]);
  }
  void clear() {
    if (slots_) std::fill(slots_.get(), slots_.get() + kSlots, nullptr);
    size_ = 0;
  }

 private:
  static constexpr int kLog2Slots = 11;
  static constexpr std::size_t kSlots = std::size_t{1} << kLog2Slots;
  static constexpr std::size_t kMask = kSlots - 1;
  static_assert(kSlots >= 2 * kMax, "at most half full");
  // Blocks are 512-aligned: drop those bits, then Fibonacci hashing.
  static std::size_t home(const void* p) {
    const std::uint64_t x = (reinterpret_cast<std::uintptr_t>(p) >> 9) * 0x9E3779B97F4A7C15ull;
    return static_cast<std::size_t>(x >> (64 - kLog2Slots));
  }
  std::unique_ptr<Block*[]> slots_;  // allocated on first insert
  std::size_t size_ = 0;
};

}  // namespace tidepool::detail
