// tidepool_replay: replays recorded allocation traces through tidepool's caching allocator
// and reports fragmentation and cost.
//
//   tidepool_replay [--backend host|cuda] [--capacity-gib N] [--plain]
//                   [--recycle-slack F] [--run-mib N] [--repeat N] TRACE.csv...
//
// --plain: plain segments instead of expandable ranges. --recycle-slack: the value of
// AllocatorOptions::recycle_slack for the second configuration (default 0.02).
// --run-mib: AllocatorOptions::max_map_run_bytes. --capacity-gib: the host backend's
// emulated capacity (default 64; pages are never touched). Exit status 3 when the
// default configuration misses a target.
//
// A trace (shared/traces/*.csv) is `t_us,op,id,size,stream` per line, op a = alloc,
// f = free, id pairing an alloc with its free; lines starting with '#' are comments.
// For each trace the replay runs, in the same process: the allocator with its default
// options, the same with recycling of free runs (Note [Recycling free runs]), and with
// every release to the backend disabled (the baseline). It prints peak reserved,
// peak live (from the trace), their ratio, ns per operation, segments acquired from and
// released to the backend, and a modeled time that charges each segment operation what a
// cudaMalloc/cudaFree costs on the H200 (65-450 us, 200 us as the central figure), then a
// verdict against the targets: ratio <= 1.03, modeled time <= 1.1x the baseline's.
//
// The replay never writes to the memory it gets, so the host backend's pages stay
// untouched and a trace peaking at several GiB replays on a small machine.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
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
    o.size = std::stoull(size);
    auto [sit, snew] = streams.emplace(stream, static_cast<std::uint32_t>(streams.size()));
    o.stream = sit->second;
    if (o.alloc) {
      auto [it, fresh] = ids.emplace(id, static_cast<std::uint32_t>(ids.size()));
      if (!fresh)
        throw std::runtime_error(path + ":" + std::to_string(line_no) + ": id " + id +
                                 " allocated twice");
      o.slot = it->second;
      live_size.push_back(o.size);
      live += o.size;
      t.peak_live = std::max(t.peak_live, live);
    } else {
      auto it = ids.find(id);
      if (it == ids.end())
        throw std::runtime_error(path + ":" + std::to_string(line_no) + ": free of unknown id " + id);
      o.slot = it->second;
      live -= live_size[o.slot];
    }
    t.ops.push_back(o);
  }
  t.slots = ids.size();
  t.streams = streams.size();
  return t;
}

struct Result {
  std::size_t peak_reserved = 0;
  std::size_t peak_allocated = 0;
  std::uint64_t acquired = 0, released = 0;
  double ns_per_op = 0;
  double total_ns = 0;
  double modeled_ms(double us_per_segment_op) const {
    return (total_ns + static_cast<double>(acquired + released) * us_per_segment_op * 1e3) / 1e6;
  }
};

struct Settings {
  std::string backend = "host";
  std::size_t capacity = std::size_t{64} << 30;
  bool expandable = true;
  int repeat = 5;
  double recycle_slack = 0.02;  // the second configuration replayed
  std::size_t run_mib = 0;      // 0: the allocator's default mapping run
};

std::unique_ptr<tidepool::Backend> make_backend(const Settings& s) {
  if (s.backend == "cuda") return tidepool::make_cuda_backend(0);
  tidepool::HostBackendOptions o;
  o.capacity_bytes = s.capacity;
  return tidepool::make_host_backend(0, o);
}

