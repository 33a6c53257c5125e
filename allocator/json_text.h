// The one JSON string escaper of libtidepool: the allocator snapshot and the tiering stats
// both write JSON by hand, and both carry text a user chose (tag names) or that comes from
// the system (a fallback reason), so both quote strings through here.
#pragma once

#include <string>
#include <string_view>

#include "allocator/export.h"

namespace tidepool {

// `text` as a JSON string literal, quotes included (RFC 8259): `"` and `\` are escaped,
// every control character U+0000..U+001F too (\n \r \t as such, the rest as \u00XX), and
// every other byte, UTF-8 included, passes through unchanged.
TIDEPOOL_API std::string json_quoted(std::string_view text);

}  // namespace tidepool
