// Recursive-descent JSON parser behind JsonValue (see json_value.h).
#include "json_value.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace tidepool::testing {

class JsonParser {
 public:
  explicit JsonParser(std::string_view text) : text_(text) {}

  JsonValue parse_document() {
    JsonValue value = parse_value();
    skip_space();
    if (pos_ != text_.size()) fail("trailing characters after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at byte " + std::to_string(pos_));
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end of input");
    return text_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  bool consume_literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  JsonValue parse_value() {
    JsonValue v;
    const char c = peek();
    if (c == '{') {
      v.kind_ = JsonValue::Kind::object;
      ++pos_;
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      while (true) {
        if (peek() != '"') fail("expected a string key");
        std::string key = parse_string();
        expect(':');
        v.object_.emplace(std::move(key), parse_value());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind_ = JsonValue::Kind::array;
      ++pos_;
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      while (true) {
        v.array_.push_back(parse_value());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind_ = JsonValue::Kind::string;
      v.string_ = parse_string();
      return v;
    }
    if (consume_literal("true")) {
      v.kind_ = JsonValue::Kind::boolean;
      v.boolean_ = true;
      return v;
    }
    if (consume_literal("false")) {
      v.kind_ = JsonValue::Kind::boolean;
      return v;
    }
    if (consume_literal("null")) return v;
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      v.kind_ = JsonValue::Kind::number;
      v.number_ = parse_number();
      return v;
    }
    // Python's json writes these for non-finite floats.
    if (consume_literal("NaN")) {
      v.kind_ = JsonValue::Kind::number;
      v.number_ = std::numeric_limits<double>::quiet_NaN();
      return v;
    }
    fail(std::string("unexpected character '") + c + "'");
  }

  double parse_number() {
    const std::string token(text_.substr(pos_, std::min<size_t>(64, text_.size() - pos_)));
    char* end = nullptr;
    const double value = std::strtod(token.c_str(), &end);
    if (end == token.c_str()) fail("malformed number");
    pos_ += static_cast<size_t>(end - token.c_str());
    return value;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ >= text_.size()) fail("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) fail("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          if (pos_ + 4 > text_.size()) fail("short \\u escape");
          const unsigned code = static_cast<unsigned>(
              std::stoul(std::string(text_.substr(pos_, 4)), nullptr, 16));
          pos_ += 4;
          // UTF-8 encode (surrogate pairs are not needed for these files: kept as-is).
          if (code < 0x80) {
            out.push_back(static_cast<char>(code));
          } else if (code < 0x800) {
            out.push_back(static_cast<char>(0xC0 | (code >> 6)));
            out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
          } else {
            out.push_back(static_cast<char>(0xE0 | (code >> 12)));
            out.push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3F)));
            out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
          }
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
};

JsonValue JsonValue::parse(std::string_view text) { return JsonParser(text).parse_document(); }

JsonValue JsonValue::parse_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  try {
    return parse(buffer.str());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

bool JsonValue::has(const std::string& key) const {
  return kind_ == Kind::object && object_.count(key) != 0;
}

double JsonValue::number() const {
  if (kind_ != Kind::number) throw std::runtime_error("JSON: value is not a number");
  return number_;
}
bool JsonValue::boolean() const {
  if (kind_ != Kind::boolean) throw std::runtime_error("JSON: value is not a boolean");
  return boolean_;
}
const std::string& JsonValue::string() const {
  if (kind_ != Kind::string) throw std::runtime_error("JSON: value is not a string");
  return string_;
}
const std::vector<JsonValue>& JsonValue::array() const {
  if (kind_ != Kind::array) throw std::runtime_error("JSON: value is not an array");
  return array_;
}
const std::map<std::string, JsonValue>& JsonValue::object() const {
  if (kind_ != Kind::object) throw std::runtime_error("JSON: value is not an object");
  return object_;
}
const JsonValue& JsonValue::operator[](const std::string& key) const {
  const auto& map = object();
  auto it = map.find(key);
  if (it == map.end()) throw std::runtime_error("JSON: missing key '" + key + "'");
  return it->second;
}

std::vector<double> JsonValue::numbers() const {
  std::vector<double> out;
  if (kind_ == Kind::number) {
    out.push_back(number_);
    return out;
  }
  for (const auto& item : array()) {
    const std::vector<double> inner = item.numbers();
    out.insert(out.end(), inner.begin(), inner.end());
  }
  return out;
}

}  // namespace tidepool::testing
