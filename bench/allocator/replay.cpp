// tidepool_replay: replays recorded allocation traces through tidepool's caching allocator
// and reports fragmentation and cost.
//
//   tidepool_replay [--backend host|cuda] [--capacity-gib N] [--plain] [--slot-mib N]
//                   [--create-us F] [--map-us F] [--unmap-us F] [--prefer-backed-fit]
//                   [--recycle-slack F] [--move-slack F] [--repeat N] TRACE.csv...
//
// A trace (shared/traces/*.csv) is `t_us,op,id,size,stream` per line, op a = alloc,
// f = free, id pairing an alloc with its free; lines starting with '#' are comments.
// For each trace the replay runs, in the same process, the allocator with:
//   - its default options;
//   - moves of free runs off (Note [Moving free runs] in allocator/segments.cpp), to show
//     what they buy;
//   - with --recycle-slack F: also recycling free runs through the backend at that slack;
//   - the baseline: every release to the backend and every unmap disabled (allow_release
//     and move_free_runs off), so nothing that was backed ever moves or goes back.
// It prints peak reserved, peak live (from the trace), their ratio, the allocator's own
// time per operation, the backend calls it made and the operation during which the last
// one that got, gave back, mapped or unmapped memory was made (the calls come while the
// working set grows: GPT-2's trace makes none after its fourth step), and two modeled
// times, then a verdict against the targets: ratio <= 1.03, time <= 1.1x the baseline's —
// the wall time on the cuda backend (real driver calls, measured in the run), the modeled
// time at the H200's measured call costs on the host backend.
//
// Cost model. The backend is wrapped in a counting layer (CountingBackend below), so the
// calls are counted at the seam, not from the allocator's own bookkeeping, and the time
// spent inside the backend is measured and taken out of the allocator's time (the host
// backend's memfd/mmap calls are not what a GPU charges). The modeled time is then the
// allocator's own time plus, per call:
//   - device_alloc / device_free (plain segments): what a cudaMalloc / cudaFree costs on
//     the H200, 65-450 us, 200 us as the central figure (the issue's figures);
//   - create_physical / release_physical (expandable segments): in the issue's model, as
//     cudaMalloc / cudaFree above; in the measured-cost model, --create-us, default
//     16.8 us, what cuMemCreate measured on the H200 (2026-12-04; cuMemRelease was not
//     measured apart and is charged the same);
//   - map / unmap: --map-us / --unmap-us, default 37 / 23 us: the mean cost this tool
//     measured for tidepool's cuda backend on one H200 (driver 580.159, CUDA 13.0;
//     map = cuMemMap + cuMemSetAccess, unmap = cuMemUnmap) replaying these traces. The
//     backend's measured mean cost per call is printed with every run (real driver calls
//     with --backend cuda; memfd/mmap calls on the host backend).
// The host verdict judges the measured-cost model. The issue's model charged each
// cuMemCreate 12x what it costs, so a move (an unmap and a map instead of a create and a
// map) looked like a saving: it passed GPT-2's trace at 1.04x while the H200's wall time
// for the same replay was 1.23x the baseline (2026-11-29). Both are printed.
// --slot-mib: AllocatorOptions::map_slot_bytes; --prefer-backed-fit: its prefer_backed_fit;
// --move-slack: its move_slack (each in every row). --capacity-gib: the host backend's
// emulated capacity (default 64; pages are never touched). Exit status 3 when the
// default configuration misses a target.
//
// The replay never writes to the memory it gets, so the host backend's pages stay
// untouched and a trace peaking at several GiB replays on a small machine.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"

