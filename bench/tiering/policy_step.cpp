// The prefetch policy's own cost per training step (tiering/prefetch_policy.h), on the host
// CPU: what the tiered store spends, under its lock, deciding what to prefetch and evict,
// against a step whose schedule never changes, in the same run.
//
// One iteration is one step of one schedule key: begin_step, an acquire of every handle
// the step uses (on_acquire, then a walk of the look-ahead as the store's prefetch makes
// after each acquire, every handle found on the device), end_step. The walk covers the
// store's default prefetch_lookahead (64 acquires) and starts where the last walk's mark
// still holds (Note [Prefetch frontier]). Rows, each over N handles per step:
//   step/one_shape     every step acquires handles 0..N-1 in order. The baseline.
//   step/alternating   steps alternate between two shapes that share half their handles
//                      (0..N/2-1 with N/2..N-1, then with N..N+N/2-1): the union of
//                      recent steps and the periodic presences of Note [Steps of several
//                      shapes] at work. Counter ratio_vs_one_shape: its time per step over
//                      the baseline's at the same N (run after it).
//   step/full_walk     one_shape with every walk from the look-ahead's front (upcoming(),
//                      what the store did before the mark). Counter ratio_vs_one_shape:
//                      what the mark saves.
// Counter ns_per_acquire: time per step over the acquires in it.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <map>

#include "tiering/prefetch_policy.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::PrefetchPolicy;

// How far ahead the store looks after each acquire.
const std::size_t kLookAhead = tidepool::TieredStoreOptions{}.prefetch_lookahead;

std::map<std::int64_t, double>& one_shape_ns_per_step() {
  static std::map<std::int64_t, double> by_n;
  return by_n;
}

// A policy and the mark of its last walk, as the tiered store keeps them.
struct Walked {
  PrefetchPolicy policy;
  PrefetchPolicy::LookAheadMark mark;
  bool from_front = false;  // every walk from the front (step/full_walk)

  void acquire(std::uint64_t h) {
    policy.on_acquire(h);
    if (from_front) {
      benchmark::DoNotOptimize(policy.upcoming(kLookAhead));
      return;
    }
    const std::size_t covered =
        policy.visit_upcoming(policy.still_covered(mark), kLookAhead, [](std::uint64_t id) {
          benchmark::DoNotOptimize(id);
          return true;  // on the device (or loaded now)
        });
    mark = policy.mark(covered);
  }
};

void step(Walked& walked, std::uint64_t first, std::uint64_t count, std::uint64_t second_first,
          std::uint64_t second_count) {
  walked.policy.begin_step();
  for (std::uint64_t h = first; h < first + count; ++h) walked.acquire(h);
  for (std::uint64_t h = second_first; h < second_first + second_count; ++h) walked.acquire(h);
  walked.policy.end_step();
}

// Runs `one_step` for the benchmark's iterations; returns the wall time per step in ns
// (the ratio's operands, measured here the same way for both rows).
template <typename OneStep>
double timed_steps(benchmark::State& state, OneStep one_step) {
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) one_step();
  const double ns = std::chrono::duration<double, std::nano>(
                        std::chrono::steady_clock::now() - start).count();
  return state.iterations() > 0 ? ns / double(state.iterations()) : 0.0;
}

void BM_PolicyStep_OneShape(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  Walked walked;
  for (int warm = 0; warm < 8; ++warm) step(walked, 0, n, 0, 0);
  const double ns_per_step = timed_steps(state, [&] { step(walked, 0, n, 0, 0); });
  one_shape_ns_per_step()[state.range(0)] = ns_per_step;
  state.counters["ns_per_acquire"] = ns_per_step / double(n);
}

void BM_PolicyStep_FullWalk(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  Walked walked;
  walked.from_front = true;
  for (int warm = 0; warm < 8; ++warm) step(walked, 0, n, 0, 0);
  const double ns_per_step = timed_steps(state, [&] { step(walked, 0, n, 0, 0); });
  state.counters["ns_per_acquire"] = ns_per_step / double(n);
  const auto baseline = one_shape_ns_per_step().find(state.range(0));
  if (baseline != one_shape_ns_per_step().end() && baseline->second > 0) {
    state.counters["ratio_vs_one_shape"] = ns_per_step / baseline->second;
  }
}

void BM_PolicyStep_Alternating(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const std::uint64_t half = n / 2;
  Walked walked;
  PrefetchPolicy& policy = walked.policy;
  bool first_shape = true;
  auto one = [&] {
    step(walked, 0, half, first_shape ? half : n, half);
    first_shape = !first_shape;
  };
  for (int warm = 0; warm < 16; ++warm) one();  // past the 2p+1 steps a pattern needs
  const std::uint64_t off_before = policy.off_schedule_acquires();
  const double ns_per_step = timed_steps(state, one);
  state.counters["ns_per_acquire"] = ns_per_step / double(2 * half);
  // Steady alternation is predicted: no acquire the replayed shape did not expect.
  state.counters["off_schedule_per_step"] =
      state.iterations() > 0
          ? double(policy.off_schedule_acquires() - off_before) / double(state.iterations())
          : 0.0;
  const auto baseline = one_shape_ns_per_step().find(state.range(0));
  if (baseline != one_shape_ns_per_step().end() && baseline->second > 0) {
    state.counters["ratio_vs_one_shape"] = ns_per_step / baseline->second;
  }
}

}  // namespace

BENCHMARK(BM_PolicyStep_OneShape)->Name("step/one_shape")->Arg(1000)->Arg(100000);
BENCHMARK(BM_PolicyStep_Alternating)->Name("step/alternating")->Arg(1000)->Arg(100000);
BENCHMARK(BM_PolicyStep_FullWalk)->Name("step/full_walk")->Arg(1000)->Arg(100000);
BENCHMARK_MAIN();
