// JSON string quoting: the allocator snapshot and the tiering stats write free text (a
// user-named tag, a fallback reason) through one escaper, so the same text comes out the
// same, and valid, in both; and the escaper itself covers RFC 8259's string rules.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "allocator/caching_allocator.h"
#include "allocator/json_text.h"
#include "allocator/tags.h"
#include "tests/allocator/test_support.h"
#include "tests/support/test_backend.h"
#include "tiering/stats_json.h"

namespace tidepool {
namespace {

using test::JsonChecker;

// A quote, a backslash, a newline, a tab and a \x01 byte, and how JSON spells them.
const std::string kAwkward = "q\"b\\n\nt\tc\x01z";
const std::string kAwkwardQuoted = R"("q\"b\\n\nt\tc\u0001z")";

TEST(JsonStrings, SnapshotAndTieringStatsQuoteTheSameTextTheSameWay) {
  CachingAllocator allocator(test_support::make_test_backend(BackendKind::host));
  void* p = nullptr;
  {
    TagScope tag(kAwkward);  // a user-named tag
    p = allocator.allocate(4096);
  }
  const std::string snapshot = allocator.snapshot_json();
  allocator.deallocate(p, 4096);
  EXPECT_TRUE(JsonChecker::valid(snapshot)) << snapshot;
  EXPECT_NE(snapshot.find("\"name\":" + kAwkwardQuoted), std::string::npos) << snapshot;
  EXPECT_NE(snapshot.find("\"tag\":" + kAwkwardQuoted), std::string::npos) << snapshot;

  HostArenaStats host;
  host.last_fallback_reason = kAwkward;
  const std::string stats = to_json(host);
  EXPECT_TRUE(JsonChecker::valid(stats)) << stats;
  EXPECT_NE(stats.find("\"last_fallback_reason\":" + kAwkwardQuoted), std::string::npos) << stats;
}

TEST(JsonStrings, EveryControlCharacterIsEscapedAndTheResultParses) {
  for (int c = 0; c < 0x20; ++c) {
    const std::string quoted = json_quoted(std::string(1, static_cast<char>(c)));
    EXPECT_EQ(quoted.find(static_cast<char>(c)), std::string::npos) << "control char " << c;
    EXPECT_TRUE(JsonChecker::valid(quoted)) << "control char " << c << ": " << quoted;
  }
  EXPECT_EQ(json_quoted(std::string_view("\0\x1f\b\f\r", 5)), R"("\u0000\u001f\u0008\u000c\r")");
}

TEST(JsonStrings, OtherBytesPassThroughUnchanged) {
  EXPECT_EQ(json_quoted(""), "\"\"");
  // UTF-8 (2- and 4-byte sequences), DEL and '/' need no escaping.
  const std::string text = "caf\xc3\xa9 \xf0\x9f\x98\x80 \x7f/";
  EXPECT_EQ(json_quoted(text), "\"" + text + "\"");
  EXPECT_TRUE(JsonChecker::valid(json_quoted(text)));
}

}  // namespace
}  // namespace tidepool
