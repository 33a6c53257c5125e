// How TieredStore's public operations word the errors they report (Note [One error type]
// in store_errors.cpp). Internal to libtidepool (not installed).
#pragma once

#include <cstddef>
#include <string>

#include "tiering/tiered_store.h"

namespace tidepool::detail {

// Rethrows the exception being handled as a TieringError that says "tiered store:
// <operation> failed: <its message>", with the original nested in it; std::bad_alloc
// passes through unchanged. Call only inside a catch block.
[[noreturn]] void rethrow_as_tiering_error(const std::string& operation);

// "<op> of handle <h> (<bytes> bytes)", the operation as rethrow_as_tiering_error names it.
std::string of_handle(const char* op, TieredStore::Handle h, std::size_t bytes);

}  // namespace tidepool::detail
