// A tiered store with default options but its device budget, for the optimizer tests of
// tiered state (on the host backend its "device" is host memory LibTorch's CPU ops use).
#pragma once

#include <cstddef>
#include <memory>

#include "allocator/backend.h"
#include "tiering/tiered_store.h"

namespace tidepool::testing {

inline std::shared_ptr<TieredStore> store_with_budget(Backend& backend, std::size_t budget) {
  TieredStoreOptions options;
  options.device_budget_bytes = budget;
  return std::make_shared<TieredStore>(backend, options);
}

}  // namespace tidepool::testing
