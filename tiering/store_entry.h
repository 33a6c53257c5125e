// A tiered store's record of one handle (TieredStore::Entry): its host block, its device
// buffer and the events and streams that order their copies. Internal to libtidepool
// (not installed); shared by the files that hold the store's parts (tiered_store.cpp,
// store_budget.cpp, eviction_order.cpp, ...). The states it goes through: Note [Handle
// state machine] in tiered_store.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/backend.h"
#include "tiering/host_arena.h"
#include "tiering/tiered_store.h"

namespace tidepool {

struct TieredStore::Entry {
  Handle id = 0;
  std::size_t bytes = 0;
  int tag = 0;
  HostBlock host;
  void* dev = nullptr;
  Event dev_ready;   // recorded on the H2D stream after the load
  Event host_ready;  // recorded on the D2H stream after a copy-back
  bool host_valid = true;
  bool dev_dirty = false;
  // Who loaded the device copy, until an acquire of it succeeds and counts the load (a
  // prefetch hit or a miss) once: an acquire that fails after the load (a wait that
  // fails) leaves it to the retry, so failed acquires count nothing.
  enum class LoadBy : std::uint8_t { none, prefetch, acquire } uncounted_load = LoadBy::none;
  int pins = 0;
  std::vector<Stream> use_streams;  // streams that used `dev` since it was loaded
  // Index in TieredStore::resident_ while `dev` is set (Note [Resident handles]).
  static constexpr std::size_t kNotResident = static_cast<std::size_t>(-1);
  std::size_t resident_slot = kNotResident;
  // Index in TieredStore::evictable_ while it holds the entry, and the key it is ordered
  // by there (Note [Eviction order] in eviction_order.cpp).
  static constexpr std::size_t kNotEvictable = static_cast<std::size_t>(-1);
  std::size_t evictable_slot = kNotEvictable;
  std::uint64_t evict_key = 0;
  // Its eviction failed in the operation under way: out of evictable_ until that ends
  // (Note [A victim that cannot be evicted] in eviction_order.cpp).
  bool eviction_skipped = false;
};

}  // namespace tidepool