namespace {

struct Op {
  bool alloc;
  std::uint32_t slot;  // dense index of the trace id
  std::size_t size;
  std::uint32_t stream;  // dense index of the trace stream
};

struct Trace {
  std::vector<Op> ops;
  std::size_t slots = 0;
  std::size_t streams = 0;
  std::size_t peak_live = 0;  // bytes, as requested
};

Trace load_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open trace " + path);
  Trace t;
  std::unordered_map<std::string, std::uint32_t> ids;
  std::unordered_map<std::string, std::uint32_t> streams;
  std::vector<std::size_t> live_size;
  std::vector<bool> freed;  // per slot
  std::size_t live = 0;
  std::string line;
  std::size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    std::stringstream ss(line);
    std::string time, op, id, size, stream;
    if (!std::getline(ss, time, ',') || !std::getline(ss, op, ',') || !std::getline(ss, id, ',') ||
        !std::getline(ss, size, ',') || !std::getline(ss, stream, ','))
      throw std::runtime_error(path + ":" + std::to_string(line_no) + ": expected 5 fields");
    Op o{};
    o.alloc = op == "a";
    if (!o.alloc && op != "f")
      throw std::runtime_error(path + ":" + std::to_string(line_no) + ": op must be a or f");
    // A whole number of bytes: stoull reads "-5" as 2^64 - 5 and stops at "12x".
    const auto bad_size = [&] {
      return std::runtime_error(path + ":" + std::to_string(line_no) + ": size '" + size +
                                "' is not a number of bytes");
    };
    if (size.empty() || size.find_first_not_of("0123456789") != std::string::npos)
      throw bad_size();
    try {
      o.size = std::stoull(size);
    } catch (const std::out_of_range&) {
      throw bad_size();
    }
    auto [sit, snew] = streams.emplace(stream, static_cast<std::uint32_t>(streams.size()));
    o.stream = sit->second;
    if (o.alloc) {
      auto [it, fresh] = ids.emplace(id, static_cast<std::uint32_t>(ids.size()));
      if (!fresh)
        throw std::runtime_error(path + ":" + std::to_string(line_no) + ": id " + id +
                                 " allocated twice");
      o.slot = it->second;
      live_size.push_back(o.size);
      freed.push_back(false);
      live += o.size;
      t.peak_live = std::max(t.peak_live, live);
    } else {
      auto it = ids.find(id);
      if (it == ids.end())
        throw std::runtime_error(path + ":" + std::to_string(line_no) +
                                 ": free of unknown id " + id);
      o.slot = it->second;
      // Freed twice would take its bytes off `live` again: it wraps, and the ratio of
      // peak reserved to a peak live of ~2^64 passed any trace.
      if (freed[o.slot])
        throw std::runtime_error(path + ":" + std::to_string(line_no) + ": id " + id +
                                 " freed twice");
      freed[o.slot] = true;
      live -= live_size[o.slot];
    }
    t.ops.push_back(o);
  }
  t.slots = ids.size();
  t.streams = streams.size();
  return t;
}

// Forwards every call to the real backend, counting the calls that get or give memory
// and the time spent in them.
class CountingBackend final : public tidepool::Backend {
 public:
  enum Call { alloc, free, create, release, map, unmap, synchronize, kCalls };
  static constexpr const char* kNames[kCalls] = {"device_alloc", "device_free",
                                                 "create_physical", "release_physical",
                                                 "map", "unmap", "stream_synchronize"};
  struct Counts {
    std::array<std::uint64_t, kCalls> calls{};
    std::array<double, kCalls> ns{};
    // 1 + the index of the trace operation during which the last call that gets, gives
    // back, maps or unmaps memory was made (0: none): after it the replay ran on what
    // it held, so the costs above were paid while the working set grew, not per step.
    std::size_t last_memory_call_op = 0;
    double total_ns() const {
      double t = 0;
      for (double v : ns) t += v;
      return t;
    }
  };

  explicit CountingBackend(std::unique_ptr<tidepool::Backend> inner)
      : Backend(inner->kind(), inner->device(), inner->granularity()), inner_(std::move(inner)) {}
  const Counts& counts() const { return counts_; }
  // The replay loop's operation index, read when a memory call is counted.
  void follow_ops(const std::size_t* op_index) { op_index_ = op_index; }

 private:
  template <class Fn>
  auto timed(Call c, Fn&& fn) {
    const auto start = std::chrono::steady_clock::now();
    struct Stop {
      Counts& counts;
      Call c;
      std::chrono::steady_clock::time_point start;
      const std::size_t* op_index;
      ~Stop() {
        if (c != synchronize && op_index != nullptr) counts.last_memory_call_op = *op_index + 1;
        ++counts.calls[c];
        counts.ns[c] += std::chrono::duration<double, std::nano>(
                            std::chrono::steady_clock::now() - start)
                            .count();
      }
    } stop{counts_, c, start, op_index_};
    return fn();
  }

