// The device's one tidepool.state_budget, shared: a ledger per device that every tiering
// object whose budget comes from the configuration charges its device bytes to, so that
// together they stay within the budget the configuration names for the device, however
// many of them there are. Without it each TieredStore built with kDeviceBudgetFromConfig
// and the VmmPool took the whole budget for itself, and two stores on one device (one per
// optimizer; Apollo inside AADL) could hold twice the budget.
//
// Participants: a TieredStore built with TieredStoreOptions::kDeviceBudgetFromConfig when
// the configured budget is not 0, and a VmmPool built with
// VmmPoolOptions::kDeviceBudgetFromConfig. A store or pool given a budget of its own keeps
// it privately, exactly as before: it asked for that room, and the ledger never sees it.
//
// Note [Shared state budget]
// Invariant: the bytes charged by all participants of a device (a store: its resident
// buffers and its buffers on their way out, TieredStore::device_bytes(), plus at most the
// one buffer it is allocating; the pool: its device-backed bytes) never exceed the
// budget. Charges are taken before the memory is (a store reserves a buffer's bytes
// before it allocates it and gives the reservation back if the allocation fails) and
// given back after it is handed back, and a buffer that passes from one owner to another
// (a load taking over a buffer on its way out) keeps its charge; so the memory the
// participants hold on the device is never more than the charge. One exception, as
// before: a VmmPool allocation is not limited by the budget (Note [VMM device budget] in
// vmm_migration.h), so it is charged unconditionally, and the others find that much less
// room until it leaves the device. Before it is, the pool asks the stores for the room it
// lacks (Seat::ask_peers, as in 2. below), so the budget is passed only by what they
// cannot give back (acquired handles) or the ranges themselves. Each participant checks a charge
// against the budget as it resolved it (a store when it was built, the pool at each migration);
// they agree unless the configuration changes in between, and a budget lowered below what is
// charged takes nothing back: new charges wait until enough has been given back.
//
// Room, in order:
//   1. A store that needs room for an acquire evicts its own released handles and uses
//      or waits for its own write-backs, as with a budget of its own (make_room_locked,
//      Note [Loads over write-backs] in tiered_store.h), charging against the ledger;
//      but not a handle its current step uses again (all its released handles are, when
//      the one whose next use is furthest is): the other stores are asked first (2.),
//      whose released handles their own steps need later, and such a handle is evicted
//      only once asking gave nothing (the last attempt of 2.). Two optimizers whose steps
//      alternate each keep their step's working set while the other's idle state makes
//      room.
//   2. When the ledger still lacks room, the acquire asks the other stores
//      (Seat::ask_peers): each evicts released handles, furthest next use first, and
//      waits for its write-backs, what TieredStore::reclaim does for an allocator's OOM,
//      until the shortfall is given back; then the acquire starts over. It asks again
//      while the others give something back (a room given back may be taken by another
//      store's load first), and after three asks in a row that gave nothing (the room
//      is held by acquired handles or VMM ranges) it fails with a TieringError that
//      says the budget is shared and how many bytes the others hold. A create on the
//      device (Tier::device) gets its room the same way (TieredStore::with_room_from_peers).
//   3. A prefetch is a hint: it takes free room in the ledger only (and evicts its own
//      handles needed later than the one it loads, as before); it never asks the others
//      and never waits.
//   4. A VmmPool migration towards the device takes free room only: a chunk that does not
//      fit stays host-backed, as with a budget of its own. Stores never evict VMM ranges
//      and the pool never evicts store handles: the ranges are held by pointer (PyTorch's
//      tensors) and moved by the optimizer hooks around each step, which know when they
//      are used; a store cannot.
//
// Locking. The charges are atomics, taken under the participant's own lock and never
// waiting. The ledger's mutex guards its seats and is held through a walk of ask_peers,
// which locks each store it asks (blocking: a peer's operations are short and none waits
// for another store). The order is ledger mutex -> store mutex, never the reverse:
//   - an acquire lets go of its own store's lock before it asks the others, and takes it
//     again after, so a store that waits for the ledger's mutex holds no store lock;
//   - a store joins the ledger in its constructor and leaves it first in its destructor
//     (Seat::withdraw), before it takes its own lock: a walk under way finishes with it
//     first, and no walk reaches it after;
//   - giving back (TieredStore::give_back_for_peer) evicts and waits for the device to
//     finish its own write-backs, which need no lock; it allocates nothing, so no
//     allocator OOM path runs inside it;
//   - the charges, which every path takes under some store or pool lock, are atomics.
//   - what a thread holding a store's lock may wait for (the backend; the allocator,
//     whose OOM hooks only try_lock the registry and the stores) never waits for the
//     ledger's mutex; and a VmmPool joining under the registry's lock (tiering_vmm_pool)
//     waits for a walk that never takes the registry (store operations do not).
// Two stores on two threads that each need room from the other: each lets go of its own
// lock before asking, the ledger's mutex lets one walk at a time, and the walking one
// finds the other's lock free (or soon free: the other is on its way to the ledger), so
// neither waits for the other while holding what the other needs.
// The ledgers are kept in a map of their own (DeviceBudgetLedger::of_device), not in the
// tiering registry: tiering_vmm_pool builds the pool under the registry's lock, where
// reaching the registry again is refused (Note [Registry re-entry]).
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "allocator/export.h"

