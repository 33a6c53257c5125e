// Tiering throughput against plain async copies of pinned buffers, in one run.
//
// The state: TIDEPOOL_BENCH_BYTES of tensors (default 1 GiB on the cuda backend, 256 MiB
// on the host backend) whose sizes are drawn log-uniformly from 64 KiB to 64 MiB with a
// fixed seed: many small tensors, most bytes in large ones, as in optimizer state.
// Benchmarks, in run order:
//   memcpy/h2d, memcpy/d2h     Backend::copy_async of each tensor between pinned host
//                              blocks and device memory, one stream: the baseline.
//   memcpy/bidir               half the bytes (set A) down while the other half (set B)
//                              goes up, on two streams: the bidirectional baseline.
//   store/prefetch_h2d         TieredStore::prefetch of every handle (all on the host).
//   store/evict_d2h            TieredStore::evict of every handle (all resident, dirty).
//   store/bidir                evict set A while prefetching set B.
//   vmm/migrate                VmmPool::migrate of one range of the same size device ->
//                              host -> device (skipped when the backend has no VA API).
// Each store row carries `ratio_vs_memcpy`: its GB/s over the memcpy row of the same
// direction measured in this run (the ≥ 0.9 target of issue 3); the vmm row the same per
// direction. Time per iteration is host wall time from the first enqueue until both
// streams are idle (UseManualTime), the same clock for the store and the baseline; the
// untimed part of an iteration puts the handles where the pass needs them.
// Where the time goes, for the next GPU run to read: the memcpy and store rows count the
// backend calls of a pass per tensor (copies, event records, stream waits, event queries;
// counting_backend.h) and the host time spent issuing it (`issue_ms`, and its share of the
// pass, `issue_share`: near 1, the host and not the link sets the pace). The vmm row times
// a first, cold move to the host (no spare host backings yet: `cold_to_host_GBps`) apart
// from the timed, warm ones, and splits each direction into VmmStats' phases per
// migration: creating backings, waiting for them, waiting for the copies, map/unmap calls,
// releases (Note [Migration batches] in tiering/vmm_moves.cpp).
//
// Backend: cuda when a GPU exists, else host; TIDEPOOL_BENCH_BACKEND=host|cuda forces
// one. On the host backend, TIDEPOOL_BENCH_MODELED_LINK_GBPS=R puts it behind a modelled
// link of R GB/s each way (link_model_backend.h), so the store rows' ratios measure how it
// issues and orders its copies rather than memcpy on this host. Everything that holds
// backend resources lives in a Bench object owned by main() and destroyed before main
// returns (no statics: a CUDA context is gone by the time static destructors run).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "tiering/host_arena.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"
#include "bench/tiering/bench_state.h"
#include "bench/tiering/counting_backend.h"
#include "bench/tiering/link_model_backend.h"