  void* do_device_alloc(std::size_t n) override {
    return timed(alloc, [&] { return inner_->device_alloc(n); });
  }
  void do_device_free(void* p, std::size_t n) override {
    timed(free, [&] { inner_->device_free(p, n); });
  }
  tidepool::MemInfo do_mem_info() override { return inner_->mem_info(); }
  tidepool::Stream do_create_stream() override { return inner_->create_stream(); }
  void do_destroy_stream(tidepool::Stream s) override { inner_->destroy_stream(s); }
  void do_stream_synchronize(tidepool::Stream s) override {
    timed(synchronize, [&] { inner_->stream_synchronize(s); });
  }
  void do_device_synchronize() override { inner_->device_synchronize(); }
  tidepool::Event do_create_event() override { return inner_->create_event(); }
  void do_destroy_event(tidepool::Event e) override { inner_->destroy_event(e); }
  void do_record_event(tidepool::Event e, tidepool::Stream s) override {
    inner_->record_event(e, s);
  }
  bool do_event_query(tidepool::Event e) override { return inner_->event_query(e); }
  void do_event_synchronize(tidepool::Event e) override { inner_->event_synchronize(e); }
  void do_stream_wait_event(tidepool::Stream s, tidepool::Event e) override {
    inner_->stream_wait_event(s, e);
  }
  float do_event_elapsed_ms(tidepool::Event a, tidepool::Event b) override {
    return inner_->event_elapsed_ms(a, b);
  }
  void do_copy_async(void* d, const void* s, std::size_t n, tidepool::CopyKind k,
                     tidepool::Stream st) override {
    inner_->copy_async(d, s, n, k, st);
  }
  void do_memset_async(void* d, int v, std::size_t n, tidepool::Stream s) override {
    inner_->memset_async(d, v, n, s);
  }
  void do_launch_host_func(tidepool::Stream s, void (*fn)(void*), void* arg) override {
    inner_->launch_host_func(s, fn, arg);
  }
  void do_host_register(void* p, std::size_t n) override { inner_->host_register(p, n); }
  void do_host_unregister(void* p) override { inner_->host_unregister(p); }
  void* do_reserve_address(std::size_t n) override { return inner_->reserve_address(n); }
  void do_release_address(void* va, std::size_t n) override { inner_->release_address(va, n); }
  tidepool::PhysicalHandle do_create_physical(std::size_t n,
                                              tidepool::MemoryLocation where) override {
    return timed(create, [&] { return inner_->create_physical(n, where); });
  }
  void do_release_physical(tidepool::PhysicalHandle h, std::size_t n) override {
    timed(release, [&] { inner_->release_physical(h, n); });
  }
  void do_map(void* va, std::size_t n, tidepool::PhysicalHandle h) override {
    timed(map, [&] { inner_->map(va, n, h); });
  }
  void do_unmap(void* va, std::size_t n) override {
    timed(unmap, [&] { inner_->unmap(va, n); });
  }
  void do_grant_peer_access(void*, std::size_t, const std::vector<int>& peers) override {
    for (const int peer : peers) inner_->enable_peer_access(peer);  // the inner maps are real
  }
  bool do_peer_has_access(const void* a, int peer) override {
    return inner_->peer_has_access(a, peer);
  }

  std::unique_ptr<tidepool::Backend> inner_;
  Counts counts_;
  const std::size_t* op_index_ = nullptr;
};

struct Settings {
  std::string backend = "host";
  std::size_t capacity = std::size_t{64} << 30;
  bool expandable = true;
  int repeat = 5;
  double recycle_slack = -1;  // < 0: no recycling row
  std::size_t slot_mib = 0;   // 0: the allocator's default slot
  double create_us = 16.8;    // measured-cost model: one create/release (H200 cuMemCreate)
  double map_us = 37;         // modeled cost of one map call (H200 measurement)
  double unmap_us = 23;       // modeled cost of one unmap call (H200 measurement)
  bool prefer_backed_fit = false;
  double move_slack = -2;     // < -1: the allocator's default
};

struct Result {
  std::size_t peak_reserved = 0;
  CountingBackend::Counts backend;
  tidepool::MappingStats mapping;
  double wall_ns = 0;       // the whole replay, backend calls included
  double allocator_ns = 0;  // wall_ns less the time spent in backend calls
  // The allocator's own time plus each backend call at its modeled cost: plain segments'
  // allocs and frees at `segment_us`, physical handles' creates and releases at
  // `create_us`, maps and unmaps at the settings' costs.
  double modeled_ms(double segment_us, double create_us, const Settings& s) const {
    using C = CountingBackend;
    const auto n = [&](C::Call c) { return static_cast<double>(backend.calls[c]); };
    const double calls_us = (n(C::alloc) + n(C::free)) * segment_us +
                            (n(C::create) + n(C::release)) * create_us +
                            n(C::map) * s.map_us + n(C::unmap) * s.unmap_us;
    return (allocator_ns + calls_us * 1e3) / 1e6;
  }
  // The issue's model: every call that gets or gives back memory costs a cudaMalloc.
  double issue_modeled_ms(double segment_us, const Settings& s) const {
    return modeled_ms(segment_us, segment_us, s);
  }
  // The H200's measured costs for the VMM calls, the issue's central figure for cudaMalloc.
  double measured_cost_ms(const Settings& s) const { return modeled_ms(200, s.create_us, s); }
};

