// JSON renderings of the tiering telemetry (host arena, copy engine, tiered store, VMM
// migration), for the C ABI's snapshot and the benchmarks. One flat object per struct;
// field names are the struct's member names, byte counts are integers, times in ms.
#pragma once

#include <string>

#include "allocator/export.h"
#include "tiering/copy_engine.h"
#include "tiering/host_arena.h"

namespace tidepool {

struct TieredStoreStats;
struct VmmStats;

TIDEPOOL_API std::string to_json(const HostArenaStats& s);
TIDEPOOL_API std::string to_json(const CopyEngineStats& s);
TIDEPOOL_API std::string to_json(const TieredStoreStats& s);
TIDEPOOL_API std::string to_json(const VmmStats& s);

}  // namespace tidepool