namespace {

using namespace tidepool;
using namespace tidepool::bench_state;
using Clock = std::chrono::steady_clock;

enum class Mode { h2d, d2h, bidir };
const char* mode_name(Mode m) { return m == Mode::h2d ? "h2d" : m == Mode::d2h ? "d2h" : "bidir"; }

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- the objects the benchmarks share ---------------------------------------------------

// One transfer of the bidirectional and per-direction passes: tensor `index`, which way.
struct Op {
  std::size_t index;
  bool to_device;
};

class Bench {
 public:
  Bench()
      : kind_(choose_backend()),
        total_(choose_total_bytes(kind_)),
        sizes_(mixed_tensor_sizes(total_)) {
    std::unique_ptr<Backend> backend;
    if (kind_ == BackendKind::cuda) {
      backend = make_cuda_backend(0);
    } else {
      // Room for the baseline's device buffer, the store's cached buffers and the range.
      backend = make_host_backend(0, HostBackendOptions{4 * total_ + (std::size_t{256} << 20)});
      // TIDEPOOL_BENCH_MODELED_LINK_GBPS: the host backend behind a modelled link, so that
      // the store's ratios to the plain copies are those of its issuing, not of memcpy.
      if (const double rate = modeled_link_bytes_per_second(); rate > 0) {
        backend = std::make_unique<LinkModelBackend>(std::move(backend), rate);
      }
    }
    auto counting = std::make_unique<CountingBackend>(std::move(backend));
    counting_ = counting.get();
    // The store takes device buffers from a caching allocator, as in production: buffers
    // an eviction frees are reused by the next prefetch instead of going back to the
    // device (cudaMalloc/cudaFree would dominate the small tensors).
    allocator_ = std::make_unique<CachingAllocator>(std::move(counting));
    offsets_.reserve(sizes_.size());
    std::size_t off = 0;
    for (std::size_t s : sizes_) {
      offsets_.push_back(off);
      off += s;
    }
    // Set A (evicted in the bidirectional pass) and set B (prefetched) hold half the bytes
    // each; tensors are dealt to the lighter set. The ops interleave the two sets by
    // bytes issued, so both directions have work queued from start to end.
    std::vector<std::size_t> a, b;
    std::size_t bytes_a = 0, bytes_b = 0;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      if (bytes_a <= bytes_b) {
        a.push_back(i);
        bytes_a += sizes_[i];
      } else {
        b.push_back(i);
        bytes_b += sizes_[i];
      }
    }
    std::size_t ia = 0, ib = 0, issued_a = 0, issued_b = 0;
    while (ia < a.size() || ib < b.size()) {
      if (ib == b.size() || (ia < a.size() && issued_a <= issued_b)) {
        issued_a += sizes_[a[ia]];
        bidir_ops_.push_back(Op{a[ia++], false});
      } else {
        issued_b += sizes_[b[ib]];
        bidir_ops_.push_back(Op{b[ib++], true});
      }
    }
  }

  ~Bench() {
    // Order matters: the store and the plain buffers give memory back to the allocator
    // and its backend, which go last.
    store_handles_.clear();
    store_.reset();
    release_plain();
  }

  Backend& backend() { return allocator_->backend(); }
  CachingAllocator& allocator() { return *allocator_; }
  CallCounts calls() const { return counting_->counts(); }
  std::size_t total_bytes() const { return total_; }
  const std::vector<std::size_t>& sizes() const { return sizes_; }
  std::string label() const {
    return std::to_string(sizes_.size()) + " tensors 64KiB-64MiB, " + std::to_string(total_ >> 20) +
           " MiB, " + (kind_ == BackendKind::cuda ? "cuda" : "host");
  }

  HostArenaOptions pinned_options() const {
    HostArenaOptions o;
    o.pinned_budget_bytes = 2 * total_ + (std::size_t{256} << 20);
    // cudaHostRegister is not bound by RLIMIT_MEMLOCK; the host backend locks nothing.
    o.respect_memlock_limit = false;
    return o;
  }

  std::vector<Op> ops(Mode mode) const {
    if (mode == Mode::bidir) return bidir_ops_;
    std::vector<Op> out;
    for (std::size_t i = 0; i < sizes_.size(); ++i) out.push_back(Op{i, mode == Mode::h2d});
    return out;
  }

  // ---- the baseline: plain copies of pinned buffers ----

  // One pass of `mode`: every op as one copy_async, H2D on one stream and D2H on another.
  // `issue_seconds`, when given, gets the host time spent enqueueing.
  double memcpy_pass(Mode mode, double* issue_seconds = nullptr) {
    ensure_plain();
    const std::vector<Op> todo = ops(mode);
    auto* dev = static_cast<char*>(plain_dev_);
    const Clock::time_point t0 = Clock::now();
    for (const Op& op : todo) {
      char* d = dev + offsets_[op.index];
      void* h = plain_host_[op.index].ptr;
      if (op.to_device) {
        backend().copy_async(d, h, sizes_[op.index], CopyKind::host_to_device, plain_h2d_);
      } else {
        backend().copy_async(h, d, sizes_[op.index], CopyKind::device_to_host, plain_d2h_);
      }
    }
    if (issue_seconds != nullptr) *issue_seconds += seconds_since(t0);
    backend().stream_synchronize(plain_h2d_);
    backend().stream_synchronize(plain_d2h_);
    return seconds_since(t0);
  }

