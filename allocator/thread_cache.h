// ThreadCache: one thread's private cache of freed small blocks for one allocator, so
// that a cached alloc+free pair on one stream by one thread takes no device mutex (Note
// [Thread caches] in thread_cache.cpp). Internal to the allocator (not installed).
//
// Locking: `mutex` (a SpinLock) guards everything here and, for every block in `held`, that block's
// requested/tag/in_thread_cache/extra_streams/quick_next fields. The owning thread takes
// only `mutex` on its fast path. The allocator takes it while holding its own mutex
// (order: lifecycle mutex -> allocator mutex -> cache mutex; never the reverse), to drain
// the cache, fold its statistics, or look at a held block. The owning thread also reads
// three atomics without it (the miss hint, the dirty flag, the held count: see "called by
// the owning thread only" below).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <atomic>
#include <thread>

#include "allocator/block.h"
#include "allocator/caching_allocator.h"
#include "allocator/held_table.h"
#include "allocator/size_classes.h"
#include "allocator/stats.h"
#include "allocator/tags.h"

namespace tidepool::detail {

// What one thread did to one Stat since its deltas were last folded into the shared
// stats. `high` is the highest `current` reached since then: the shared value at fold
// time plus `high` is the peak this thread saw (Note [Thread caches]: exact while one
// thread at a time uses the cache path).
struct StatDelta {
  std::int64_t current = 0;
  std::int64_t high = 0;
  std::uint64_t added = 0;
  std::uint64_t removed = 0;

