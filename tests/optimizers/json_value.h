// A small JSON reader for the golden trajectory files (no third-party dependency: LibTorch
// does not ship a JSON library in its public headers). Parses the whole grammar (objects,
// arrays, strings with escapes, numbers, true/false/null) into a JsonValue tree; malformed
// input throws std::runtime_error with the byte offset.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tidepool::testing {

class JsonValue {
 public:
  enum class Kind { null, boolean, number, string, array, object };

  static JsonValue parse(std::string_view text);
  static JsonValue parse_file(const std::string& path);

  Kind kind() const noexcept { return kind_; }
  bool is_null() const noexcept { return kind_ == Kind::null; }
  bool has(const std::string& key) const;

  // Typed access; the wrong kind or a missing key throws std::runtime_error naming it.
  double number() const;
  bool boolean() const;
  const std::string& string() const;
  const std::vector<JsonValue>& array() const;
  const JsonValue& operator[](const std::string& key) const;
  const std::map<std::string, JsonValue>& object() const;
  // An array of numbers (nested arrays are flattened in order).
  std::vector<double> numbers() const;

 private:
  friend class JsonParser;
  Kind kind_ = Kind::null;
  bool boolean_ = false;
  double number_ = 0.0;
  std::string string_;
  std::vector<JsonValue> array_;
  std::map<std::string, JsonValue> object_;
};

}  // namespace tidepool::testing
