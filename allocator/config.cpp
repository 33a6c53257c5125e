// The configuration parser (see allocator/config.h, Note [tidepool keys]).
//
// PyTorch's allocator-configuration grammar is "key:value" entries separated by commas,
// where a value may hold a bracketed list with commas of its own
// ("roundup_power2_divisions:[256:1,512:2,>:8]"). The string is therefore split on
// commas at bracket depth zero; each entry is either tidepool's (claimed, parsed,
// validated) or PyTorch's (kept verbatim, in order). Parsing is pure and all-or-nothing:
// a bad entry throws before anything is applied.
#include "allocator/config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/json_text.h"
#include "allocator/tier_routing.h"

namespace tidepool {

namespace {

constexpr std::string_view kTidepoolPrefix = "tidepool.";

// What trim() takes off an entry; with the commas between entries, all a blank
// configuration string holds.
constexpr std::string_view kSpaces = " \t\n\r";

std::string_view trim(std::string_view s) {
  const auto is_space = [](char c) { return kSpaces.find(c) != std::string_view::npos; };
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Whether `conf` holds no entry at all: only spaces and commas.
bool blank(std::string_view conf) {
  return std::all_of(conf.begin(), conf.end(),
                     [](char c) { return c == ',' || kSpaces.find(c) != std::string_view::npos; });
}

// Splits on commas outside brackets. Throws on unbalanced brackets, which PyTorch would
// reject too, because a tidepool entry could otherwise be swallowed into a list.
std::vector<std::string_view> split_entries(std::string_view conf, std::string_view source) {
  std::vector<std::string_view> entries;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < conf.size(); ++i) {
    const char c = conf[i];
    if (c == '[') {
      ++depth;
    } else if (c == ']') {
      if (--depth < 0) {
        throw ConfigError(std::string(source) + ": unbalanced ']' at position " +
                          std::to_string(i) + " in '" + std::string(conf) + "'");
      }
    } else if (c == ',' && depth == 0) {
      entries.push_back(conf.substr(start, i - start));
      start = i + 1;
    }
  }
  if (depth != 0) {
    throw ConfigError(std::string(source) + ": unbalanced '[' in '" + std::string(conf) + "'");
  }
  entries.push_back(conf.substr(start));
  return entries;
}

[[noreturn]] void bad_value(std::string_view source, std::string_view key, std::string_view value,
                            std::string_view allowed) {
  const std::string where = source.empty() ? std::string() : std::string(source) + ": ";
  throw ConfigError(where + std::string(key) + ": '" + std::string(value) +
                    "' is not a valid value; allowed: " + std::string(allowed));
}

// One tidepool.* key: its name, the values it accepts (for messages), and how it sets
// the Config. A table rather than an if-chain so the list of keys in "unknown key"
// messages cannot drift from what is accepted. `set` throws InvalidChoice for a value
// outside a fixed list (claim_config words the message from `allowed`) or ConfigError
// with its own detail (sizes).
struct KeySpec {
  std::string_view name;
  std::string_view allowed;
  std::function<void(Config&, std::string_view value)> set;
};

struct InvalidChoice {};


template <typename T>
T pick(std::string_view value, std::initializer_list<std::pair<std::string_view, T>> choices) {
  for (const auto& [name, result] : choices) {
    if (value == name) return result;
  }
  throw InvalidChoice{};
}

const std::vector<KeySpec>& key_specs() {
  static const std::vector<KeySpec> specs = {
      {"tidepool.mode", "global, pool",
       [](Config& c, std::string_view v) {
         c.mode = pick<Mode>(v, {{"global", Mode::global}, {"pool", Mode::pool}});
       }},
      {"tidepool.state_budget", "a size (e.g. 0, 4GiB, 512MiB, 1000000) or a percentage (e.g. 25%)",
       [](Config& c, std::string_view v) {
         c.state_budget = parse_budget("tidepool.state_budget", v);
       }},
      {"tidepool.pinned_budget",
       "a size (e.g. 16GiB), a percentage of host RAM (e.g. 50%), or unlimited",
       [](Config& c, std::string_view v) {
         // unlimited: as much as the machine has (100% of RAM), not the built-in quarter
         // that an absent key gives: a user who writes it means "do not cap pinning".
         c.pinned_budget = v == "unlimited" ? Budget{Budget::Kind::fraction, 0, 1.0}
                                            : parse_budget("tidepool.pinned_budget", v);
       }},
      {"tidepool.log", "off, warn, info, debug",
       [](Config& c, std::string_view v) {
         c.log = pick<LogLevel>(v, {{"off", LogLevel::off},
                                    {"warn", LogLevel::warn},
                                    {"info", LogLevel::info},
                                    {"debug", LogLevel::debug}});
       }},
      {"tidepool.device_backend", "auto, cuda, host",
       [](Config& c, std::string_view v) {
         c.device_backend = pick<DeviceBackendChoice>(v, {{"auto", DeviceBackendChoice::automatic},
                                                          {"cuda", DeviceBackendChoice::cuda},
                                                          {"host", DeviceBackendChoice::host}});
       }},
      {"tidepool.optimizer_hooks", "on, off",
       [](Config& c, std::string_view v) {
         c.optimizer_hooks = pick<bool>(v, {{"on", true}, {"off", false}});
       }},
      {"tidepool.tier_min_bytes", "a byte count with an optional unit, e.g. 0, 1MiB, 262144",
       [](Config& c, std::string_view v) {
         c.tier_min_bytes = parse_byte_count("tidepool.tier_min_bytes", v);
       }},
  };
  return specs;
}

std::string join(const std::vector<std::string_view>& entries) {
  std::string out;
  for (std::size_t k = 0; k < entries.size(); ++k) {
    if (k != 0) out += ',';
    out += entries[k];
  }
  return out;
}

std::string known_keys() {
  std::string out = "backend:tidepool";
  for (const auto& spec : key_specs()) out += ", " + std::string(spec.name);
  return out;
}

const char* mode_name(Mode m) { return m == Mode::global ? "global" : "pool"; }

const char* log_name(LogLevel l) {
  switch (l) {
    case LogLevel::off: return "off";
    case LogLevel::warn: return "warn";
    case LogLevel::info: return "info";
    case LogLevel::debug: return "debug";
  }
  return "warn";
}

const char* backend_choice_name(DeviceBackendChoice b) {
  switch (b) {
    case DeviceBackendChoice::automatic: return "auto";
    case DeviceBackendChoice::cuda: return "cuda";
    case DeviceBackendChoice::host: return "host";
  }
  return "auto";
}

std::string budget_json(const Budget& b) {
  char buf[96];
  switch (b.kind) {
    case Budget::Kind::unset: return R"({"kind":"unset"})";
    case Budget::Kind::bytes:
      std::snprintf(buf, sizeof buf, R"({"kind":"bytes","bytes":%llu})",
                    static_cast<unsigned long long>(b.bytes));
      return buf;
    case Budget::Kind::fraction:
      return R"({"kind":"fraction","fraction":)" + json_number(b.fraction) + "}";
  }
  return R"({"kind":"unset"})";
}

std::mutex& active_mutex() {
  static std::mutex m;
  return m;
}
Config& active_storage() {
  static Config c;
  return c;
}

}  // namespace

// ---- budgets ------------------------------------------------------------------------

std::uint64_t Budget::resolve(std::uint64_t total, std::uint64_t when_unset) const {
  switch (kind) {
    case Kind::unset: return when_unset;
    case Kind::bytes: return bytes;
    case Kind::fraction:
      return static_cast<std::uint64_t>(std::floor(fraction * static_cast<double>(total)));
  }
  return when_unset;
}

namespace {

// A SIZE of Note [tidepool keys]; a percentage only when `allow_percent`.
Budget parse_size(std::string_view key, std::string_view value, bool allow_percent) {
  const std::string_view allowed =
      allow_percent
          ? "a byte count with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. "
            "4GiB, or a percentage, e.g. 25%"
          : "a byte count with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. "
            "1MiB; not a percentage";
  const std::string text(trim(value));
  // The number: digits with an optional fraction. strtod alone would accept "inf",
  // "0x10" and leading signs, none of which is a size, and would read "1.5" as 1 in a
  // locale with a decimal comma; from_chars reads the "C" form whatever the locale.
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  const std::size_t int_digits = i;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  }
  if (int_digits == 0) bad_value("", key, value, allowed);
  double number = 0.0;
  // digits[.digits] always parses; only its size can fail, beyond a double's range, which
  // leaves `number` at 0 (it was read as "0 bytes"): too large when a digit before the
  // point is not 0, else a fraction too small for a double, which is no whole byte count.
  if (std::from_chars(text.data(), text.data() + i, number).ec != std::errc{}) {
    const std::string_view whole = std::string_view(text).substr(0, int_digits);
    if (whole.find_first_not_of('0') != std::string_view::npos) {
      throw ConfigError(std::string(key) + ": '" + std::string(value) + "' is too large");
    }
    number = std::numeric_limits<double>::denorm_min();
  }
  const std::string_view unit = std::string_view(text).substr(i);

