// tidepool's configuration: the one parser for the tidepool keys of
// PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, shared by the Python start-up hook (through
// the C ABI below and ctypes), the LD_PRELOAD shim, and C++ trainers (install_from_env).
//
// PyTorch reads "key:value,key:value" from those variables and rejects keys and backends
// it does not know, so tidepool *claims* its own entries and hands the rest back,
// untouched and in order, for PyTorch to read.
//
// Note [tidepool keys]
//   backend:tidepool                 turns tidepool on (PyTorch's own `backend` key with
//                                    any other value is left for PyTorch)
//   tidepool.mode:global|pool        global (default): every CUDA allocation of the process
//                                    goes through tidepool; pool: only allocations inside
//                                    tidepool.region() and optimizer steps (torch MemPool)
//   tidepool.state_budget:SIZE       device memory optimizer state may keep between steps
//                                    (default 0: all of it is evicted after each step)
//   tidepool.pinned_budget:SIZE|unlimited
//                                    pinned host memory tiering may hold (the tiered
//                                    stores' and the pointer-stable ranges' host
//                                    backings), one budget for the process (default: a
//                                    quarter of physical memory; unlimited: all of it)
//   tidepool.log:off|warn|info|debug messages on stderr (default warn)
//   tidepool.device_backend:auto|cuda|host
//                                    the memory backend (default auto: cuda when a GPU is
//                                    present); host serves "device" memory from host RAM
//   tidepool.optimizer_hooks:on|off  tag optimizer state created in torch.optim step()
//                                    and prefetch/evict it around each step (default on)
//   tidepool.tier_min_bytes:BYTES    optimizer-state allocations smaller than this stay
//                                    in the caching allocator instead of a pointer-stable,
//                                    migratable range (default 1MiB; 0 routes every size;
//                                    see kDefaultTierMinBytes, Note [tier route] in
//                                    tier_routing.h)
// BYTES is a byte count with an optional unit as below (no percentage).
// SIZE is a byte count with an optional unit — B, KiB, MiB, GiB, TiB (powers of 1024) or
// KB, MB, GB, TB (powers of 1000), e.g. 4GiB, 1.5GiB, 65536 — or a percentage of the
// memory it budgets (device memory for state_budget, host RAM for pinned_budget), e.g. 25%.
// Naming any tidepool.* key turns tidepool on as backend:tidepool does. The keys may also
// be given in TIDEPOOL_ALLOC_CONF (tidepool keys only), which is also where a process
// that claimed them leaves them for its children (Note [inherited configuration]). An unknown
// tidepool.* key, a bad value, or a key given twice is a ConfigError naming the key and
// what it accepts; nothing is half-applied.
//
// Thread-safety: claim_config / config_to_json are pure. install_from_env and
// apply_config change process state (environment variables, the active configuration,
// the backend choice): call them once, at the start of main, before other threads run.
#pragma once

#include <stddef.h>

#include "allocator/export.h"

