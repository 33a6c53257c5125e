// warn_once: the rule every slow-path warning of tidepool follows, kept in one place: a
// warning is said once per object that owns it (an allocator, a pool, an arena), and
// never while tidepool.log is off. The caller writes the line itself: each warning has its
// own text, and some are costly to build, so they are built only when due.
//
// Thread-safety: `said` belongs to the owning object; the caller holds that object's lock.
#pragma once

#include "allocator/config.h"

namespace tidepool {

// True when the warning `said` guards is to be written now: it was not said yet and
// logging is not off. Marks it said then; while logging is off it stays unsaid, so it is
// still said once logging is turned on.
inline bool warn_once_due(bool& said) {
  if (said || active_config().log == LogLevel::off) return false;
  said = true;
  return true;
}

}  // namespace tidepool
