// HostArena's pageable fallback: a block from the process allocator when pinned memory
// cannot serve a request (the budget spent, a registration refused, no mimalloc), counted
// by cause, and the one-line warning (once per arena) that says why, what it costs (copies
// at pageable speed, without overlap) and what to change. The pinned side is
// host_arena.cpp.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "allocator/stats.h"
#include "allocator/warn_once.h"
#include "tiering/host_arena.h"
#include "tiering/host_arena_internal.h"

namespace tidepool {

using host_arena_detail::fallback_cause;
using host_arena_detail::FallbackCause;
using host_arena_detail::kBlockAlign;

namespace {
// The warning's text: cause, budget asked for, remedy, consequence.
std::string pageable_fallback_warning(const HostArenaStats& s, std::size_t bytes,
                                      const std::string& reason, FallbackCause why) {
  constexpr const char* kRaise =
      "raise the locked-memory limit (shell: ulimit -l unlimited; systemd: "
      "LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)";
  const std::string requested = format_bytes(s.pinned_budget_requested_bytes);
  std::string cause, remedy;
  if (s.budget_capped_by_memlock && why != FallbackCause::no_mimalloc) {
    cause = "pinned host memory is capped by RLIMIT_MEMLOCK at " +
            format_bytes(s.pinned_budget_bytes) + " (pinned budget requested: " + requested + ")";
    remedy = kRaise;
  } else if (why == FallbackCause::register_failed) {
    rlimit limit{};
    const bool finite = getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
    cause = "pinning host memory failed (" + reason + "; pinned budget requested: " + requested +
            (finite ? ", RLIMIT_MEMLOCK: " + format_bytes(limit.rlim_cur) : std::string()) + ")";
    // Review finding: a finite limit alone sent users to raise it, where the header says
    // cudaHostRegister is not bound by it: the likelier causes come first.
    remedy = std::string("free host memory or lower tidepool.pinned_budget") +
             (finite ? "; if this backend counts pinned pages against RLIMIT_MEMLOCK, " +
                           std::string(kRaise)
                     : "");
  } else if (why == FallbackCause::no_mimalloc) {
    cause = reason;
    remedy = "make libmimalloc.so.2 loadable (Debian/Ubuntu package libmimalloc2.0)";
  } else if (why == FallbackCause::budget_spent) {
    cause = "the pinned host budget of " + format_bytes(s.pinned_budget_bytes) +
            (s.budget_shared ? " (one for the process, shared by its tiered stores and "
                                 "pointer-stable ranges)" : "") +
            " is spent";
    remedy = "raise tidepool.pinned_budget (or HostArenaOptions::pinned_budget_bytes)";
  } else {
    cause = "pinned host memory could not serve a request" +
            (reason.empty() ? "" : " (" + reason + ")");
    remedy = "raise tidepool.pinned_budget or free host memory";
  }
  return "tidepool: " + cause + "; tiered state from here on (this block: " + format_bytes(bytes) +
         ") lives in pageable memory until pinned memory has room for it, so its copies run "
         "at pageable speed and are not asynchronous. To fix: " + remedy +
         ". To silence: tidepool.log:off or HostArenaOptions::warn_on_pageable_fallback = false.";
}
}  // namespace

HostBlock HostArena::allocate_pageable(std::size_t bytes, const std::string& reason) {
  // The process allocator, not mimalloc: the fallback must work without it.
  void* p = nullptr;
  if (posix_memalign(&p, kBlockAlign, bytes) != 0) p = nullptr;
  if (p == nullptr) {
    throw HostArenaError("host arena: out of host memory: " + std::to_string(bytes) +
                         " pageable bytes after pinned failed (" + reason + ")");
  }
  // The one copy the bookkeeping makes, before anything is counted: a heap that cannot
  // give it leaves p freed and the stats as they were.
  std::string last_reason;
  try {
    last_reason = reason;
  } catch (...) {
    std::free(p);
    throw;
  }
  stats_.pageable_in_use_bytes += bytes;
  stats_.pageable_peak_bytes = std::max(stats_.pageable_peak_bytes, stats_.pageable_in_use_bytes);
  stats_.pageable_allocs++;
  const FallbackCause why = fallback_cause(reason);
  if (why == FallbackCause::register_failed) {
    stats_.fallback_register_failed++;
  } else if (why == FallbackCause::no_mimalloc) {
    stats_.fallback_no_mimalloc++;
  } else if (why == FallbackCause::budget_spent) {
    stats_.fallback_budget++;
  } else {
    stats_.fallback_other++;
  }
  stats_.last_fallback_reason = std::move(last_reason);
  // One line, once per arena: a silent fallback costs a training run its overlap (every
  // copy of that state blocks the host) and nothing else would tell the user why.
  if (options_.warn_on_pageable_fallback && warn_once_due(stats_.fallback_warned)) {
    try {
      std::fprintf(stderr, "%s\n", pageable_fallback_warning(stats_, bytes, reason, why).c_str());
    } catch (...) {  // no heap for the text: the block is handed out all the same, said so
      std::fputs("tidepool: tiered state from here on lives in pageable memory for now (out of "
                 "memory for the details; HostArenaStats::last_fallback_reason says why)\n",
                 stderr);
    }
  }
  return HostBlock{p, bytes, HostTier::pageable};
}

}  // namespace tidepool
