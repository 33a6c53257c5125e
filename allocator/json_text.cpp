// JSON string quoting for the hand-written JSON of the snapshot and the tiering stats (see
// json_text.h). Bytes >= 0x20 are copied as they are: JSON text is UTF-8, so multi-byte
// sequences need no escaping, and the writer must not reinterpret them.
#include "allocator/json_text.h"

#include <cstdio>

namespace tidepool {

std::string json_quoted(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (const char c : text) {
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

}  // namespace tidepool