  // The baseline GB/s of `mode` measured by the memcpy benchmark in this run, or, when
  // that benchmark was filtered out, measured now over a few passes the same way.
  double memcpy_gbps(Mode mode) {
    if (auto it = memcpy_gbps_.find(mode); it != memcpy_gbps_.end()) return it->second;
    memcpy_pass(mode);  // first touch
    double seconds = 0;
    constexpr int kPasses = 3;
    for (int i = 0; i < kPasses; ++i) seconds += memcpy_pass(mode);
    return memcpy_gbps_[mode] = kPasses * double(total_) / seconds / 1e9;
  }
  void record_memcpy_gbps(Mode mode, double gbps) { memcpy_gbps_[mode] = gbps; }

  // ---- the tiered store ----

  TieredStore& store() {
    if (!store_) {
      TieredStoreOptions o;
      o.device_budget_bytes = total_;  // the bidirectional pass holds A and B at its peak
      o.host = pinned_options();
      store_ = std::make_unique<TieredStore>(backend(), o, caching_allocator_source(*allocator_));
      for (std::size_t s : sizes_)
        store_handles_.push_back(store_->create(s, TIDEPOOL_TAG_OPTIMIZER_STATE));
    }
    return *store_;
  }
  TieredStore::Handle handle(std::size_t i) { return store_handles_.at(i); }

 private:
  void ensure_plain() {
    if (plain_dev_ != nullptr) return;
    plain_arena_ = std::make_unique<HostArena>(backend(), pinned_options());
    for (std::size_t s : sizes_) plain_host_.push_back(plain_arena_->allocate(s));
    plain_dev_ = backend().device_alloc(total_);
    if (plain_dev_ == nullptr)
      throw std::runtime_error("bench: no device memory for the baseline buffers");
    plain_h2d_ = backend().create_stream();
    plain_d2h_ = backend().create_stream();
  }
  void release_plain() {
    if (plain_dev_ == nullptr) return;
    backend().stream_synchronize(plain_h2d_);
    backend().stream_synchronize(plain_d2h_);
    backend().destroy_stream(plain_h2d_);
    backend().destroy_stream(plain_d2h_);
    backend().device_free(plain_dev_, total_);
    for (const HostBlock& b : plain_host_) plain_arena_->deallocate(b);
    plain_arena_.reset();
    plain_dev_ = nullptr;
  }

  BackendKind kind_;
  std::size_t total_;
  std::vector<std::size_t> sizes_;
  std::vector<std::size_t> offsets_;
  std::vector<Op> bidir_ops_;
  std::unique_ptr<CachingAllocator> allocator_;  // owns the backend
  CountingBackend* counting_ = nullptr;          // the backend, owned by allocator_

  std::unique_ptr<HostArena> plain_arena_;
  std::vector<HostBlock> plain_host_;
  void* plain_dev_ = nullptr;
  Stream plain_h2d_, plain_d2h_;
  std::map<Mode, double> memcpy_gbps_;

  std::unique_ptr<TieredStore> store_;
  std::vector<TieredStore::Handle> store_handles_;
};

// ---- the benchmarks ---------------------------------------------------------------------

void report_rate(benchmark::State& state, Bench& bench, double seconds) {
  const double gbps = double(bench.total_bytes()) * double(state.iterations()) / seconds / 1e9;
  state.counters["GBps"] = gbps;
  state.counters["tensors"] = double(bench.sizes().size());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bench.total_bytes()));
  state.SetLabel(bench.label());
}

