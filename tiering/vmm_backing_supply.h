// VmmPool::BackingSupply: physical backings created ahead of the moves that need them
// (Note [Migration batches] in vmm_moves.cpp). Private to VmmPool: vmm_migration.cpp makes
// one for a call that moves several ranges to the host, vmm_moves.cpp one per range
// otherwise, and takes from it.
//
// The backings are created in the order given, by up to `threads` helper threads, while
// the moves take them by size: a take waits for one of its size being created, or creates
// one itself when none of its size is planned or claimed yet. So the moves take them in
// about the order created, and a move whose plan changed (a range freed or moved by
// another thread between the planning and its move) still gets what it needs. The
// helpers call only VmmPool::create_backing (Backend::create_physical, a host backing
// charged to the pinned budget first) and stop at the first failure (out of memory, the
// pinned budget spent, or an error); finish() joins them and hands back what no move took.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "allocator/backend.h"
#include "tiering/vmm_migration.h"

namespace tidepool {

class VmmPool::BackingSupply {
 public:
  // Backings of `sizes` bytes in `where`, created in that order by min(threads, count)
  // helper threads when that is two or more; else each is created by the take() that
  // wants it (the calls and their order are then those of a move without a supply).
  BackingSupply(VmmPool& pool, MemoryLocation where, const std::vector<std::size_t>& sizes,
                unsigned threads);
  ~BackingSupply();  // stops and joins the helpers; pre: finish() was called
  BackingSupply(const BackingSupply&) = delete;
  BackingSupply& operator=(const BackingSupply&) = delete;

  // A backing of `bytes`. Null: its location is out of memory, or the pinned budget had
  // no room (NewBacking::pinned_budget_spent). A creation's error is rethrown to the take
  // that gets it. A failed slot is taken only when no other of its
  // size was made or can be (Note [A failed creation is taken last], vmm_moves.cpp).
  NewBacking take(std::size_t bytes);
  // Stops creating, waits for the helpers, and passes each backing created and not taken
  // to `give_back(handle, bytes)`. Called once, before the destructor.
  void finish(const std::function<void(PhysicalHandle, std::size_t)>& give_back);

  MemoryLocation where() const { return where_; }
  std::uint64_t created() const;       // backings created
  std::uint64_t create_calls() const;  // create_physical calls, failed ones included
  double create_ms() const;            // time in them, summed over the threads
  double wait_ms() const;              // time takes waited for a helper's creation

 private:
  enum class Status { pending, creating, ready, taken };
  struct Slot {
    std::size_t bytes;
    Status status;
    NewBacking backing;
    std::exception_ptr error;
  };

  void run();  // a helper
  // Creates slot `i`, which the caller marked creating; called without the lock.
  void create(std::size_t i);
  void stop_and_join();

  VmmPool& pool_;
  const MemoryLocation where_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<Slot> slots_;
  std::size_t next_ = 0;  // the helpers' next slot to look at
  bool stop_ = false;
  std::vector<std::thread> helpers_;
  std::uint64_t created_ = 0;
  std::uint64_t create_calls_ = 0;
  double create_ms_ = 0;
  double wait_ms_ = 0;
};

}  // namespace tidepool