  if (unit == "%") {
    if (!allow_percent) bad_value("", key, value, allowed);
    if (!(number > 0.0 && number <= 100.0)) {
      throw ConfigError(std::string(key) + ": '" + std::string(value) +
                        "' is out of range; a percentage must be in (0%, 100%]");
    }
    return Budget{Budget::Kind::fraction, 0, number / 100.0};
  }
  struct Unit {
    std::string_view name;
    std::uint64_t multiplier;
  };
  static constexpr Unit units[] = {
      {"", 1},          {"B", 1},
      {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}, {"TiB", 1ull << 40},
      {"KB", 1000ull},     {"MB", 1000000ull},  {"GB", 1000000000ull}, {"TB", 1000000000000ull},
  };
  // 2^63: far beyond any memory, and exactly representable so the cast below is defined.
  constexpr std::uint64_t kTooLarge = 1ull << 63;
  const auto too_large = [&] {
    throw ConfigError(std::string(key) + ": '" + std::string(value) + "' is too large");
  };
  for (const Unit& u : units) {
    if (unit != u.name) continue;
    if (u.multiplier == 1 && i != int_digits) {
      throw ConfigError(std::string(key) + ": '" + std::string(value) +
                        "' is not a whole number of bytes; use a unit for fractions, e.g. 1.5GiB");
    }
    if (i == int_digits) {
      // A whole number is counted exactly: a double has 53 bits, so 9007199254740993
      // bytes read as one byte less.
      std::uint64_t whole = 0;
      std::uint64_t bytes = 0;
      if (std::from_chars(text.data(), text.data() + i, whole).ec != std::errc{} ||
          __builtin_mul_overflow(whole, u.multiplier, &bytes) || bytes >= kTooLarge) {
        too_large();
      }
      return Budget{Budget::Kind::bytes, bytes, 0.0};
    }
    const double bytes = std::floor(number * static_cast<double>(u.multiplier));
    if (bytes >= static_cast<double>(kTooLarge)) too_large();
    return Budget{Budget::Kind::bytes, static_cast<std::uint64_t>(bytes), 0.0};
  }
  bad_value("", key, value, allowed);
}

}  // namespace

