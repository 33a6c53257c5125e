// Randomized differential test: a long random sequence of allocations, frees, tag scopes
// and empty_cache calls runs against the allocator and a reference model of what must
// hold: live blocks never overlap, the bytes written into each block are intact when it
// is freed, and the allocator's stats equal the model's after every step (the cached
// memory kept under the tags adds up to the cached total). Bad frees are
// mixed in (a freed block again, a pointer inside a live block, a live block with another
// size, a pointer never handed out): each must be refused, changing nothing the model
// and the later steps can see.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/size_classes.h"
#include "allocator/tags.h"
#include "test_support.h"

namespace tidepool {
namespace {

struct LiveBlock {
  std::size_t size;
  int tag;
  unsigned char value;
  Stream stream;
};

struct Model {
  std::map<char*, LiveBlock> live;  // by address, for the overlap check
  std::uint64_t allocated = 0, requested = 0;
  std::array<std::uint64_t, kTagCount> tag_bytes{}, tag_count{};
};

using Param = test::BackendAndSegments;

class Differential : public ::testing::TestWithParam<Param> {};

// Reads `n` bytes at `offset` of block p back to the host.
std::vector<unsigned char> read_back(Backend& b, char* p, std::size_t offset, std::size_t n,
                                     Stream s) {
  std::vector<unsigned char> out(n);
  b.copy_async(out.data(), p + offset, n, CopyKind::device_to_host, s);
  b.stream_synchronize(s);
  return out;
}

// The random sequence and its checks; `o` says how the allocator is configured. `mapping`
// receives the allocator's mapping counters at the end.
void run_differential(std::unique_ptr<Backend> backend, const AllocatorOptions& o,
                      MappingStats& mapping) {
  const bool host = backend->kind() == BackendKind::host;
  CachingAllocator alloc(std::move(backend), o);
  Backend& be = alloc.backend();
  const Stream streams[2] = {Stream{}, be.create_stream()};
  const int tags[3] = {kTagUntagged, kTagActivation, tag_id("differential")};

  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(12345));
  Model m;
  const int steps = test::scaled(6000);
  unsigned char next_value = 1;
  std::vector<char*> freed;  // recently freed bases, for double frees
  for (int step = 0; step < steps; ++step) {
    const int dice = static_cast<int>(rng() % 100);
    if ((dice < 50 && m.live.size() < 120) || m.live.empty()) {
      // Sizes: mostly small, some large, a few several MiB.
      const int kind = static_cast<int>(rng() % 10);
      std::size_t n = kind < 6   ? 1 + rng() % 4096
                      : kind < 9 ? 1 + rng() % (2 << 20)
                                 : (1 << 20) + rng() % (12 << 20);
      const int tag = tags[rng() % 3];
      const Stream s = streams[rng() % 2];
      char* p;
      {
        TagScope scope(tag);
        p = static_cast<char*>(alloc.allocate(n, s));
      }
      ASSERT_NE(p, nullptr);
      // No overlap with any live block.
      auto after = m.live.lower_bound(p);
      if (after != m.live.end()) {
        ASSERT_LE(p + n, after->first) << "overlaps the next block";
      }
      if (after != m.live.begin()) {
        auto before = std::prev(after);
        ASSERT_LE(before->first + before->second.size, p) << "overlaps the previous block";
      }
      const unsigned char value = next_value;
      next_value = static_cast<unsigned char>(next_value % 250 + 1);
      be.memset_async(p, value, n, s);
      m.live.emplace(p, LiveBlock{n, tag, value, s});
      m.allocated += round_request(n);
      m.requested += n;
      m.tag_bytes[tag] += round_request(n);
      ++m.tag_count[tag];
    } else if (dice < 94) {
      auto it = m.live.begin();
      std::advance(it, static_cast<long>(rng() % m.live.size()));
      char* p = it->first;
      const LiveBlock b = it->second;
      // The bytes written at allocation are intact: head, middle and tail.
      const std::size_t probe = std::min<std::size_t>(b.size, 256);
      for (std::size_t off : {std::size_t{0}, (b.size - probe) / 2, b.size - probe}) {
        const auto bytes = read_back(be, p, off, probe, b.stream);
        for (std::size_t i = 0; i < probe; ++i)
          ASSERT_EQ(bytes[i], b.value) << "block " << static_cast<void*>(p) << " byte " << off + i;
      }
      alloc.deallocate(p, b.size, b.stream);
      if (freed.size() < 64) {
        freed.push_back(p);
      } else {
        freed[rng() % freed.size()] = p;
      }
      m.live.erase(it);
      m.allocated -= round_request(b.size);
      m.requested -= b.size;
      m.tag_bytes[b.tag] -= round_request(b.size);
      --m.tag_count[b.tag];
    } else if (dice < 99) {
      // A bad free: an error, and nothing changes (the checks below, the later reads).
      auto it = m.live.begin();
      std::advance(it, static_cast<long>(rng() % m.live.size()));
      int on_stack = 0;
      char* p = reinterpret_cast<char*>(&on_stack);
      std::size_t n = sizeof on_stack;
      Stream s = streams[0];
      switch (rng() % 4) {
        case 0:  // a freed base again, unless it is live again
          if (!freed.empty()) {
            char* again = freed[rng() % freed.size()];
            if (!m.live.contains(again)) {
              p = again;
              n = 1 + rng() % 4096;
            }
          }
          break;
        case 1:  // inside a live block
          if (it->second.size > 1) {
            p = it->first + 1 + rng() % (it->second.size - 1);
            n = 1;
            s = it->second.stream;
          }
          break;
        case 2:  // a live block with another size
          p = it->first;
          n = it->second.size > 1 && rng() % 2 == 0 ? it->second.size - 1 : it->second.size + 1;
          s = it->second.stream;
          break;
        default:  // never handed out
          break;
      }
      bool refused = false;
      try {
        alloc.deallocate(p, n, s);
      } catch (const AllocatorUsageError&) {
        refused = true;
      }
      ASSERT_TRUE(refused) << "a bad free of " << static_cast<void*>(p) << " (" << n
                           << " bytes) was taken, step " << step;
    } else {
      be.device_synchronize();
      alloc.empty_cache();
    }
    const AllocatorStats s = alloc.stats();
    ASSERT_EQ(s.allocated.current, m.allocated) << "step " << step;
    ASSERT_EQ(s.requested.current, m.requested) << "step " << step;
    ASSERT_GE(s.reserved.current, s.allocated.current) << "step " << step;
    if (host) {
      // Reserved is exactly the physical memory the backend has handed out: moved runs
      // are neither lost nor counted twice (on cuda other processes share the device).
      const MemInfo mi = be.mem_info();
      ASSERT_EQ(s.reserved.current, mi.total_bytes - mi.free_bytes) << "step " << step;
    }
    if (o.expandable_segments) {
      const MappingStats ms = alloc.mapping_stats();
      ASSERT_EQ(ms.map_calls, s.segments.allocated + ms.runs_moved) << "step " << step;
      ASSERT_EQ(ms.unmap_calls, s.segments.freed + ms.runs_moved) << "step " << step;
    }
    for (int t : tags) {
      ASSERT_EQ(s.tags[t].bytes.current, m.tag_bytes[t]) << "tag " << t << " step " << step;
      ASSERT_EQ(s.tags[t].count, m.tag_count[t]) << "tag " << t << " step " << step;
    }
    // Note [Cached memory by tag]: every cached byte is kept under exactly one tag, one
    // this sequence used; a tag's largest free block is among its cached bytes.
    std::uint64_t cached_under_tags = 0;
    for (int t = 0; t < kTagCount; ++t) {
      const TagStats& ts = s.tags[t];
      cached_under_tags += ts.cached_bytes;
      if (std::find(std::begin(tags), std::end(tags), t) == std::end(tags)) {
        ASSERT_EQ(ts.cached_bytes, 0u) << "tag " << t << " was never used, step " << step;
      }
      ASSERT_LE(ts.largest_free_block, ts.cached_bytes) << "tag " << t << " step " << step;
      ASSERT_LE(ts.largest_free_block, s.largest_free_block) << "tag " << t << " step " << step;
      ASSERT_GE(ts.fragmentation, 0.0);
      ASSERT_LT(ts.fragmentation, 1.0);
      ASSERT_EQ(ts.fragmentation == 0.0, ts.cached_bytes == ts.largest_free_block);
    }
    ASSERT_EQ(cached_under_tags, s.cached_bytes) << "step " << step;
    ASSERT_LE(s.largest_free_block, s.cached_bytes) << "step " << step;
  }
  for (auto& [p, b] : m.live) alloc.deallocate(p, b.size, b.stream);
  EXPECT_EQ(alloc.stats().allocated.current, 0u);
  be.device_synchronize();
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved.current, 0u);
  be.destroy_stream(streams[1]);
  mapping = alloc.mapping_stats();
}

