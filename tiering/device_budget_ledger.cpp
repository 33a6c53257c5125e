// The per-device ledger of tidepool.state_budget and its seats: the charges (atomics, so
// that taking one never waits and never takes a lock) and the walk that asks the other
// participants for room. Note [Shared state budget] in device_budget_ledger.h.
#include "tiering/device_budget_ledger.h"

#include <map>
#include <utility>

namespace tidepool {

namespace {

// The ledgers participants hold, by device. A map of its own rather than the tiering
// registry's (Note [Shared state budget]); weak, so a ledger goes with its last seat and
// the next participant starts from nothing charged.
std::mutex& ledgers_mutex() {
  static std::mutex m;
  return m;
}
// Never destroyed: seats may outlive static destruction order (as the registry's map).
std::map<int, std::weak_ptr<DeviceBudgetLedger>>& ledgers() {
  static auto* m = new std::map<int, std::weak_ptr<DeviceBudgetLedger>>();
  return *m;
}

}  // namespace

std::shared_ptr<DeviceBudgetLedger> DeviceBudgetLedger::of_device(int device) {
  std::lock_guard lock(ledgers_mutex());
  std::weak_ptr<DeviceBudgetLedger>& slot = ledgers()[device];
  std::shared_ptr<DeviceBudgetLedger> ledger = slot.lock();
  if (!ledger) {
    ledger = std::make_shared<DeviceBudgetLedger>(device);
    slot = ledger;
  }
  return ledger;
}

std::shared_ptr<DeviceBudgetLedger> DeviceBudgetLedger::existing(int device) {
  std::lock_guard lock(ledgers_mutex());
  auto it = ledgers().find(device);
  return it == ledgers().end() ? nullptr : it->second.lock();
}

std::size_t DeviceBudgetLedger::participants() const {
  std::lock_guard lock(mutex_);
  return seats_.size();
}

// ---- seats ------------------------------------------------------------------------------

DeviceBudgetLedger::Seat::Seat(std::shared_ptr<DeviceBudgetLedger> ledger, GiveBack give_back)
    : ledger_(std::move(ledger)), give_back_(std::move(give_back)) {
  std::lock_guard lock(ledger_->mutex_);
  ledger_->seats_.push_back(this);
}

DeviceBudgetLedger::Seat::~Seat() {
  withdraw();
  // What the participant still holds is gone with it (or leaked at a failed teardown,
  // where nobody can give it back either).
  ledger_->charged_.fetch_sub(own_.exchange(0), std::memory_order_acq_rel);
}

void DeviceBudgetLedger::Seat::withdraw() {
  std::lock_guard lock(ledger_->mutex_);  // waits for a walk under way
  if (withdrawn_) return;
  withdrawn_ = true;
  std::erase(ledger_->seats_, this);
}

// The total is raised before the seat's own count and lowered after it, so that
// others_bytes() (total - own), read while another seat changes, errs towards more.
bool DeviceBudgetLedger::Seat::try_charge(std::size_t bytes, std::size_t budget) noexcept {
  std::size_t now = ledger_->charged_.load(std::memory_order_acquire);
  do {
    if (bytes > budget || now > budget - bytes) return false;
  } while (!ledger_->charged_.compare_exchange_weak(now, now + bytes, std::memory_order_acq_rel));
  own_.fetch_add(bytes, std::memory_order_acq_rel);
  return true;
}

void DeviceBudgetLedger::Seat::charge(std::size_t bytes) noexcept {
  ledger_->charged_.fetch_add(bytes, std::memory_order_acq_rel);
  own_.fetch_add(bytes, std::memory_order_acq_rel);
}

void DeviceBudgetLedger::Seat::uncharge(std::size_t bytes) noexcept {
  own_.fetch_sub(bytes, std::memory_order_acq_rel);
  ledger_->charged_.fetch_sub(bytes, std::memory_order_acq_rel);
}

std::size_t DeviceBudgetLedger::Seat::others_bytes() const noexcept {
  const std::size_t own = own_bytes();
  const std::size_t total = ledger_->charged_bytes();
  return total > own ? total - own : 0;
}

// Under the ledger's mutex throughout: a seat asked cannot withdraw (its destructor
// waits), and walks run one at a time. Note [Shared state budget] argues why holding it
// while a peer's lock is taken cannot deadlock.
std::size_t DeviceBudgetLedger::Seat::ask_peers(std::size_t bytes_needed) {
  std::lock_guard lock(ledger_->mutex_);
  std::size_t given = 0;
  for (Seat* peer : ledger_->seats_) {
    if (given >= bytes_needed) break;
    if (peer == this || !peer->give_back_) continue;
    given += peer->give_back_(bytes_needed - given);
  }
  return given;
}

}  // namespace tidepool
