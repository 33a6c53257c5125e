// JSON text for the hand-written JSON of the snapshot, the configuration and the tiering
// stats (see json_text.h). Strings: valid UTF-8 is copied as it is (JSON text is UTF-8, so
// multi-byte sequences need no escaping), anything else becomes U+FFFD, so one tag name
// or system message in another encoding cannot make a whole snapshot unreadable. Numbers:
// std::to_chars, which is locale-independent by definition, where printf's %g follows
// LC_NUMERIC.
#include "allocator/json_text.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace tidepool {

namespace {

bool continuation(std::string_view text, std::size_t at, unsigned char low = 0x80,
                  unsigned char high = 0xBF) {
  if (at >= text.size()) return false;
  const auto c = static_cast<unsigned char>(text[at]);
  return c >= low && c <= high;
}

}  // namespace

std::size_t utf8_sequence_length(std::string_view text, std::size_t at) {
  if (at >= text.size()) return 0;
  const auto lead = static_cast<unsigned char>(text[at]);
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return continuation(text, at + 1) ? 2 : 0;
  if (lead >= 0xE0 && lead <= 0xEF) {
    // E0 needs A0..BF next (else overlong); ED needs 80..9F (else a surrogate).
    const unsigned char low = lead == 0xE0 ? 0xA0 : 0x80;
    const unsigned char high = lead == 0xED ? 0x9F : 0xBF;
    return continuation(text, at + 1, low, high) && continuation(text, at + 2) ? 3 : 0;
  }
  if (lead >= 0xF0 && lead <= 0xF4) {
    // F0 needs 90..BF next (else overlong); F4 needs 80..8F (else above U+10FFFF).
    const unsigned char low = lead == 0xF0 ? 0x90 : 0x80;
    const unsigned char high = lead == 0xF4 ? 0x8F : 0xBF;
    return continuation(text, at + 1, low, high) && continuation(text, at + 2) &&
                   continuation(text, at + 3)
               ? 4
               : 0;
  }
  return 0;
}

bool valid_utf8(std::string_view text) {
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t n = utf8_sequence_length(text, at);
    if (n == 0) return false;
    at += n;
  }
  return true;
}

std::string json_quoted(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (std::size_t at = 0; at < text.size();) {
    const char c = text[at];
    const std::size_t n = utf8_sequence_length(text, at);
    if (n == 0) {
      out += "\\ufffd";
      ++at;
      continue;
    }
    if (n > 1) {
      out.append(text.substr(at, n));
      at += n;
      continue;
    }
    ++at;
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c) + 0u);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  if (ec != std::errc{}) return "null";  // 32 bytes hold any double's shortest form
  return std::string(buf, end);
}

}  // namespace tidepool