  void add(std::uint64_t n) {
    current += static_cast<std::int64_t>(n);
    added += n;
    high = std::max(high, current);
  }
  void sub(std::uint64_t n) {
    current -= static_cast<std::int64_t>(n);
    removed += n;
  }
  void fold_into(Stat& s) {
    s.peak = std::max(s.peak, s.current + static_cast<std::uint64_t>(high));
    s.current += static_cast<std::uint64_t>(current);  // modular: current may be negative
    s.allocated += added;
    s.freed += removed;
    *this = StatDelta();
  }
};

struct TagDelta {
  StatDelta bytes;
  std::int64_t count = 0;
  std::uint64_t total_count = 0;
};

// The cache's lock. Its thread takes it on every fast-path call and the allocator only on
// drains, folds and shared frees of held blocks, so it is almost never contended: a
// test-and-set lock costs one atomic exchange where an uncontended pthread mutex pair
// cost about a third of the cached pair (perf on the host backend).
class SpinLock {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire))
      while (locked_.load(std::memory_order_relaxed)) std::this_thread::yield();
  }
  bool try_lock() noexcept { return !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

struct ThreadCache {
  // Blocks of one size class per stream at most this many; bytes in all lists at most the
  // allocator's options().thread_cache_bytes.
  static constexpr std::uint8_t kPerClass = 4;
  // Streams one thread caches for at a time; frees on further streams take the shared path.
  static constexpr int kStreamSlots = 4;
  static_assert(kTagCount <= 64, "tag_dirty is a 64-bit mask");
  static constexpr std::size_t kClassWords = (kSmallClasses + 63) / 64;

  struct StreamSlot {
    Stream stream;
    bool used = false;
    std::size_t blocks = 0;  // in all lists of the slot
    std::unique_ptr<std::array<Block*, kSmallClasses>> heads;  // LIFO per size class
    std::unique_ptr<std::array<std::uint8_t, kSmallClasses>> counts;
    // Bit c: class c's list is not empty, so a drain visits only the lists in use.
    std::array<std::uint64_t, kClassWords> nonempty{};
  };

  ThreadCache(std::uint64_t id, CachingAllocator::Impl* a) : allocator_id(id), allocator(a) {}

  const std::uint64_t allocator_id;  // CachingAllocator::Impl::id, never reused
  SpinLock mutex;
  // The allocator this cache belongs to; null once it was released (thread exit) or the
  // allocator was destroyed. Written under the lifecycle, allocator and cache mutexes.
  CachingAllocator::Impl* allocator;

  // Every block this cache is responsible for, live (handed out by this thread) or cached
  // (freed into `slots`), by address. Each has block->holder == this.
  // A thread holding more frees the rest through the shared path.
  HeldTable held;
  std::array<StreamSlot, kStreamSlots> slots;
  std::size_t cached_bytes = 0;

  // Bit c: some slot may hold a block of size class c (Note [Thread caches]: the miss
  // hint). Written only under `mutex`; read by the owning thread without it.
  std::array<std::atomic<std::uint64_t>, kClassWords> maybe_cached{};

  // False only if no slot holds a block of class `c`. Called by the owning thread without
  // the mutex: only that thread parks blocks, and it sets the bit before it parks one;
  // other threads only take blocks out, so a clear bit it reads is never stale.
  bool may_have(std::size_t c) const {
    return (maybe_cached[c / 64].load(std::memory_order_relaxed) >> (c % 64)) & 1;
  }

  // Statistics of the fast path, folded into the allocator's under both mutexes. `dirty`
  // is set by the owning thread only and may be read by it without the mutex (is_dirty).
  std::atomic<bool> dirty{false};
  StatDelta allocated, requested;
  std::array<TagDelta, kTagCount> tags{};
  std::uint64_t tag_dirty = 0;  // bit t: tags[t] changed since the last fold
  StatDelta allocations;  // a count: +1 per allocation, -1 per free
  std::uint64_t cache_hits = 0;

  // Hit rate over the current window (should_hold); the owning thread's only.
  static constexpr std::uint32_t kProbeWindow = 256;
  static constexpr std::uint32_t kBypassWindow = 16 * kProbeWindow;
  static constexpr std::uint32_t kMinHitRatio = 4;
  std::uint32_t window_misses = 0, window_hits = 0;
  bool bypass = false;

  // A cached block of exactly `rounded` bytes freed on `s`, or null.
  Block* pop(Stream s, std::size_t rounded) {
    StreamSlot* slot = find_slot(s);
    if (slot == nullptr) return nullptr;
    const std::size_t c = small_class(rounded);
    Block* b = (*slot->heads)[c];
    if (b == nullptr) return nullptr;
    (*slot->heads)[c] = b->quick_next;
    b->quick_next = nullptr;
    if (--(*slot->counts)[c] == 0) {
      slot->nonempty[c / 64] &= ~(std::uint64_t{1} << (c % 64));
      forget_class_if_unused(c);
    }
    --slot->blocks;
    cached_bytes -= b->size;
    return b;
  }

  // Parks held block b, freed on its own stream `s`; false when it does not fit (the
  // caller frees it through the shared path instead).
  bool push(Block* b, Stream s, std::size_t budget) {
    if (cached_bytes + b->size > budget) return false;
    StreamSlot* slot = find_slot(s);
    if (slot == nullptr) slot = claim_slot(s);
    if (slot == nullptr) return false;
    const std::size_t c = small_class(b->size);
    if ((*slot->counts)[c] >= kPerClass) return false;
    b->quick_next = (*slot->heads)[c];
    (*slot->heads)[c] = b;
    ++(*slot->counts)[c];
    slot->nonempty[c / 64] |= std::uint64_t{1} << (c % 64);
    std::atomic<std::uint64_t>& hint = maybe_cached[c / 64];
    hint.store(hint.load(std::memory_order_relaxed) | std::uint64_t{1} << (c % 64),
               std::memory_order_relaxed);
    ++slot->blocks;
    cached_bytes += b->size;
    b->in_thread_cache = true;
    return true;
  }

  // Empties every list, calling fn(block) for each cached block.
  template <class Fn>
  void drain(Fn&& fn) {
    if (cached_bytes == 0) return;
    for (StreamSlot& slot : slots) {
      if (slot.blocks == 0) continue;
      for (std::size_t w = 0; w < slot.nonempty.size(); ++w) {
        for (std::uint64_t bits = slot.nonempty[w]; bits != 0; bits &= bits - 1) {
          const std::size_t c = w * 64 + static_cast<std::size_t>(__builtin_ctzll(bits));
          while (Block* b = (*slot.heads)[c]) {
            (*slot.heads)[c] = b->quick_next;
            b->quick_next = nullptr;
            cached_bytes -= b->size;
            fn(b);
          }
          (*slot.counts)[c] = 0;
        }
        slot.nonempty[w] = 0;
      }
      slot.blocks = 0;
    }
    for (auto& hint : maybe_cached) hint.store(0, std::memory_order_relaxed);
  }

  // Empties the lists of stream `s` only, calling fn(block) for each cached block, and
  // frees the slot (CachingAllocator::release_stream: `s` is about to be destroyed, and a
  // later stream may get the same handle).
  template <class Fn>
  void drain_stream(Stream s, Fn&& fn) {
    StreamSlot* slot = find_slot(s);
    if (slot == nullptr) return;
    for (std::size_t c = 0; c < kSmallClasses; ++c) {
      while (Block* b = (*slot->heads)[c]) {
        (*slot->heads)[c] = b->quick_next;
        b->quick_next = nullptr;
        cached_bytes -= b->size;
        fn(b);
      }
      (*slot->counts)[c] = 0;
    }
    slot->nonempty.fill(0);
    slot->blocks = 0;
    slot->used = false;
    // The other slots' classes stay hinted.
    for (std::size_t w = 0; w < kClassWords; ++w) {
      std::uint64_t bits = 0;
      for (const StreamSlot& other : slots)
        if (other.used) bits |= other.nonempty[w];
      maybe_cached[w].store(bits, std::memory_order_relaxed);
    }
  }

  void note_alloc(Block* b, std::size_t bytes, int tag) {
    b->in_thread_cache = false;
    b->requested = bytes;
    b->tag = static_cast<std::uint8_t>(tag);
    allocated.add(b->size);
    requested.add(bytes);
    TagDelta& t = tags[tag];
    t.bytes.add(b->size);
    ++t.count;
    ++t.total_count;
    tag_dirty |= std::uint64_t{1} << tag;
    allocations.add(1);
    ++cache_hits;
    ++window_hits;
    dirty.store(true, std::memory_order_relaxed);
  }

  void note_free(const Block* b) {
    allocated.sub(b->size);
    requested.sub(b->requested);
    TagDelta& t = tags[b->tag];
    t.bytes.sub(b->size);
    --t.count;
    tag_dirty |= std::uint64_t{1} << b->tag;
    allocations.sub(1);
    dirty.store(true, std::memory_order_relaxed);
  }

  // Adds the deltas to `s` and clears them.
  void fold_into(AllocatorStats& s) {
    if (!dirty.load(std::memory_order_relaxed)) return;
    allocated.fold_into(s.allocated);
    requested.fold_into(s.requested);
    for (std::uint64_t m = tag_dirty; m != 0; m &= m - 1) {
      const int t = __builtin_ctzll(m);
      TagDelta& d = tags[t];
      d.bytes.fold_into(s.tags[t].bytes);
      s.tags[t].count += static_cast<std::uint64_t>(d.count);
      s.tags[t].total_count += d.total_count;
      d = TagDelta();
    }
    tag_dirty = 0;
    allocations.fold_into(s.allocations);
    s.cache_hits += cache_hits;
    cache_hits = 0;
    dirty.store(false, std::memory_order_relaxed);
  }

  // ---- Called by the owning thread only, without the mutex (Note [Thread caches]: the
  // miss path). Each relies on only the owner adding state: other threads only drain,
  // fold and take held blocks over, so a "nothing there" the owner reads is never stale.

  // No delta waits to be folded.
  bool is_dirty() const { return dirty.load(std::memory_order_relaxed); }
  // The cache holds at least one block (live or parked).
  bool holds_any() const { return held.size() != 0; }

  // Whether the block of a small allocation through the shared path should be held, so
  // that its free can park it here. Bypass: over a window of kProbeWindow such misses
  // with fewer than one hit per kMinHitRatio misses the cache earns less than holding
  // costs (Mixed64Live: exact-size classes, mixed sizes), so for the next kBypassWindow
  // misses nothing new is held or parked and the thread uses the shared path as with
  // caches off; then it probes again.
  bool should_hold() {
    ++window_misses;
    if (bypass) {
      if (window_misses < kBypassWindow) return false;
      bypass = false;
      window_misses = window_hits = 0;
      return true;
    }
    if (window_misses >= kProbeWindow) {
      bypass = window_hits * kMinHitRatio < window_misses;
      window_misses = window_hits = 0;
    }
    return !bypass;
  }
  // Frees park only while not bypassing.
  bool parking() const { return !bypass; }
  // Whether a slot (with or without blocks now) is `s`'s: release_stream's fast path.
  bool has_slot(Stream s) { return find_slot(s) != nullptr; }

 private:
  // Clears class c's hint bit once no slot holds a block of class c.
  void forget_class_if_unused(std::size_t c) {
    const std::uint64_t bit = std::uint64_t{1} << (c % 64);
    for (const StreamSlot& slot : slots)
      if (slot.used && (slot.nonempty[c / 64] & bit) != 0) return;
    std::atomic<std::uint64_t>& hint = maybe_cached[c / 64];
    hint.store(hint.load(std::memory_order_relaxed) & ~bit, std::memory_order_relaxed);
  }

  StreamSlot* find_slot(Stream s) {
    for (StreamSlot& slot : slots)
      if (slot.used && slot.stream == s) return &slot;
    return nullptr;
  }
  // A free slot for `s` (an empty one may be taken over), or null when all hold blocks.
  StreamSlot* claim_slot(Stream s) {
    for (StreamSlot& slot : slots) {
      if (slot.used && slot.blocks != 0) continue;
      if (!slot.heads || !slot.counts) {
        // Both made before either is kept (a heap that ran out between the two left heads
        // without counts, dereferenced at the slot's next claim), and no heap means no
        // slot: the caller frees through the shared path, which needs none (Note [Failed
        // frees] in frees.cpp).
        try {
          auto heads = std::make_unique<std::array<Block*, kSmallClasses>>();
          auto counts = std::make_unique<std::array<std::uint8_t, kSmallClasses>>();
          slot.heads = std::move(heads);
          slot.counts = std::move(counts);
        } catch (const std::bad_alloc&) {
          return nullptr;
        }
      }
      slot.heads->fill(nullptr);
      slot.counts->fill(0);
      slot.nonempty.fill(0);
      slot.stream = s;
      slot.used = true;
      return &slot;
    }
    return nullptr;
  }
};

}  // namespace tidepool::detail