Budget parse_budget(std::string_view key, std::string_view value) {
  return parse_size(key, value, /*allow_percent=*/true);
}

std::uint64_t parse_byte_count(std::string_view key, std::string_view value) {
  return parse_size(key, value, /*allow_percent=*/false).bytes;
}

// ---- claiming -------------------------------------------------------------------------

// Note [one backend]: any tidepool key turns tidepool on (global mode by default), so
// tidepool keys next to PyTorch's backend:X for another allocator X are a conflict,
// whether in one variable or in the one PyTorch reads (Note [the variable PyTorch
// reads]), or inherited in TIDEPOOL_ALLOC_CONF: global mode would quietly replace the allocator
// asked for, and pool mode cannot route to its MemPool on cudaMallocAsync (PyTorch
// refuses that), which would only show at the first optimizer step. Pool mode on
// backend:native is what pool mode is: PyTorch's own allocator with tidepool's pool.
// Under the LD_PRELOAD shim (Installer::preload_shim) there is no conflict: PyTorch's
// allocator, whichever it is, calls cudaMalloc or cudaMallocAsync, and the shim serves
// those from tidepool; only backend:tidepool next to another backend:X contradicts itself
// there. One rule, whether the two are in one string or in the two variables.
namespace {

bool conflicts_with_tidepool(const Config& config, bool names_tidepool_backend,
                             std::string_view other_backend, Installer installer) {
  if (other_backend.empty() || !config.enabled) return false;
  const bool pool_on_native = config.mode == Mode::pool && other_backend == "native";
  if (installer == Installer::pytorch) return !pool_on_native;
  return names_tidepool_backend;
}

// Note [expandable segments]: PyTorch's expandable_segments:True cannot stand next to
// tidepool in two cases, both refused at start-up rather than found later. Pool mode puts
// optimizer state in a torch.cuda.MemPool of PyTorch's own allocator, which refuses to
// allocate in a MemPool while expandable segments are on ("torch.cuda.MemPool doesn't
// currently support expandable_segments"): the run would fail at its first optimizer step.
// Under the LD_PRELOAD shim, PyTorch maps expandable segments with the driver's
// cuMemCreate and cuMemMap, which the shim does not interpose: tidepool would serve none
// of PyTorch's memory, silently. Global mode replaces PyTorch's allocator, which then never
// reads the key: no conflict. The key counts in the variable PyTorch reads (Note [the
// variable PyTorch reads]).
bool is_expandable_segments_on(std::string_view key, std::string_view value) {
  if (key != "expandable_segments" || value.size() != 4) return false;
  return std::equal(value.begin(), value.end(), "true", [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == b;
  });
}

// Why `config` cannot run next to expandable_segments:True; "" when it can.
std::string expandable_segments_conflict(const Config& config, Installer installer) {
  if (!config.enabled) return "";
  if (installer == Installer::preload_shim) {
    return "PyTorch then maps its memory with the driver's cuMemCreate, which the "
           "LD_PRELOAD shim does not see, so tidepool would serve none of it; drop "
           "expandable_segments:True";
  }
  if (config.mode == Mode::pool) {
    return "pool mode puts optimizer state in a torch.cuda.MemPool, and PyTorch does not "
           "support MemPools with expandable segments; drop expandable_segments:True or use "
           "tidepool.mode:global";
  }
  return "";
}

}  // namespace