// The backend calls of `passes` passes (`calls`) per tensor, and the host's issue time.
void report_calls(benchmark::State& state, Bench& bench, const CallCounts& calls,
                  double passes, double issue_seconds, double seconds) {
  const double per_tensor = passes * double(bench.sizes().size());
  state.counters["copies_per_tensor"] = double(calls[bench_state::Op::copy]) / per_tensor;
  state.counters["records_per_tensor"] = double(calls[bench_state::Op::record_event]) / per_tensor;
  state.counters["waits_per_tensor"] =
      double(calls[bench_state::Op::stream_wait_event]) / per_tensor;
  state.counters["queries_per_tensor"] = double(calls[bench_state::Op::event_query]) / per_tensor;
  state.counters["calls_per_tensor"] = double(calls.total()) / per_tensor;
  state.counters["issue_ms"] = issue_seconds * 1e3 / passes;
  state.counters["issue_share"] = seconds > 0 ? issue_seconds / seconds : 0.0;
}

void bm_memcpy(benchmark::State& state, Bench& bench, Mode mode) {
  bench.memcpy_pass(mode);  // first touch of the buffers is not the link's speed
  double seconds = 0;
  double issue_seconds = 0;
  const CallCounts before = bench.calls();
  for (auto _ : state) {
    const double s = bench.memcpy_pass(mode, &issue_seconds);
    state.SetIterationTime(s);
    seconds += s;
  }
  const CallCounts calls = bench.calls() - before;
  report_rate(state, bench, seconds);
  report_calls(state, bench, calls, double(state.iterations()), issue_seconds, seconds);
  bench.record_memcpy_gbps(mode, state.counters["GBps"]);
}

// Puts every handle where a pass of `mode` starts: the ones it evicts resident and dirty
// (so their eviction copies back), the ones it prefetches on the host.
void stage_store(Bench& bench, TieredStore& store, Mode mode, Stream compute) {
  const std::vector<Op> todo = bench.ops(mode);
  for (const Op& op : todo) {
    if (!op.to_device) continue;
    store.evict(bench.handle(op.index));
  }
  store.synchronize();  // evictions are done before loads that may need their room
  for (const Op& op : todo) {
    if (op.to_device) continue;
    const TieredStore::Handle h = bench.handle(op.index);
    store.acquire(h, compute);
    store.release(h, /*dirty=*/true);
  }
  bench.backend().stream_synchronize(compute);
  store.synchronize();
}

void bm_store(benchmark::State& state, Bench& bench, Mode mode) {
  const double baseline = bench.memcpy_gbps(mode);
  TieredStore& store = bench.store();
  const Stream compute = bench.backend().create_stream();
  const std::vector<Op> todo = bench.ops(mode);
  double issue_seconds = 0;
  CallCounts calls;  // of the timed parts only
  // Bytes the store's copy engine moved in the timed parts: a skipped prefetch moves
  // nothing, and the rate must not count it as moved.
  std::uint64_t moved = 0;
  const auto copied = [&] {
    const TieredStoreStats s = store.stats();
    return s.copy.h2d.bytes + s.copy.d2h.bytes;
  };
  auto pass = [&] {
    stage_store(bench, store, mode, compute);
    const std::uint64_t copied_before = copied();
    const CallCounts calls_before = bench.calls();
    const Clock::time_point t0 = Clock::now();
    for (const Op& op : todo) {
      const TieredStore::Handle h = bench.handle(op.index);
      if (op.to_device) {
        store.prefetch(h, compute);
      } else {
        store.evict(h);
      }
    }
    issue_seconds += seconds_since(t0);
    store.synchronize();
    const double s = seconds_since(t0);
    const CallCounts pass_calls = bench.calls() - calls_before;
    for (std::size_t i = 0; i < calls.n.size(); ++i) calls.n[i] += pass_calls.n[i];
    moved += copied() - copied_before;
    return s;
  };
  pass();  // first touch of the allocator's buffers
  issue_seconds = 0;
  calls = CallCounts{};
  moved = 0;
  const TieredStoreStats before = store.stats();
  const std::uint64_t segments_before = bench.allocator().stats().segments.allocated;
  const MappingStats maps_before = bench.allocator().mapping_stats();
  double seconds = 0;
  for (auto _ : state) {
    const double s = pass();
    state.SetIterationTime(s);
    seconds += s;
  }
  const TieredStoreStats after = store.stats();
  const std::uint64_t segments_after = bench.allocator().stats().segments.allocated;
  const MappingStats maps_after = bench.allocator().mapping_stats();
  bench.backend().destroy_stream(compute);
  report_rate(state, bench, seconds);
  report_calls(state, bench, calls, double(state.iterations()), issue_seconds, seconds);
  state.counters["memcpy_GBps"] = baseline;
  state.counters["ratio_vs_memcpy"] = state.counters["GBps"] / baseline;
  // A fair comparison needs every prefetch issued and every host block pinned.
  state.counters["prefetch_skipped"] = double(after.prefetch_skipped - before.prefetch_skipped);
  state.counters["pageable_blocks"] = double(after.host.pageable_allocs);
  const std::uint64_t expected =
      bench.total_bytes() * static_cast<std::uint64_t>(state.iterations());
  if (moved != expected) {
    // Less work than the baseline's: its rate would be no comparison (a skipped prefetch
    // copies nothing).
    const std::string why = "the store moved " + std::to_string(moved) + " of the " +
                            std::to_string(expected) + " bytes the baseline copies " +
                            "(prefetches skipped: " +
                            std::to_string(after.prefetch_skipped - before.prefetch_skipped) +
                            ")";
    state.SkipWithError(why.c_str());  // copied by Google Benchmark
  }
  // Device memory the allocator had to get from the backend after the warm-up pass
  // (cudaMalloc in the loop): 0 when the store's buffers are reused from its cache.
  state.counters["backend_allocs"] = double(segments_after - segments_before);
  // VA remapping by the allocator (expandable segments) and the stream syncs it waited
  // for: host-side costs inside the store's loop that the baseline does not pay.
  state.counters["allocator_maps"] = double(maps_after.map_calls - maps_before.map_calls);
  state.counters["allocator_move_syncs"] = double(maps_after.move_syncs - maps_before.move_syncs);
}