TEST_P(Differential, RandomOperationsMatchTheReferenceModel) {
  TIDEPOOL_BACKEND_OR_SKIP(backend, std::get<0>(GetParam()), std::size_t{512} << 20);
  AllocatorOptions o;
  o.expandable_segments = std::get<1>(GetParam());
  MappingStats mapping;
  run_differential(std::move(backend), o, mapping);
}

// Small slots and moves whenever a free slot exists (Note [Moving free runs]): free
// slots move between holes and both streams' ranges all the time, under live blocks
// whose bytes must stay intact.
TEST_P(Differential, RandomOperationsWithEagerMovesMatchTheReferenceModel) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "moves apply to expandable segments";
  TIDEPOOL_BACKEND_OR_SKIP(backend, std::get<0>(GetParam()), std::size_t{512} << 20);
  AllocatorOptions o;
  o.map_slot_bytes = 2 * backend->granularity();
  o.move_slack = -1;
  MappingStats mapping;
  run_differential(std::move(backend), o, mapping);
  if (HasFatalFailure()) return;
  EXPECT_GT(mapping.runs_moved, 100u) << "the sequence should have moved slots many times";
}

INSTANTIATE_TEST_SUITE_P(Backends, Differential, test::backends_and_segment_kinds(),
                         test::backend_and_segments_name);

}  // namespace
}  // namespace tidepool