ClaimResult claim_config(std::string_view conf, std::string_view source, Installer installer) {
  ClaimResult result;
  std::vector<std::string_view> seen;  // tidepool keys given so far (duplicates are errors)
  bool tidepool_backend = false;
  std::vector<std::string_view> kept;
  std::vector<std::string_view> taken;  // tidepool's entries, trimmed

  for (std::string_view entry : split_entries(conf, source)) {
    const std::string_view trimmed = trim(entry);
    const std::size_t colon = trimmed.find(':');
    const std::string_view key = trim(trimmed.substr(0, colon));
    const std::string_view value =
        colon == std::string_view::npos ? std::string_view{} : trim(trimmed.substr(colon + 1));

    if (key == "backend") {
      if (value == "tidepool") {
        if (tidepool_backend) {
          throw ConfigError(std::string(source) + ": backend:tidepool is given twice");
        }
        tidepool_backend = true;
        result.config.enabled = true;
        taken.push_back(trimmed);
        continue;
      }
      result.other_backend = std::string(value);
      kept.push_back(entry);
      continue;
    }
    const bool is_tidepool_key = key == "tidepool" || key.starts_with(kTidepoolPrefix);
    if (!is_tidepool_key) {
      // PyTorch's: verbatim. Blank entries are dropped, as the string is rewritten.
      if (!trimmed.empty()) kept.push_back(entry);
      if (is_expandable_segments_on(key, value)) result.expandable_segments = true;
      continue;
    }
    const auto spec = std::find_if(key_specs().begin(), key_specs().end(),
                                   [&](const KeySpec& s) { return s.name == key; });
    if (spec == key_specs().end()) {
      throw ConfigError(std::string(source) + ": unknown key '" + std::string(key) +
                        "'; tidepool keys are: " + known_keys());
    }
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      throw ConfigError(std::string(source) + ": " + std::string(key) + " is given twice");
    }
    if (colon == std::string_view::npos || value.empty()) {
      throw ConfigError(std::string(source) + ": " + std::string(key) +
                        " needs a value (key:value); allowed: " + std::string(spec->allowed));
    }
    seen.push_back(key);
    try {
      spec->set(result.config, value);
    } catch (const InvalidChoice&) {
      bad_value(source, key, value, spec->allowed);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string(source) + ": " + e.what());
    }
    result.config.enabled = true;
    taken.push_back(trimmed);
  }
  result.names_tidepool_backend = tidepool_backend;
  if (conflicts_with_tidepool(result.config, tidepool_backend, result.other_backend, installer)) {
    throw ConfigError(std::string(source) + ": " +
                      std::string(tidepool_backend ? "backend:tidepool" : taken.front()) +
                      " conflicts with 'backend:" + result.other_backend + "'; name one backend");
  }
  if (result.expandable_segments) {
    const std::string why = expandable_segments_conflict(result.config, installer);
    if (!why.empty()) {
      throw ConfigError(std::string(source) + ": tidepool conflicts with " +
                        "'expandable_segments:True': " + why);
    }
  }
  result.remaining = join(kept);
  result.claimed = join(taken);
  if (!result.config.enabled) result.remaining = std::string(conf);
  return result;
}