// VmmStats' phases of the migrations between two snapshots (Note [Migration batches] in
// tiering/vmm_moves.cpp), added up over a benchmark's migrations of one direction.
struct VmmPhases {
  double create_ms = 0, create_wait_ms = 0, copy_wait_ms = 0, remap_ms = 0, release_ms = 0;
  double batches = 0, backend_calls = 0, created = 0, spare_reuses = 0;
  void add(const VmmStats& before, const VmmStats& after) {
    create_ms += after.create_ms - before.create_ms;
    create_wait_ms += after.create_wait_ms - before.create_wait_ms;
    copy_wait_ms += after.copy_wait_ms - before.copy_wait_ms;
    remap_ms += after.remap_ms - before.remap_ms;
    release_ms += after.release_ms - before.release_ms;
    batches += double(after.migration_batches - before.migration_batches);
    backend_calls += double(after.migration_backend_calls - before.migration_backend_calls);
    created += double(after.backings_created - before.backings_created);
    spare_reuses += double(after.spare_host_reuses - before.spare_host_reuses);
  }
  // Counters `<prefix>_<phase>` per migration.
  void report(benchmark::State& state, const std::string& prefix, double migrations) const {
    auto put = [&](const char* name, double v) {
      state.counters[prefix + "_" + name] = v / migrations;
    };
    put("create_ms", create_ms);
    put("create_wait_ms", create_wait_ms);
    put("copy_wait_ms", copy_wait_ms);
    put("remap_ms", remap_ms);
    put("release_ms", release_ms);
    put("batches", batches);
    put("backend_calls", backend_calls);
    put("backings_created", created);
    put("spare_reuses", spare_reuses);
  }
};

