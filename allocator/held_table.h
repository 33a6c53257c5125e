// HeldTable: the set of blocks one thread cache holds, by address (Note [Thread caches]
// in thread_cache.cpp). Internal to the allocator (not installed); not thread-safe: the
// owning cache's mutex guards it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>

#include "allocator/block.h"

namespace tidepool::detail {

// The blocks one thread cache holds, by address: an open-addressing table (linear
// probing, power-of-two size, backward-shift deletion, at most half full), because the
// fast free path looks a pointer up on every call and std::unordered_map's prime-modulo
// hashing cost more than the rest of the free (perf, Mixed64Live). Each slot keeps the
// block's address next to the block: probing compares addresses without loading the
// Block, which cost a cache miss per probe (perf, Mixed64Live: a third of the free). The
// count is atomic so that the owning thread may read it without the mutex
// (ThreadCache::holds_any).
class HeldTable {
 public:
  static constexpr std::size_t kMax = 1024;  // blocks held at most
  std::size_t size() const { return size_.load(std::memory_order_relaxed); }
  Block* find(const void* p) const {
    if (size() == 0) return nullptr;
    for (std::size_t i = home(p);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.block == nullptr || s.key == p) return s.block;
    }
  }
  // Pre: b->ptr is not in the table. False when the table is full (or cannot grow).
  bool insert(Block* b) {
    if (size() >= kMax) return false;
    if (2 * (size() + 1) > slot_count() && !grow()) return false;
    place(Slot{b->ptr, b});
    size_.store(size() + 1, std::memory_order_relaxed);
    return true;
  }
  void erase(const void* p) {
    if (size() == 0) return;
    std::size_t hole = home(p);
    while (slots_[hole].block != nullptr && slots_[hole].key != p) hole = (hole + 1) & mask_;
    if (slots_[hole].block == nullptr) return;
    // Shift later entries of the probe run back over the hole when their home allows.
    for (std::size_t j = (hole + 1) & mask_; slots_[j].block != nullptr; j = (j + 1) & mask_) {
      const std::size_t h = home(slots_[j].key);
      const bool movable = hole <= j ? (h <= hole || h > j) : (h <= hole && h > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    size_.store(size() - 1, std::memory_order_relaxed);
  }
  template <class Fn>
  void for_each(Fn&& fn) const {
    if (size() == 0) return;
    for (std::size_t i = 0; i < slot_count(); ++i)
      if (slots_[i].block != nullptr) fn(slots_[i].block);
  }
  void clear() {
    if (slots_) std::fill(slots_.get(), slots_.get() + slot_count(), Slot{});
    size_.store(0, std::memory_order_relaxed);
  }

 private:
  struct Slot {
    const void* key = nullptr;  // block->ptr
    Block* block = nullptr;     // null: empty slot
  };
  // The table starts small and doubles when half full: a thread usually holds tens of
  // blocks, and a 1 KiB table stays in the L1 cache where the full 32 KiB one did not
  // (callgrind, Mixed64Live).
  static constexpr int kMinLog2Slots = 6;
  static constexpr int kMaxLog2Slots = 11;
  static_assert((std::size_t{1} << kMaxLog2Slots) >= 2 * kMax, "at most half full");

  std::size_t slot_count() const { return slots_ ? mask_ + 1 : 0; }
  // Blocks are 512-aligned: drop those bits, then Fibonacci hashing.
  std::size_t home(const void* p) const {
    const std::uint64_t x = (reinterpret_cast<std::uintptr_t>(p) >> 9) * 0x9E3779B97F4A7C15ull;
    return static_cast<std::size_t>(x >> (64 - log2_slots_));
  }
  void place(Slot s) {
    std::size_t i = home(s.key);
    while (slots_[i].block != nullptr) i = (i + 1) & mask_;
    slots_[i] = s;
  }
  // Doubles the table (allocates the first one); false when out of memory: the caller
  // then does not hold the block, which only costs it the cache.
  bool grow() {
    const int log2 = slots_ ? log2_slots_ + 1 : kMinLog2Slots;
    if (log2 > kMaxLog2Slots) return false;
    std::unique_ptr<Slot[]> old;
    const std::size_t old_count = slot_count();
    try {
      old = std::exchange(slots_, std::make_unique<Slot[]>(std::size_t{1} << log2));
    } catch (const std::bad_alloc&) {
      return false;
    }
    log2_slots_ = log2;
    mask_ = (std::size_t{1} << log2) - 1;
    for (std::size_t i = 0; i < old_count; ++i)
      if (old[i].block != nullptr) place(old[i]);
    return true;
  }

  std::unique_ptr<Slot[]> slots_;  // allocated on first insert
  int log2_slots_ = kMinLog2Slots;
  std::size_t mask_ = 0;
  std::atomic<std::size_t> size_{0};  // written under the owning cache's mutex only
};

}  // namespace tidepool::detail
