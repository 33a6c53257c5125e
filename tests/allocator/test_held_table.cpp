// HeldTable (allocator/held_table.h), the thread cache's open-addressing table of held
// blocks: random inserts and erases against std::map, so the backward-shift deletion keeps
// every remaining block findable (probe runs that wrap around the end included), and a
// full table refuses more.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "allocator/held_table.h"
#include "tests/support/test_seed.h"

namespace tidepool::detail {
namespace {

TEST(HeldTable, RandomInsertsAndErasesMatchAMap) {
  // Fake blocks: the table reads only Block::ptr.
  std::vector<Block> blocks(3 * HeldTable::kMax);
  for (std::size_t i = 0; i < blocks.size(); ++i)
    blocks[i].ptr = reinterpret_cast<char*>(std::uintptr_t{1} << 32) + i * 512;
  HeldTable table;
  std::map<const void*, Block*> model;
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937 rng(static_cast<std::mt19937::result_type>(test_support::seeded(7)));
  for (int step = 0; step < 200000; ++step) {
    Block* b = &blocks[rng() % blocks.size()];
    if (model.count(b->ptr) != 0) {
      table.erase(b->ptr);
      model.erase(b->ptr);
    } else {
      const bool inserted = table.insert(b);
      ASSERT_EQ(inserted, model.size() < HeldTable::kMax) << "step " << step;
      if (inserted) model[b->ptr] = b;
    }
    ASSERT_EQ(table.size(), model.size());
    if (step % 1000 == 0) {
      for (const Block& x : blocks) {
        auto it = model.find(x.ptr);
        ASSERT_EQ(table.find(x.ptr), it == model.end() ? nullptr : it->second) << "step " << step;
      }
    }
  }
  std::size_t visited = 0;
  table.for_each([&](Block* b) {
    EXPECT_EQ(model.count(b->ptr), 1u);
    ++visited;
  });
  EXPECT_EQ(visited, model.size());
  table.clear();
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.find(blocks[0].ptr), nullptr);
}

TEST(HeldTable, ErasingAnAbsentPointerChangesNothing) {
  Block a, b;
  a.ptr = reinterpret_cast<char*>(0x10000);
  b.ptr = reinterpret_cast<char*>(0x20000);
  HeldTable table;
  table.erase(a.ptr);  // empty table
  ASSERT_TRUE(table.insert(&a));
  table.erase(b.ptr);
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(table.find(a.ptr), &a);
}

}  // namespace
}  // namespace tidepool::detail
