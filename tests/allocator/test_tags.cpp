// Tags: names and ids, the thread-local stack, RAII scoping (also around unbalanced C
// pushes and pops), limits.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/tags.h"

namespace tidepool {
namespace {

TEST(Tags, BuiltInsHaveTheirCApiIds) {
  EXPECT_EQ(tag_id("untagged"), kTagUntagged);
  EXPECT_EQ(tag_id("parameter"), kTagParameter);
  EXPECT_EQ(tag_id("gradient"), kTagGradient);
  EXPECT_EQ(tag_id("activation"), kTagActivation);
  EXPECT_EQ(tag_id("optimizer_state"), kTagOptimizerState);
  EXPECT_EQ(tag_id("workspace"), kTagWorkspace);
  EXPECT_STREQ(tag_name(kTagWorkspace), "workspace");
}

TEST(Tags, UserTagsAreCreatedOnceAndKeepTheirName) {
  const int a = tag_id("tags_test_user");
  EXPECT_GE(a, TIDEPOOL_TAG_FIRST_USER);
  EXPECT_EQ(tag_id("tags_test_user"), a);
  EXPECT_STREQ(tag_name(a), "tags_test_user");
  EXPECT_EQ(tag_name(tag_count()), nullptr);
}

TEST(Tags, ScopesNestAndUnwind) {
  EXPECT_EQ(current_tag(), kTagUntagged);
  {
    TagScope outer(kTagParameter);
    EXPECT_EQ(current_tag(), kTagParameter);
    {
      TagScope inner("activation");
      EXPECT_EQ(current_tag(), kTagActivation);
    }
    EXPECT_EQ(current_tag(), kTagParameter);
  }
  EXPECT_EQ(current_tag(), kTagUntagged);
}

TEST(Tags, TheStackIsPerThread) {
  TagScope here(kTagGradient);
  int seen = -1;
  std::thread([&] { seen = current_tag(); }).join();
  EXPECT_EQ(seen, kTagUntagged);
  EXPECT_EQ(current_tag(), kTagGradient);
}

TEST(Tags, MisuseIsAClearError) {
  EXPECT_THROW(pop_tag(), std::logic_error);
  EXPECT_THROW(push_tag(-1), std::invalid_argument);
  EXPECT_THROW(push_tag(kTagCount), std::invalid_argument);
  EXPECT_THROW(tag_id(""), std::invalid_argument);
  EXPECT_THROW(tag_id(std::string(100, 'x')), std::invalid_argument);
  int pushed = 0;
  try {
    for (; pushed < kMaxTagDepth + 1; ++pushed) push_tag(kTagParameter);
  } catch (const std::length_error&) {
  }
  EXPECT_EQ(pushed, kMaxTagDepth);
  for (int i = 0; i < pushed; ++i) pop_tag();
  EXPECT_EQ(current_tag(), kTagUntagged);
}

TEST(Tags, ANameThatIsNotUtf8IsRefusedWithAClearError) {
  const int before = tag_count();
  try {
    tag_id("caf\xe9");  // Latin-1
    ADD_FAILURE() << "a Latin-1 name was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tag_count(), before);
  EXPECT_GE(tag_id("caf\xc3\xa9"), 0);  // the same name in UTF-8
  EXPECT_EQ(tidepool_tag_id("caf\xe9"), -1);
}

// Review finding: a name with a NUL byte was taken through the C++ tag_id, and read back
// through tag_name (a C string) as the part before it: two tags both named "a" in the
// snapshot, the first unreachable by name through the C ABI.
TEST(Tags, ANameWithANulByteIsRefused) {
  const int before = tag_count();
  try {
    tag_id(std::string_view("nul\0tag", 7));
    ADD_FAILURE() << "a name with a NUL byte was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("NUL"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tag_count(), before);
}

TEST(Tags, AScopeWhoseTagWasPoppedInsideItEndsWithoutAborting) {
  ::testing::internal::CaptureStderr();
  {
    TagScope outer(kTagGradient);
    {
      TagScope scope(kTagParameter);
      EXPECT_EQ(tidepool_tag_pop(), 0);  // unbalanced: takes the scope's own tag
      EXPECT_EQ(current_tag(), kTagGradient);
    }  // pops nothing: the outer scope's tag stays
    EXPECT_EQ(current_tag(), kTagGradient);
  }
  EXPECT_EQ(current_tag(), kTagUntagged);
  EXPECT_EQ(tag_depth(), 0);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("its own tag was popped inside it"), std::string::npos) << said;
}

TEST(Tags, AScopeEndsThePushesLeftOpenInsideIt) {
  {
    TagScope scope(kTagParameter);
    EXPECT_EQ(tidepool_tag_push(kTagWorkspace), 0);  // never popped
    EXPECT_EQ(current_tag(), kTagWorkspace);
  }
  EXPECT_EQ(current_tag(), kTagUntagged);
  EXPECT_EQ(tag_depth(), 0);
}

TEST(Tags, EveryLevelOfADeepStackComesBackInOrder) {
  // Deep enough to leave the stack's inline part (16 levels) and come back, twice.
  const int user = tag_id("deep-stack-test");
  const auto tag_at = [&](int level) { return level % 3 == 0 ? user : level % 6; };
  for (int round = 0; round < 2; ++round) {
    for (int level = 0; level < kMaxTagDepth; ++level) {
      push_tag(tag_at(level));
      ASSERT_EQ(current_tag(), tag_at(level)) << "push at level " << level;
    }
    for (int level = kMaxTagDepth - 1; level > 0; --level) {
      pop_tag();
      ASSERT_EQ(current_tag(), tag_at(level - 1)) << "pop to level " << level - 1;
    }
    pop_tag();
    EXPECT_EQ(current_tag(), kTagUntagged);
  }
  EXPECT_THROW(pop_tag(), std::logic_error);
}

// A thread that ends with more than the stack's inline part open (a scope leaked on an
// error path, a C caller's missing pops) gives the heap part back at its exit; one that
// closes its scopes gives it back on the way down.
TEST(Tags, AThreadEndingWithADeepStackOpenLeavesNothingBehind) {
  ASSERT_EQ(tag_stacks_on_heap(), 0);
  std::atomic<int> deep{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int level = 0; level < 20 + t; ++level) push_tag(kTagActivation);
      deep.fetch_add(tag_stacks_on_heap() > 0 ? 1 : 0);
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(deep.load(), 4) << "each thread's stack went past its inline part";
  EXPECT_EQ(tag_stacks_on_heap(), 0) << "every heap part was freed at thread exit";

  std::thread([] {
    for (int level = 0; level < 40; ++level) push_tag(kTagGradient);
    EXPECT_EQ(tag_stacks_on_heap(), 1);
    for (int level = 0; level < 40; ++level) pop_tag();
    EXPECT_EQ(tag_stacks_on_heap(), 0) << "freed once the nesting is shallow again";
    for (int level = 0; level < 17; ++level) push_tag(kTagGradient);
    EXPECT_EQ(current_tag(), kTagGradient);
  }).join();
  EXPECT_EQ(tag_stacks_on_heap(), 0);
  EXPECT_EQ(current_tag(), kTagUntagged) << "other threads' stacks are not this one's";
}

TEST(Tags, TheTableFillsUpWithAClearError) {
  bool full = false;
  for (int i = 0; i < kTagCount + 1 && !full; ++i) {
    try {
      tag_id("fill_" + std::to_string(i));
    } catch (const std::length_error& e) {
      full = true;
      EXPECT_NE(std::string(e.what()).find("all 64 tag ids are in use"), std::string::npos);
    }
  }
  EXPECT_TRUE(full);
}

}  // namespace
}  // namespace tidepool