void bm_vmm_migrate(benchmark::State& state, Bench& bench) {
  const std::size_t n = bench.total_bytes();
  const double d2h_baseline = bench.memcpy_gbps(Mode::d2h);
  const double h2d_baseline = bench.memcpy_gbps(Mode::h2d);
  std::optional<VmmPool> pool;
  void* range = nullptr;
  try {
    pool.emplace(bench.backend(),
                 VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget});
    range = pool->allocate(n, TIDEPOOL_TAG_OPTIMIZER_STATE);
  } catch (const std::exception& e) {
    state.SkipWithError((std::string("the backend cannot map VA ranges: ") + e.what()).c_str());
    return;
  }
  if (range == nullptr) {
    state.SkipWithError("no device memory for the range");
    return;
  }
  bench.backend().memset_async(range, 1, n, Stream{});
  bench.backend().stream_synchronize(Stream{});
  // The first move to the host creates (and pins) all of its host memory, as the first
  // eviction of a training run does; later ones take the spare host backings the move
  // back left (Note [Spare host backings]). Timed apart, untimed by the loop.
  VmmPhases cold;
  VmmStats s0 = pool->stats();
  Clock::time_point t0 = Clock::now();
  pool->migrate(range, MemoryLocation::host);
  const double cold_seconds = seconds_since(t0);
  VmmStats s1 = pool->stats();
  cold.add(s0, s1);
  pool->migrate(range, MemoryLocation::device);
  VmmPhases to_host_phases, to_device_phases;
  double to_host = 0, to_device = 0;
  for (auto _ : state) {
    s0 = pool->stats();
    t0 = Clock::now();
    pool->migrate(range, MemoryLocation::host);
    const double down = seconds_since(t0);
    s1 = pool->stats();
    const Clock::time_point t1 = Clock::now();
    pool->migrate(range, MemoryLocation::device);
    const double up = seconds_since(t1);
    const VmmStats s2 = pool->stats();
    to_host_phases.add(s0, s1);
    to_device_phases.add(s1, s2);
    to_host += down;
    to_device += up;
    state.SetIterationTime(down + up);
  }
  pool->deallocate(range);
  const double iters = double(state.iterations());
  const double to_host_gbps = double(n) * iters / to_host / 1e9;
  const double to_device_gbps = double(n) * iters / to_device / 1e9;
  state.counters["to_host_GBps"] = to_host_gbps;
  state.counters["to_device_GBps"] = to_device_gbps;
  state.counters["cold_to_host_GBps"] = double(n) / cold_seconds / 1e9;
  state.counters["ratio_to_host_vs_memcpy"] = to_host_gbps / d2h_baseline;
  state.counters["ratio_to_device_vs_memcpy"] = to_device_gbps / h2d_baseline;
  cold.report(state, "cold_to_host", 1.0);
  to_host_phases.report(state, "to_host", iters);
  to_device_phases.report(state, "to_device", iters);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 *
                          static_cast<std::int64_t>(n));
  state.SetLabel(bench.label());
}

void register_benchmarks(Bench& bench) {
  auto finish = [](benchmark::internal::Benchmark* b) {
    b->UseManualTime()->Unit(benchmark::kMillisecond);
  };
  for (Mode m : {Mode::h2d, Mode::d2h, Mode::bidir}) {
    finish(benchmark::RegisterBenchmark(
        (std::string("memcpy/") + mode_name(m)).c_str(),
        [&bench, m](benchmark::State& s) { bm_memcpy(s, bench, m); }));
  }
  const std::pair<Mode, const char*> store_rows[] = {
      {Mode::h2d, "store/prefetch_h2d"}, {Mode::d2h, "store/evict_d2h"},
      {Mode::bidir, "store/bidir"}};
  for (const auto& [m, name] : store_rows) {
    finish(benchmark::RegisterBenchmark(
        name, [&bench, m = m](benchmark::State& s) { bm_store(s, bench, m); }));
  }
  finish(benchmark::RegisterBenchmark("vmm/migrate_d2h2d",
                                      [&bench](benchmark::State& s) { bm_vmm_migrate(s, bench); }));
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    Bench bench;
    register_benchmarks(bench);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::ClearRegisteredBenchmarks();  // they hold references to `bench`
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tidepool_bench_tiering: %s\n", e.what());
    return 1;
  }
  // Every backend resource was released with `bench`, while the backend still worked.
  benchmark::Shutdown();
  return 0;
}