#ifdef __cplusplus
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tidepool {

enum class Mode : std::uint8_t { global, pool };
enum class LogLevel : std::uint8_t { off, warn, info, debug };
enum class DeviceBackendChoice : std::uint8_t { automatic, cuda, host };

// A memory budget: unset, an absolute byte count, or a fraction of the memory it limits.
struct TIDEPOOL_API Budget {
  enum class Kind : std::uint8_t { unset, bytes, fraction };
  Kind kind = Kind::unset;
  std::uint64_t bytes = 0;  // when kind == bytes
  double fraction = 0.0;    // when kind == fraction, in (0, 1]

  // Bytes this budget allows out of `total` bytes; `when_unset` if it is unset.
  std::uint64_t resolve(std::uint64_t total, std::uint64_t when_unset) const;
  friend bool operator==(const Budget&, const Budget&) = default;
};

// 1 MiB: a routed range is whole 2 MiB granules, so a request of s bytes occupies
// ceil(s / 2 MiB) granules. For s >= 1 MiB the rounding at most doubles the footprint (the
// worst case, s just above a granule boundary, wastes < s); below 1 MiB the waste grows
// without bound (a 4 KiB bias would take 2 MiB, 512x). Tensors under 1 MiB are biases and
// norm weights, a small fraction of any model's optimizer state, so leaving them on the
// device costs less than rounding them up and moving each of them every step.
inline constexpr std::uint64_t kDefaultTierMinBytes = std::uint64_t{1} << 20;

struct Config {
  bool enabled = false;  // backend:tidepool or any tidepool.* key was named
  Mode mode = Mode::global;
  Budget state_budget{Budget::Kind::bytes, 0, 0.0};
  Budget pinned_budget;  // unset: a quarter of physical memory (tiering/pinned_budget.h)
  LogLevel log = LogLevel::warn;
  DeviceBackendChoice device_backend = DeviceBackendChoice::automatic;
  bool optimizer_hooks = true;
  std::uint64_t tier_min_bytes = kDefaultTierMinBytes;
  friend bool operator==(const Config&, const Config&) = default;
};

struct ClaimResult {
  Config config;
  std::string remaining;  // the entries left for PyTorch, verbatim, comma-joined, in order
  std::string claimed;    // tidepool's entries, trimmed, comma-joined, in order
  std::string other_backend;  // X of a backend:X entry naming another allocator; or ""
  bool names_tidepool_backend = false;  // a backend:tidepool entry was given
  // PyTorch's expandable_segments:True is among the entries left for it (Note [expandable
  // segments] in config.cpp).
  bool expandable_segments = false;
};

// A configuration string tidepool cannot accept. what() names the variable (when known),
// the key, the value given, and what is allowed.
class TIDEPOOL_API ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Who turns tidepool on, which decides what another PyTorch backend:X means (Note [one
// backend] in config.cpp): the Python hook and C++ trainers put tidepool in the place of
// PyTorch's allocator (global mode) or beside it (pool mode), so backend:X for another
// allocator conflicts; the LD_PRELOAD shim serves the CUDA calls under whichever
// allocator PyTorch runs, so any backend:X is compatible with it.
enum class Installer { pytorch, preload_shim };

// Splits `conf` into tidepool's configuration and the string PyTorch should see.
// `source` names where the string came from, for error messages. Throws ConfigError.
TIDEPOOL_API ClaimResult claim_config(std::string_view conf,
                                      std::string_view source = "allocator configuration",
                                      Installer installer = Installer::pytorch);

// The configuration as a JSON object (what the Python package reads).
TIDEPOOL_API std::string config_to_json(const Config& config);

// Parses a SIZE value (see Note [tidepool keys]); throws ConfigError naming `key`.
TIDEPOOL_API Budget parse_budget(std::string_view key, std::string_view value);
// Parses a BYTES value (a SIZE without percentage); throws ConfigError naming `key`.
TIDEPOOL_API std::uint64_t parse_byte_count(std::string_view key, std::string_view value);

// Makes `config` the active configuration of this process: selects the backend (throws
// ConfigError when an allocator already exists with another backend), sets the tier
// route's size threshold (tier_routing.h), and stores the budgets and log level for the
// tiering layer to read through active_config().
TIDEPOOL_API void apply_config(const Config& config);

// The configuration last applied (a default, disabled Config before any).
TIDEPOOL_API Config active_config();

// For C++ trainers, the same start-up the Python hook does, in one call: reads
// PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF, claims the tidepool keys, rewrites the
// variables to what remains (unsets a variable left empty) so LibTorch accepts them,
// keeps the claimed keys in TIDEPOOL_ALLOC_CONF for child processes, and applies the
// configuration. When neither variable names tidepool, TIDEPOOL_ALLOC_CONF (tidepool
// keys only; inherited from a parent, or set by hand) is applied instead. Returns the
// configuration (enabled == false when nothing names tidepool; nothing is changed then).
// Throws ConfigError on a bad configuration, when both PyTorch variables name
// tidepool keys, or, for Installer::pytorch, when tidepool is turned on next to
// PyTorch's backend:X for another allocator (Note [one backend] in config.cpp), or next to
// an expandable_segments:True it cannot work with (Note [expandable segments]). Applying
// the same configuration again is harmless.
TIDEPOOL_API Config install_from_env(Installer installer = Installer::pytorch);

// What install_from_env would do, with every check it makes, changing nothing: the
// configuration (enabled == false when nothing names tidepool), and the PyTorch variable
// it would rewrite to `remaining` (nullptr when the configuration is the inherited
// TIDEPOOL_ALLOC_CONF's, or none), keeping `claimed` in TIDEPOOL_ALLOC_CONF. Throws
// ConfigError as install_from_env does.
struct EnvPlan {
  Config config;
  const char* variable = nullptr;
  std::string remaining;
  std::string claimed;
};
TIDEPOOL_API EnvPlan plan_from_env(Installer installer = Installer::pytorch);

}  // namespace tidepool

extern "C" {
#endif

/* ---- C ABI (Python package, LD_PRELOAD shim) -------------------------------------
 * Every function catches everything: errors come back as a negative status and a
 * NUL-terminated message in `error` (truncated to error_size). */

/* Claims the tidepool keys of `conf`. Writes the string left for PyTorch to `remaining`
 * and the configuration as JSON to `config_json`. Returns 1 when conf names tidepool,
 * 0 when it does not (remaining is then conf itself), -1 on a configuration error,
 * -2 when remaining_size or config_json_size is too small. */
TIDEPOOL_API int tidepool_config_claim(const char* conf, char* remaining, size_t remaining_size,
                                       char* config_json, size_t config_json_size, char* error,
                                       size_t error_size);
/* Claims the tidepool keys of `conf` and applies them (see tidepool::apply_config).
 * 0 on success, -1 on error. */
TIDEPOOL_API int tidepool_config_apply(const char* conf, char* error, size_t error_size);
/* The active configuration as JSON. Returns the length of the JSON text (without the
 * NUL); writes it when size is larger than that. */
TIDEPOOL_API size_t tidepool_config_active_json(char* out, size_t size);
/* tidepool::install_from_env(): 1 applied, 0 nothing names tidepool, -1 error. */
TIDEPOOL_API int tidepool_install_from_env(char* error, size_t error_size);
/* The same for the LD_PRELOAD shim (Installer::preload_shim): PyTorch's backend:X for
 * another allocator is no conflict there. */
TIDEPOOL_API int tidepool_install_from_env_for_preload(char* error, size_t error_size);
/* What the LD_PRELOAD shim's set-up would claim from the environment, checked with its
 * rules, changing nothing (tidepool::plan_from_env): writes the configuration as JSON to
 * config_json and returns 1 when the environment names tidepool, 0 when it does not, -1
 * on a configuration error (the message the shim would stop the process with), -2 when
 * config_json_size is too small. For the Python package, which raises it instead. */
TIDEPOOL_API int tidepool_config_plan_for_preload(char* config_json, size_t config_json_size,
                                                  char* error, size_t error_size);

#ifdef __cplusplus
}
#endif