std::string config_to_json(const Config& c) {
  std::string out = "{";
  out += std::string(R"("enabled":)") + (c.enabled ? "true" : "false");
  out += std::string(R"(,"mode":")") + mode_name(c.mode) + '"';
  out += R"(,"state_budget":)" + budget_json(c.state_budget);
  out += R"(,"pinned_budget":)" + budget_json(c.pinned_budget);
  out += std::string(R"(,"log":")") + log_name(c.log) + '"';
  out += std::string(R"(,"device_backend":")") + backend_choice_name(c.device_backend) + '"';
  out += std::string(R"(,"optimizer_hooks":)") + (c.optimizer_hooks ? "true" : "false");
  out += R"(,"tier_min_bytes":)" + std::to_string(c.tier_min_bytes);
  out += '}';
  return out;
}

// ---- applying -------------------------------------------------------------------------

void apply_config(const Config& config) {
  if (config.device_backend != DeviceBackendChoice::automatic) {
    const char* name = backend_choice_name(config.device_backend);
    // Re-applying the backend in use is a no-op (an inherited configuration applied by
    // both the LD_PRELOAD shim and the Python hook, say), not an error. Asked without
    // resolving "auto": that would initialise CUDA for a host configuration (and read a
    // TIDEPOOL_BACKEND the configuration overrides, leaving its error behind).
    if (const std::optional<BackendKind> in_use = backend_in_use()) {
      const char* used = *in_use == BackendKind::cuda ? "cuda" : "host";
      if (std::strcmp(used, name) != 0) {
        throw ConfigError(std::string("tidepool.device_backend:") + name +
                          " cannot be applied: tidepool's allocators already use the " + used +
                          " backend (apply the configuration before the first allocation)");
      }
    } else if (tidepool_set_backend(name) != 0) {
      throw ConfigError(std::string("tidepool.device_backend:") + name +
                        " cannot be applied: " + tidepool_last_error() +
                        " (apply the configuration before the first allocation)");
    }
  }
  std::lock_guard lock(active_mutex());
  active_storage() = config;
  set_tier_min_bytes(static_cast<std::size_t>(config.tier_min_bytes));
}

Config active_config() {
  std::lock_guard lock(active_mutex());
  return active_storage();
}

// Note [inherited configuration]: PyTorch's variables lose their tidepool keys in the
// process that claims them, but child processes (torchrun's workers, multiprocessing)
// must get tidepool too. So the claimed entries are kept in TIDEPOOL_ALLOC_CONF, which
// children inherit and install_from_env reads when PyTorch's variables name no tidepool
// key (those win when they do). Users may set it directly as well.
constexpr const char* kInheritedVariable = "TIDEPOOL_ALLOC_CONF";