std::unique_ptr<tidepool::Backend> make_backend(const Settings& s) {
  if (s.backend == "cuda") return tidepool::make_cuda_backend(0);
  tidepool::HostBackendOptions o;
  o.capacity_bytes = s.capacity;
  return tidepool::make_host_backend(0, o);
}

Result replay_once(const Trace& t, const Settings& s, const tidepool::AllocatorOptions& options) {
  auto counting = std::make_unique<CountingBackend>(make_backend(s));
  CountingBackend* backend = counting.get();
  tidepool::CachingAllocator alloc(std::move(counting), options);
  std::vector<tidepool::Stream> streams(t.streams);
  for (std::size_t i = 1; i < t.streams; ++i) streams[i] = alloc.backend().create_stream();
  std::vector<void*> ptrs(t.slots, nullptr);
  std::vector<std::size_t> sizes(t.slots, 0);
  const CountingBackend::Counts before = backend->counts();
  std::size_t op_index = 0;
  backend->follow_ops(&op_index);
  const auto start = std::chrono::steady_clock::now();
  for (; op_index < t.ops.size(); ++op_index) {
    const Op& o = t.ops[op_index];
    if (o.alloc) {
      ptrs[o.slot] = alloc.allocate(o.size, streams[o.stream]);
      sizes[o.slot] = o.size;
    } else {
      alloc.deallocate(ptrs[o.slot], sizes[o.slot], streams[o.stream]);
      ptrs[o.slot] = nullptr;
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  backend->follow_ops(nullptr);  // the clean-up below is not the trace's
  Result r;
  r.peak_reserved = alloc.stats().reserved.peak;
  r.mapping = alloc.mapping_stats();
  r.backend = backend->counts();
  for (std::size_t c = 0; c < CountingBackend::kCalls; ++c) {
    r.backend.calls[c] -= before.calls[c];
    r.backend.ns[c] -= before.ns[c];
  }
  r.wall_ns = std::chrono::duration<double, std::nano>(stop - start).count();
  r.allocator_ns = r.wall_ns - r.backend.total_ns();
  for (std::size_t i = 0; i < t.slots; ++i)
    if (ptrs[i] != nullptr) alloc.deallocate(ptrs[i], sizes[i], {});
  for (std::size_t i = 1; i < t.streams; ++i) alloc.backend().destroy_stream(streams[i]);
  return r;
}

// Replays every configuration `repeat` times, interleaved so that load from other
// processes spreads evenly over them. Deterministic figures from the first run; the
// fastest allocator time and, apart from it, the fastest wall time of all runs (the wall
// time is what the cuda verdict judges: taken from the run with the least allocator time,
// it was one noisy run's, chosen by another figure).
std::vector<Result> replay_all(const Trace& t, const Settings& s,
                               const std::vector<tidepool::AllocatorOptions>& configs) {
  std::vector<Result> best;
  for (const auto& options : configs) best.push_back(replay_once(t, s, options));
  for (int i = 1; i < s.repeat; ++i) {
    for (std::size_t c = 0; c < configs.size(); ++c) {
      const Result r = replay_once(t, s, configs[c]);
      best[c].allocator_ns = std::min(best[c].allocator_ns, r.allocator_ns);
      best[c].wall_ns = std::min(best[c].wall_ns, r.wall_ns);
    }
  }
  return best;
}

double gib(std::size_t b) { return static_cast<double>(b) / double(1 << 30); }

void print_row(const char* name, const Trace& t, const Result& r, const Settings& s) {
  using C = CountingBackend;
  const auto& n = r.backend.calls;
  std::printf("  %-20s peak reserved %7.3f GiB  ratio %6.4f  %5.0f ns/op  +%llu/-%llu segments"
              "  map %llu unmap %llu (moved %llu, %llu syncs)  modeled %6.1f ms at measured "
              "costs, %6.1f ms (%.1f .. %.1f) in the issue's model  wall %.1f ms\n",
              name, gib(r.peak_reserved),
              static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_live),
              r.allocator_ns / static_cast<double>(t.ops.size()),
              static_cast<unsigned long long>(n[C::alloc] + n[C::create]),
              static_cast<unsigned long long>(n[C::free] + n[C::release]),
              static_cast<unsigned long long>(n[C::map]),
              static_cast<unsigned long long>(n[C::unmap]),
              static_cast<unsigned long long>(r.mapping.runs_moved),
              static_cast<unsigned long long>(r.mapping.move_syncs),
              r.measured_cost_ms(s), r.issue_modeled_ms(200, s), r.issue_modeled_ms(65, s),
              r.issue_modeled_ms(450, s), r.wall_ns / 1e6);
  std::printf("  %-20s last memory call (get, give back, map, unmap) in op %zu of %zu: %s\n", "",
              r.backend.last_memory_call_op, t.ops.size(),
              r.backend.last_memory_call_op < t.ops.size() ? "none after it, steps that follow "
                                                             "pay none of these costs"
                                                           : "the trace ends with one");
  if (r.mapping.map_calls != n[C::map] || r.mapping.unmap_calls != n[C::unmap])
    std::printf("  WARNING: the allocator counted %llu maps / %llu unmaps, the backend saw "
                "%llu / %llu\n",
                static_cast<unsigned long long>(r.mapping.map_calls),
                static_cast<unsigned long long>(r.mapping.unmap_calls),
                static_cast<unsigned long long>(n[C::map]),
                static_cast<unsigned long long>(n[C::unmap]));
}

// Mean measured cost of each backend call kind over all rows (real driver calls on cuda).
void print_backend_costs(const std::vector<const Result*>& rows, const Settings& s) {
  std::printf("  backend %s, measured mean us per call:", s.backend.c_str());
  for (std::size_t c = 0; c < CountingBackend::kCalls; ++c) {
    std::uint64_t calls = 0;
    double ns = 0;
    for (const Result* r : rows) {
      calls += r->backend.calls[c];
      ns += r->backend.ns[c];
    }
    if (calls != 0)
      std::printf(" %s %.1f (%llu)", CountingBackend::kNames[c], ns / 1e3 / double(calls),
                  static_cast<unsigned long long>(calls));
  }
  std::printf("\n  model: the allocator's own time (backend calls taken out) + device_alloc/free "
              "at 200 us + create/release_physical at %.1f us (the issue's model: 200 us, "
              "65 .. 450) + map at %.1f us + unmap at %.1f us (H200 measurements by "
              "default)\n",
              s.create_us, s.map_us, s.unmap_us);
}

int usage() {
  std::fprintf(stderr,
               "usage: tidepool_replay [--backend host|cuda] [--capacity-gib N] [--plain] "
               "[--slot-mib N] [--create-us F] [--map-us F] [--unmap-us F] [--prefer-backed-fit] "
               "[--recycle-slack F] [--move-slack F] "
               "[--repeat N] "
               "TRACE.csv...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::vector<std::string> traces;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--backend" && has_value) {
        s.backend = argv[++i];
        if (s.backend != "host" && s.backend != "cuda") return usage();
      } else if (a == "--capacity-gib" && has_value) {
        s.capacity = static_cast<std::size_t>(std::stoull(argv[++i])) << 30;
      } else if (a == "--prefer-backed-fit") {
        s.prefer_backed_fit = true;
      } else if (a == "--plain") {
        s.expandable = false;
      } else if (a == "--recycle-slack" && has_value) {
        s.recycle_slack = std::stod(argv[++i]);
      } else if (a == "--move-slack" && has_value) {
        s.move_slack = std::stod(argv[++i]);
        if (s.move_slack < -1) return usage();  // -1: move whenever a free slot exists
      } else if (a == "--slot-mib" && has_value) {
        s.slot_mib = static_cast<std::size_t>(std::stoull(argv[++i]));
      } else if (a == "--create-us" && has_value) {
        s.create_us = std::stod(argv[++i]);
        if (s.create_us < 0) return usage();
      } else if (a == "--map-us" && has_value) {
        s.map_us = std::stod(argv[++i]);
        if (s.map_us < 0) return usage();
      } else if (a == "--unmap-us" && has_value) {
        s.unmap_us = std::stod(argv[++i]);
        if (s.unmap_us < 0) return usage();
      } else if (a == "--repeat" && has_value) {
        s.repeat = std::max(1, std::stoi(argv[++i]));
      } else if (a.starts_with("-")) {
        return usage();
      } else {
        traces.push_back(a);
      }
    }
  } catch (const std::exception&) {
    return usage();  // a numeric flag with a value that is not a number
  }
  if (traces.empty()) return usage();
  tidepool::AllocatorOptions defaults;
  defaults.expandable_segments = s.expandable;
  if (s.slot_mib != 0) defaults.map_slot_bytes = s.slot_mib << 20;
  defaults.prefer_backed_fit = s.prefer_backed_fit;
  if (s.move_slack >= -1) defaults.move_slack = s.move_slack;
  bool all_pass = true;
  for (const std::string& path : traces) {
    try {
      const Trace t = load_trace(path);
      std::printf("%s: %zu ops, %zu streams, peak live %.3f GiB (%zu bytes); backend %s, %s\n",
                  path.c_str(), t.ops.size(), t.streams, gib(t.peak_live), t.peak_live,
                  s.backend.c_str(), s.expandable ? "expandable segments" : "plain segments");
      tidepool::AllocatorOptions baseline_options = defaults;
      baseline_options.allow_release = false;
      baseline_options.move_free_runs = false;
      struct Row {
        std::string name;
        Result r;
      };
      std::vector<std::string> names = {"tidepool default"};
      std::vector<tidepool::AllocatorOptions> configs = {defaults};
      if (s.expandable) {
        tidepool::AllocatorOptions no_moves = defaults;
        no_moves.move_free_runs = false;
        names.push_back("moves off");
        configs.push_back(no_moves);
        if (s.recycle_slack >= 0) {
          tidepool::AllocatorOptions recycling = defaults;
          recycling.recycle_slack = s.recycle_slack;
          char name[48];
          std::snprintf(name, sizeof name, "recycle slack %.3g", s.recycle_slack);
          names.push_back(name);
          configs.push_back(recycling);
        }
      }
      names.push_back("releases disabled");
      configs.push_back(baseline_options);
      const std::vector<Result> results = replay_all(t, s, configs);
      std::vector<Row> rows;
      for (std::size_t i = 0; i < results.size(); ++i) rows.push_back({names[i], results[i]});
      const Result& baseline = rows.back().r;
      std::vector<const Result*> all;
      for (const Row& row : rows) {
        print_row(row.name.c_str(), t, row.r, s);
        all.push_back(&row.r);
      }
      print_backend_costs(all, s);
      for (std::size_t i = 0; i + 1 < rows.size(); ++i) {
        const Row& row = rows[i];
        const double ratio =
            static_cast<double>(row.r.peak_reserved) / static_cast<double>(t.peak_live);
        // On the cuda backend the wall time holds the real driver calls, measured in this
        // run: that is the cost to judge. The measured-cost model stands in for them only
        // on the host backend, whose memfd/mmap calls a GPU never makes.
        const bool measured = s.backend == "cuda";
        const double modeled_ratio = row.r.measured_cost_ms(s) / baseline.measured_cost_ms(s);
        const double issue_ratio =
            row.r.issue_modeled_ms(200, s) / baseline.issue_modeled_ms(200, s);
        const double wall_ratio = row.r.wall_ns / baseline.wall_ns;
        const double time_ratio = measured ? wall_ratio : modeled_ratio;
        const bool pass = ratio <= 1.03 && time_ratio <= 1.1;
        if (i == 0) all_pass = all_pass && pass;
        // Only the default configuration is judged; the others are the comparison, and
        // a "FAIL" there would read as a failure of the run.
        std::printf("  %-7s %-20s %s  ratio %.4f (target <= 1.03), %s %.3fx the baseline "
                    "(target <= 1.1; %s %.3fx, the issue's model %.3fx)\n",
                    i == 0 ? "verdict" : "compare", row.name.c_str(),
                    i == 0 ? (pass ? "PASS" : "FAIL") : (pass ? "within" : "outside"), ratio,
                    measured ? "wall time" : "time at measured costs", time_ratio,
                    measured ? "at measured costs" : "wall",
                    measured ? modeled_ratio : wall_ratio, issue_ratio);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tidepool_replay: %s: %s\n", path.c_str(), e.what());
      return 1;
    }
  }
  return all_pass ? 0 : 3;
}