namespace tidepool {

class TIDEPOOL_API DeviceBudgetLedger {
 public:
  class Seat;

  // The ledger of `device` that its participants hold now, or a new one. A ledger lives
  // while a seat holds it.
  static std::shared_ptr<DeviceBudgetLedger> of_device(int device);
  // The ledger of `device` if a participant holds one now, else nullptr (creates nothing).
  static std::shared_ptr<DeviceBudgetLedger> existing(int device);

  explicit DeviceBudgetLedger(int device) : device_(device) {}
  DeviceBudgetLedger(const DeviceBudgetLedger&) = delete;
  DeviceBudgetLedger& operator=(const DeviceBudgetLedger&) = delete;

  int device() const noexcept { return device_; }
  // Bytes charged by all participants now.
  std::size_t charged_bytes() const noexcept { return charged_.load(std::memory_order_acquire); }
  // Participants now (stores and the pool).
  std::size_t participants() const;

 private:
  const int device_;
  std::atomic<std::size_t> charged_{0};
  // Guards seats_ and is held through a walk of Seat::ask_peers (Note [Shared state
  // budget]).
  mutable std::mutex mutex_;
  std::vector<Seat*> seats_;
};

// A participant's place in a ledger: what it has charged, and, for a store, how the
// others ask it for room. Charges are atomic and never wait.
class TIDEPOOL_API DeviceBudgetLedger::Seat {
 public:
  // Evicts until about `bytes_needed` are given back to the ledger, waiting for its own
  // write-backs, and returns what it gave back (0 when it has nothing to give). Called by
  // another participant's ask_peers, on that thread, under the ledger's mutex; must not
  // throw.
  using GiveBack = std::function<std::size_t(std::size_t bytes_needed)>;

  // Joins `ledger`. `give_back` empty: the participant is never asked (the VmmPool).
  explicit Seat(std::shared_ptr<DeviceBudgetLedger> ledger, GiveBack give_back = {});
  // Leaves (withdraw) and gives back whatever is still charged.
  ~Seat();
  Seat(const Seat&) = delete;
  Seat& operator=(const Seat&) = delete;

  // No give_back call runs or starts once this returns (a walk under way finishes
  // first). Idempotent. A destructor calls it before it takes the participant's lock.
  void withdraw();

  // Charges `bytes` when all charges stay within `budget`; false (nothing charged) else.
  bool try_charge(std::size_t bytes, std::size_t budget) noexcept;
  // Charges `bytes` whatever the budget (a VmmPool allocation, which no budget limits).
  void charge(std::size_t bytes) noexcept;
  // Gives back `bytes` of this seat's charge (pre: no more than it charged).
  void uncharge(std::size_t bytes) noexcept;
  std::size_t own_bytes() const noexcept { return own_.load(std::memory_order_acquire); }
  // Bytes the other participants have charged now.
  std::size_t others_bytes() const noexcept;

  // Asks the other participants, one by one in the order they joined, to give back room
  // until `bytes_needed` are given back; returns the bytes they gave back. Pre: the
  // caller holds no store's or pool's lock (Note [Shared state budget]).
  std::size_t ask_peers(std::size_t bytes_needed);

  DeviceBudgetLedger& ledger() const noexcept { return *ledger_; }

 private:
  std::shared_ptr<DeviceBudgetLedger> ledger_;
  GiveBack give_back_;
  std::atomic<std::size_t> own_{0};
  bool withdrawn_ = false;  // under ledger_->mutex_
};

}  // namespace tidepool