// Note [the variable PyTorch reads]: PYTORCH_ALLOC_CONF is PyTorch's current name,
// PYTORCH_CUDA_ALLOC_CONF the older one, and PyTorch 2.11 reads one of them: the older
// whenever it is set, even empty, and the current one only when it is not (checked with
// torch.cuda.get_allocator_backend()). tidepool's keys are honoured in either (in both
// would leave it ambiguous which wins). What PyTorch's allocator will do is decided by
// the one it reads, so the checks against it (another backend, expandable segments) look
// at that one alone (the order is 2.11's: releases around 2.9 read PYTORCH_ALLOC_CONF
// first for some keys; torch is pinned to 2.11 here); and a claim that empties
// PYTORCH_CUDA_ALLOC_CONF leaves it set, empty, when PYTORCH_ALLOC_CONF is set, which
// PyTorch would otherwise start reading (review finding: unset, it made PyTorch take up
// keys it had been ignoring, and a backend there was refused as a conflict with
// tidepool).
namespace {

constexpr const char* kOlderVariable = "PYTORCH_CUDA_ALLOC_CONF";
constexpr const char* kCurrentVariable = "PYTORCH_ALLOC_CONF";

std::string_view variable_pytorch_reads() {
  return std::getenv(kOlderVariable) != nullptr ? kOlderVariable : kCurrentVariable;
}

}  // namespace

EnvPlan plan_from_env(Installer installer) {
  static constexpr const char* kVariables[] = {kCurrentVariable, kOlderVariable};
  const std::string_view pytorch_reads = variable_pytorch_reads();
  struct Claimed {
    const char* variable;
    ClaimResult result;
  };
  std::vector<Claimed> named;
  Claimed other{nullptr, {}};  // a variable naming only another backend (Note [one backend])
  const char* expandable = nullptr;  // a variable with expandable_segments:True
  for (const char* variable : kVariables) {
    const char* value = std::getenv(variable);
    if (value == nullptr) continue;
    ClaimResult r = claim_config(value, variable, installer);
    const bool read = variable == pytorch_reads;  // Note [the variable PyTorch reads]
    if (read && r.expandable_segments) expandable = variable;
    if (r.config.enabled) {
      named.push_back({variable, std::move(r)});
    } else if (read && !r.other_backend.empty()) {
      other = {variable, std::move(r)};
    }
  }
  const auto check_one_backend = [&](const ClaimResult& claimed, const std::string& source) {
    if (other.variable != nullptr &&
        conflicts_with_tidepool(claimed.config, claimed.names_tidepool_backend,
                                other.result.other_backend, installer)) {
      throw ConfigError(source + " turns tidepool on, which conflicts with 'backend:" +
                        other.result.other_backend + "' in " + other.variable +
                        "; name one backend");
    }
    // Note [expandable segments], across the two variables (one string: claim_config).
    if (expandable != nullptr) {
      const std::string why = expandable_segments_conflict(claimed.config, installer);
      if (!why.empty()) {
        throw ConfigError(source + " turns tidepool on, which conflicts with "
                          "'expandable_segments:True' in " + expandable + ": " + why);
      }
    }
  };
  if (named.size() > 1) {
    throw ConfigError(std::string("tidepool keys are set in both ") + named[0].variable + " and " +
                      named[1].variable + "; put them in one of the two");
  }
  EnvPlan plan;
  if (named.empty()) {
    // Note [inherited configuration]: a parent that claimed the keys left them here.
    // Blank (whitespace and commas only, what trim() and the split drop) is unset: a
    // launcher's way of saying "off" (review finding: it stopped every `import torch` as
    // a leftover that is no tidepool key).
    const char* inherited = std::getenv(kInheritedVariable);
    if (inherited == nullptr || blank(inherited)) return plan;
    const ClaimResult r = claim_config(inherited, kInheritedVariable, installer);
    if (!r.remaining.empty()) {
      throw ConfigError(std::string(kInheritedVariable) + " holds tidepool keys only; '" +
                        r.remaining + "' belongs in PYTORCH_ALLOC_CONF");
    }
    check_one_backend(r, std::string(kInheritedVariable) +
                                    " (inherited from a parent process, or set by hand; unset "
                                    "it to run without tidepool)");
    plan.config = r.config;
    return plan;
  }
  const Claimed& claimed = named.front();
  check_one_backend(claimed.result, claimed.variable);
  plan.config = claimed.result.config;
  plan.variable = claimed.variable;
  plan.remaining = claimed.result.remaining;
  plan.claimed = claimed.result.claimed;
  return plan;
}

