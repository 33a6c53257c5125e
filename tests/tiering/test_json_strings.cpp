// JSON text: the allocator snapshot and the tiering stats write free text (a user-named
// tag, a fallback reason) through one escaper, so the same text comes out the same, and
// valid, in both; the escaper itself covers RFC 8259's string rules and turns what is not
// UTF-8 into U+FFFD; numbers read back exactly, in every locale.
#include <gtest/gtest.h>

#include <limits>
#include <locale>
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

TEST(JsonStrings, BytesThatAreNotUtf8BecomeReplacementCharacters) {
  // A stray continuation byte, a lead byte cut short, an overlong '/', a UTF-16
  // surrogate and a code point above U+10FFFF: each byte that starts no valid sequence
  // becomes U+FFFD, and valid sequences around them pass unchanged.
  EXPECT_EQ(json_quoted("a\x80" "b\xc3"), R"("a\ufffdb\ufffd")");
  EXPECT_EQ(json_quoted("\xc0\xaf"), R"("\ufffd\ufffd")");
  EXPECT_EQ(json_quoted("\xed\xa0\x80"), R"("\ufffd\ufffd\ufffd")");
  EXPECT_EQ(json_quoted("\xf4\x90\x80\x80"), R"("\ufffd\ufffd\ufffd\ufffd")");
  EXPECT_EQ(json_quoted("\xe2\x82\xac\xff\xe2\x82\xac"), "\"\xe2\x82\xac\\ufffd\xe2\x82\xac\"");
  EXPECT_TRUE(valid_utf8("caf\xc3\xa9 \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf"));
  EXPECT_FALSE(valid_utf8("\xf0\x8f\xbf\xbf"));  // overlong 4-byte form
  EXPECT_FALSE(valid_utf8("\xe0\x9f\xbf"));      // overlong 3-byte form
}

TEST(JsonStrings, NumbersReadBackExactlyAndNonFiniteOnesAreNull) {
  EXPECT_EQ(json_number(0.125), "0.125");
  EXPECT_EQ(json_number(3.0), "3");
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(1e300), "1e+300");
  EXPECT_EQ(std::stod(json_number(1.0 / 3.0)), 1.0 / 3.0);
  EXPECT_EQ(json_number(std::numeric_limits<double>::quiet_NaN()), "null");
  EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "null");
}

// A C++ global locale that groups digits by three with '.' and writes a decimal comma,
// as de_DE does; made from a facet, so the C locale (printf's) is not touched.
struct GermanPunctuation : std::numpunct<char> {
  char do_decimal_point() const override { return ','; }
  char do_thousands_sep() const override { return '.'; }
  std::string do_grouping() const override { return "\3"; }
};

TEST(JsonStrings, TheSnapshotIsJsonWhateverTheGlobalLocale) {
  CachingAllocator allocator(test_support::make_test_backend(BackendKind::host));
  void* p = allocator.allocate(3 << 20);
  const std::locale previous =
      std::locale::global(std::locale(std::locale::classic(), new GermanPunctuation));
  std::string snapshot;
  try {
    snapshot = allocator.snapshot_json();
  } catch (...) {
    std::locale::global(previous);
    throw;
  }
  std::locale::global(previous);
  allocator.deallocate(p, 3 << 20);
  EXPECT_TRUE(JsonChecker::valid(snapshot)) << snapshot;
  EXPECT_NE(snapshot.find(std::to_string(3 << 20)), std::string::npos) << snapshot;
}

}  // namespace
}  // namespace tidepool
