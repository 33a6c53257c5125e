// The one JSON text writer of libtidepool: the allocator snapshot, the configuration and the
// tiering stats all write JSON by hand, and carry text a user chose (tag names) or that
// comes from the system (a fallback reason), and numbers that must read the same in every
// locale, so strings and numbers go through here.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "allocator/export.h"

namespace tidepool {

// `text` as a JSON string literal, quotes included (RFC 8259): `"` and `\` are escaped,
// every control character U+0000..U+001F too (\n \r \t as such, the rest as \u00XX), valid
// UTF-8 passes through unchanged, and each byte that does not start a valid UTF-8 sequence
// becomes U+FFFD, so the result is always valid JSON text (which is UTF-8).
TIDEPOOL_API std::string json_quoted(std::string_view text);

// `v` as a JSON number, the shortest text that reads back as `v`, in the "C" locale's form
// whatever the process's locale (a decimal comma would be invalid JSON); NaN and the
// infinities, which JSON cannot say, as null.
TIDEPOOL_API std::string json_number(double v);

// The length of the UTF-8 sequence (RFC 3629: no overlong forms, no surrogates, nothing
// above U+10FFFF) that starts text[at], or 0 when none does.
TIDEPOOL_API std::size_t utf8_sequence_length(std::string_view text, std::size_t at);

// Whether all of `text` is valid UTF-8.
TIDEPOOL_API bool valid_utf8(std::string_view text);

}  // namespace tidepool