Config install_from_env(Installer installer) {
  const EnvPlan plan = plan_from_env(installer);
  if (!plan.config.enabled) return plan.config;
  apply_config(plan.config);
  if (plan.variable == nullptr) return plan.config;  // inherited: nothing to rewrite
  // Note [the variable PyTorch reads]: emptied, the older name stays set (empty) while
  // the current one is set, so that PyTorch goes on reading the one it read.
  const bool keep_empty =
      std::string_view(plan.variable) == kOlderVariable && std::getenv(kCurrentVariable) != nullptr;
  if (plan.remaining.empty() && !keep_empty) {
    ::unsetenv(plan.variable);
  } else {
    ::setenv(plan.variable, plan.remaining.c_str(), 1);
  }
  ::setenv(kInheritedVariable, plan.claimed.c_str(), 1);
  return plan.config;
}

}  // namespace tidepool

// ---- C ABI ------------------------------------------------------------------------------

namespace {

// Copies `text` into `out` (NUL-terminated). False when it does not fit; a truncated
// copy is still written so an error buffer always holds the start of the message.
bool write_c_string(std::string_view text, char* out, std::size_t size) {
  if (out == nullptr || size == 0) return false;
  const std::size_t n = std::min(text.size(), size - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
  return n == text.size();
}

int report(const std::exception& e, char* error, std::size_t error_size) {
  write_c_string(e.what(), error, error_size);
  return -1;
}

// tidepool_install_from_env and its LD_PRELOAD form.
int install_from_env_for(tidepool::Installer installer, char* error, size_t error_size) {
  try {
    const tidepool::Config c = tidepool::install_from_env(installer);
    write_c_string("", error, error_size);
    return c.enabled ? 1 : 0;
  } catch (const std::exception& e) {
    return report(e, error, error_size);
  }
}

}  // namespace

extern "C" {

int tidepool_config_claim(const char* conf, char* remaining, size_t remaining_size,
                          char* config_json, size_t config_json_size, char* error,
                          size_t error_size) {
  try {
    if (conf == nullptr) throw tidepool::ConfigError("tidepool_config_claim: conf is NULL");
    const tidepool::ClaimResult r = tidepool::claim_config(conf);
    const bool fits = write_c_string(r.remaining, remaining, remaining_size) &
                      write_c_string(tidepool::config_to_json(r.config), config_json,
                                     config_json_size);
    if (!fits) {
      write_c_string("tidepool_config_claim: output buffer too small", error, error_size);
      return -2;
    }
    write_c_string("", error, error_size);
    return r.config.enabled ? 1 : 0;
  } catch (const std::exception& e) {
    return report(e, error, error_size);
  }
}

int tidepool_config_apply(const char* conf, char* error, size_t error_size) {
  try {
    if (conf == nullptr) throw tidepool::ConfigError("tidepool_config_apply: conf is NULL");
    tidepool::apply_config(tidepool::claim_config(conf).config);
    write_c_string("", error, error_size);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_size);
  }
}

size_t tidepool_config_active_json(char* out, size_t size) {
  try {
    const std::string json = tidepool::config_to_json(tidepool::active_config());
    if (size > json.size()) write_c_string(json, out, size);
    return json.size();
  } catch (...) {
    return 0;
  }
}

int tidepool_install_from_env(char* error, size_t error_size) {
  return install_from_env_for(tidepool::Installer::pytorch, error, error_size);
}

int tidepool_install_from_env_for_preload(char* error, size_t error_size) {
  return install_from_env_for(tidepool::Installer::preload_shim, error, error_size);
}

int tidepool_config_plan_for_preload(char* config_json, size_t config_json_size, char* error,
                                     size_t error_size) {
  try {
    const tidepool::EnvPlan plan = tidepool::plan_from_env(tidepool::Installer::preload_shim);
    if (!write_c_string(tidepool::config_to_json(plan.config), config_json, config_json_size)) {
      write_c_string("tidepool_config_plan_for_preload: output buffer too small", error,
                     error_size);
      return -2;
    }
    write_c_string("", error, error_size);
    return plan.config.enabled ? 1 : 0;
  } catch (const std::exception& e) {
    return report(e, error, error_size);
  }
}

}  // extern "C"