Result replay_once(const Trace& t, const Settings& s, bool allow_release, double recycle_slack) {
  tidepool::AllocatorOptions options;
  options.expandable_segments = s.expandable;
  options.allow_release = allow_release;
  options.recycle_slack = recycle_slack;
  if (s.run_mib != 0) options.max_map_run_bytes = s.run_mib << 20;
  tidepool::CachingAllocator alloc(make_backend(s), options);
  std::vector<tidepool::Stream> streams(t.streams);
  for (std::size_t i = 1; i < t.streams; ++i) streams[i] = alloc.backend().create_stream();
  std::vector<void*> ptrs(t.slots, nullptr);
  std::vector<std::size_t> sizes(t.slots, 0);
  const auto start = std::chrono::steady_clock::now();
  for (const Op& o : t.ops) {
    if (o.alloc) {
      ptrs[o.slot] = alloc.allocate(o.size, streams[o.stream]);
      sizes[o.slot] = o.size;
    } else {
      alloc.deallocate(ptrs[o.slot], sizes[o.slot], streams[o.stream]);
      ptrs[o.slot] = nullptr;
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  const tidepool::AllocatorStats st = alloc.stats();
  Result r;
  r.peak_reserved = st.reserved.peak;
  r.peak_allocated = st.allocated.peak;
  r.acquired = st.segments_acquired;
  r.released = st.segments_released;
  r.total_ns = std::chrono::duration<double, std::nano>(stop - start).count();
  r.ns_per_op = r.total_ns / static_cast<double>(t.ops.size());
  for (std::size_t i = 0; i < t.slots; ++i)
    if (ptrs[i] != nullptr) alloc.deallocate(ptrs[i], sizes[i], {});
  for (std::size_t i = 1; i < t.streams; ++i) alloc.backend().destroy_stream(streams[i]);
  return r;
}

// Deterministic figures from the first run; the fastest time of `repeat` runs.
Result replay(const Trace& t, const Settings& s, bool allow_release, double recycle_slack) {
  Result best = replay_once(t, s, allow_release, recycle_slack);
  for (int i = 1; i < s.repeat; ++i) {
    const Result r = replay_once(t, s, allow_release, recycle_slack);
    if (r.total_ns < best.total_ns) {
      best.total_ns = r.total_ns;
      best.ns_per_op = r.ns_per_op;
    }
  }
  return best;
}

double gib(std::size_t b) { return static_cast<double>(b) / double(1 << 30); }

void print_row(const char* name, const Trace& t, const Result& r) {
  std::printf("  %-18s peak reserved %8.3f GiB  ratio %6.4f  %7.0f ns/op  segments +%llu/-%llu"
              "  modeled %8.1f ms (%.1f .. %.1f)\n",
              name, gib(r.peak_reserved),
              static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_live), r.ns_per_op,
              static_cast<unsigned long long>(r.acquired),
              static_cast<unsigned long long>(r.released), r.modeled_ms(200), r.modeled_ms(65),
              r.modeled_ms(450));
}

int usage() {
  std::fprintf(stderr,
               "usage: tidepool_replay [--backend host|cuda] [--capacity-gib N] [--plain] "
               "[--recycle-slack F] [--run-mib N] [--repeat N] TRACE.csv...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::vector<std::string> traces;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) {
      s.backend = argv[++i];
      if (s.backend != "host" && s.backend != "cuda") return usage();
    } else if (a == "--capacity-gib" && i + 1 < argc) {
      s.capacity = static_cast<std::size_t>(std::stoull(argv[++i])) << 30;
    } else if (a == "--plain") {
      s.expandable = false;
    } else if (a == "--recycle-slack" && i + 1 < argc) {
      s.recycle_slack = std::atof(argv[++i]);
    } else if (a == "--run-mib" && i + 1 < argc) {
      s.run_mib = static_cast<std::size_t>(std::stoull(argv[++i]));
    } else if (a == "--repeat" && i + 1 < argc) {
      s.repeat = std::max(1, std::atoi(argv[++i]));
    } else if (a.starts_with("-")) {
      return usage();
    } else {
      traces.push_back(a);
    }
  }
  if (traces.empty()) return usage();
  bool all_pass = true;
  for (const std::string& path : traces) {
    try {
      const Trace t = load_trace(path);
      std::printf("%s: %zu ops, %zu streams, peak live %.3f GiB (%zu bytes); backend %s, %s\n",
                  path.c_str(), t.ops.size(), t.streams, gib(t.peak_live), t.peak_live,
                  s.backend.c_str(), s.expandable ? "expandable segments" : "plain segments");
      const double default_slack = tidepool::AllocatorOptions{}.recycle_slack;
      const Result baseline = replay(t, s, false, default_slack);
      struct Row {
        std::string name;
        Result r;
      };
      std::vector<Row> rows = {{"tidepool default", replay(t, s, true, default_slack)}};
      if (s.expandable) {
        char name[48];
        std::snprintf(name, sizeof name, "recycle slack %.3g", s.recycle_slack);
        rows.push_back({name, replay(t, s, true, s.recycle_slack)});
      }
      for (const Row& row : rows) print_row(row.name.c_str(), t, row.r);
      print_row("releases disabled", t, baseline);
      for (const Row& row : rows) {
        const double ratio =
            static_cast<double>(row.r.peak_reserved) / static_cast<double>(t.peak_live);
        const double time_ratio = row.r.modeled_ms(200) / baseline.modeled_ms(200);
        const bool pass = ratio <= 1.03 && time_ratio <= 1.1;
        if (row.name == "tidepool default") all_pass = all_pass && pass;
        std::printf("  verdict %-18s %s  ratio %.4f (target <= 1.03; PyTorch native 1.082 "
                    "GPT-2, 1.111 ResNet-50), modeled time %.3fx the no-release baseline "
                    "(target <= 1.1)\n",
                    row.name.c_str(), pass ? "PASS" : "FAIL", ratio, time_ratio);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tidepool_replay: %s: %s\n", path.c_str(), e.what());
      return 1;
    }
  }
  return all_pass ? 0 : 3;
}
