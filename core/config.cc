#include "core/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zoe::config {
namespace {

using Json = nlohmann::json;
__extension__ using Uint128 = unsigned __int128;  // exact size arithmetic without overflow

// 2^64 as a double: the first value a uint64_t cannot hold.
constexpr double kTwoToThe64 = 18446744073709551616.0;

constexpr std::string_view kSizeForms =
    "a byte count such as 1048576 or 1e6, or a string with a unit: B, K, M, G, T "
    "(binary, same as KiB, MiB, GiB, TiB) or KB, MB, GB, TB (decimal)";

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  return text;
}

// Line and column (both 1-based) of byte `offset` in `text`.
std::pair<size_t, size_t> LineAndColumn(std::string_view text, size_t offset) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

// nlohmann's messages start with "[json.exception.parse_error.101] parse error at line 1,
// column 5: "; keep only what follows, since zoe states the position itself.
std::string_view ParseErrorDetail(std::string_view what) {
  const size_t colon = what.find(": ");
  return colon == std::string_view::npos ? what : what.substr(colon + 2);
}

// The multiplier of a size unit (case-insensitive), or 0 when the unit is unknown.
uint64_t UnitMultiplier(std::string_view unit) {
  struct Unit {
    std::string_view name;
    uint64_t multiplier;
  };
  static constexpr std::array<Unit, 14> kUnits = {{
      {"", 1},
      {"b", 1},
      {"k", 1ull << 10},
      {"kib", 1ull << 10},
      {"kb", 1000ull},
      {"m", 1ull << 20},
      {"mib", 1ull << 20},
      {"mb", 1000ull * 1000},
      {"g", 1ull << 30},
      {"gib", 1ull << 30},
      {"gb", 1000ull * 1000 * 1000},
      {"t", 1ull << 40},
      {"tib", 1ull << 40},
      {"tb", 1000ull * 1000 * 1000 * 1000},
  }};
  const std::string lower = Lower(unit);
  for (const Unit& u : kUnits) {
    if (u.name == lower) return u.multiplier;
  }
  return 0;
}

std::string JsonTypeName(const Json& value) {
  if (value.is_number_float()) return "number";
  if (value.is_number()) return "integer";
  return value.type_name();
}

// The value as it appears in a message: strings quoted, containers elided.
std::string Describe(const Json& value) {
  if (value.is_array()) return "an array";
  return DescribeJson(value);
}

// "4096 (4 KiB)" for sizes that are whole binary units, else just the number.
std::string DescribeSize(uint64_t bytes) {
  static constexpr std::array<std::pair<uint64_t, std::string_view>, 4> kUnits = {
      {{1ull << 40, "TiB"}, {1ull << 30, "GiB"}, {1ull << 20, "MiB"}, {1ull << 10, "KiB"}}};
  for (const auto& [multiplier, name] : kUnits) {
    if (bytes >= multiplier && bytes % multiplier == 0) {
      return fmt::format("{} ({} {})", bytes, bytes / multiplier, name);
    }
  }
  return std::to_string(bytes);
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

// The tokens Python's json module writes for non-finite floats, "-Infinity" before "Infinity" so
// that the longer one is matched first.
constexpr std::array<std::pair<std::string_view, double>, 3> kNonFiniteTokens = {{
    {"-Infinity", -std::numeric_limits<double>::infinity()},
    {"Infinity", std::numeric_limits<double>::infinity()},
    {"NaN", std::numeric_limits<double>::quiet_NaN()},
}};

// A token replaced by a marker string: where it was in the original text and in the rewritten
// one, and the lengths of both.
struct Replacement {
  size_t original_offset;
  size_t marked_offset;
  size_t original_length;
  size_t marked_length;
};

struct MarkedText {
  std::string text;
  std::vector<Replacement> replacements;
};

bool IsTokenChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '+' ||
         c == '-';
}

// The non-finite token starting at `text[i]` and standing alone, or null.
const std::pair<std::string_view, double>* NonFiniteTokenAt(std::string_view text, size_t i) {
  if (i > 0 && IsTokenChar(text[i - 1])) return nullptr;
  for (const auto& token : kNonFiniteTokens) {
    const size_t end = i + token.first.size();
    if (text.substr(i, token.first.size()) != token.first) continue;
    if (end < text.size() && IsTokenChar(text[end])) continue;
    return &token;
  }
  return nullptr;
}

// Whether a JSON value may start after `previous` (the last character outside strings that is
// not whitespace, '\0' before the first), with `open` the brackets open there: a key may not.
bool ValueMayStart(char previous, const std::vector<char>& open) {
  if (previous == ':' || previous == '[' || previous == '\0') return true;
  return previous == ',' && !open.empty() && open.back() == '[';
}

// `text` with every non-finite token where a value may start (outside strings, not a key)
// replaced by the string "\u0000<token>", which parses as JSON; elsewhere the token stays, for
// the parser to refuse. Scans once, keeping track of strings, their escapes and brackets.
MarkedText MarkNonFiniteTokens(std::string_view text) {
  MarkedText out;
  out.text.reserve(text.size());
  bool in_string = false;
  std::vector<char> open;
  char previous = '\0';
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool value_may_start = !in_string && ValueMayStart(previous, open);
    const auto* token = value_may_start ? NonFiniteTokenAt(text, i) : nullptr;
    if (token != nullptr) {
      const std::string marker = fmt::format("\"\\u0000{}\"", token->first);
      out.replacements.push_back({i, out.text.size(), token->first.size(), marker.size()});
      out.text += marker;
      i += token->first.size() - 1;
      previous = '"';  // a value ended
      continue;
    }
    out.text += c;
    if (in_string) {
      if (c == '\\' && i + 1 < text.size()) out.text += text[++i];
      if (c == '"') {
        in_string = false;
        previous = '"';
      }
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '{' || c == '[') open.push_back(c);
    if ((c == '}' || c == ']') && !open.empty()) open.pop_back();
    if (c != '"' && !std::isspace(static_cast<unsigned char>(c))) previous = c;
  }
  return out;
}

// The offset in the original text of `offset` in the marked one.
size_t OriginalOffset(const MarkedText& marked, size_t offset) {
  size_t grown = 0;
  for (const Replacement& r : marked.replacements) {
    if (offset < r.marked_offset) break;
    if (offset < r.marked_offset + r.marked_length) return r.original_offset;
    grown += r.marked_length - r.original_length;
  }
  return offset - grown;
}

// The number a marker string stands for, or null for any other value.
std::optional<double> MarkedNumber(const Json& value) {
  if (!value.is_string()) return std::nullopt;
  const std::string& text = value.get_ref<const std::string&>();
  if (text.empty() || text.front() != '\0') return std::nullopt;
  for (const auto& [token, number] : kNonFiniteTokens) {
    if (std::string_view(text).substr(1) == token) return number;
  }
  return std::nullopt;
}

// Parses `marked.text` (with markers read back as numbers when `read_markers`); errors name
// offsets in `original`.
Result<Json> ParseMarked(std::string_view original, const MarkedText& marked, bool read_markers) {
  // Reading, copying and printing a document recurse once per level, so an absurdly nested one
  // would overflow the stack; the callback stops the parser at the first level too deep.
  struct TooDeep {};
  const Json::parser_callback_t callback = [read_markers](int depth, Json::parse_event_t event,
                                                          Json& parsed) {
    const bool opens =
        event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start;
    if (opens && depth >= kMaxJsonDepth) throw TooDeep{};  // depth: levels already open
    if (read_markers && event == Json::parse_event_t::value) {
      if (const std::optional<double> number = MarkedNumber(parsed)) parsed = *number;
    }
    return true;
  };
  try {
    return Json::parse(marked.text.begin(), marked.text.end(), callback);
  } catch (const TooDeep&) {
    return Status::InvalidArgument(fmt::format(
        "JSON nested deeper than {} levels; allowed: at most {} levels of objects and arrays",
        kMaxJsonDepth, kMaxJsonDepth));
  } catch (const Json::parse_error& e) {
    // e.byte counts from 1 and points at the character that stopped the parser.
    const size_t offset = OriginalOffset(marked, e.byte == 0 ? 0 : e.byte - 1);
    const auto [line, column] = LineAndColumn(original, offset);
    return Status::InvalidArgument(
        fmt::format("JSON syntax error at byte offset {} (line {}, column {}): {}", offset, line,
                    column, ParseErrorDetail(e.what())));
  } catch (const std::exception& e) {
    return Status::InvalidArgument(fmt::format("cannot parse JSON: {}", e.what()));
  }
}

}  // namespace

Result<Json> ParseJson(std::string_view text) {
  return ParseMarked(text, MarkedText{std::string(text), {}}, /*read_markers=*/false);
}

Result<Json> ParseConfigJson(std::string_view text) {
  // A marker starts with a NUL, which a document can hold only written as \u0000; one that
  // writes it is parsed as plain JSON, so that none of its strings is taken for a marker.
  if (Lower(text).find("\\u0000") != std::string::npos) return ParseJson(text);
  return ParseMarked(text, MarkNonFiniteTokens(text), /*read_markers=*/true);
}

std::string WriteConfigJson(const Json& value) {
  if (value.is_object()) {
    std::vector<std::string> members;
    for (const auto& [key, member] : value.items()) {
      members.push_back(fmt::format("{}:{}", Json(key).dump(), WriteConfigJson(member)));
    }
    return fmt::format("{{{}}}", fmt::join(members, ","));
  }
  if (value.is_array()) {
    std::vector<std::string> items;
    for (const Json& item : value) items.push_back(WriteConfigJson(item));
    return fmt::format("[{}]", fmt::join(items, ","));
  }
  if (value.is_number_float() && !std::isfinite(value.get<double>())) {
    const double number = value.get<double>();
    if (std::isnan(number)) return "NaN";
    return number > 0 ? "Infinity" : "-Infinity";
  }
  return value.dump();
}

std::string DescribeJson(const Json& value) {
  if (value.is_object()) return "an object";
  if (!value.is_array()) return WriteConfigJson(value);
  std::vector<std::string> items;
  for (const Json& item : value) items.push_back(DescribeJson(item));
  return fmt::format("[{}]", fmt::join(items, ","));
}

// Exact decimal arithmetic: "1.5GiB" is 15 * 2^30 / 10, integral or an error, never rounded.
Result<uint64_t> ParseSizeString(std::string_view text) {
  const std::string_view trimmed = Trim(text);
  auto error = [&](std::string_view why) {
    return Status::InvalidArgument(
        fmt::format("size '{}' {}; allowed: {}", std::string(text), why, kSizeForms));
  };
  if (trimmed.empty()) return error("is empty");
  if (trimmed.front() == '-') return error("is negative");
  size_t pos = trimmed.front() == '+' ? 1 : 0;
  Uint128 integer = 0, fraction = 0, scale = 1;
  size_t digits = 0;
  for (; pos < trimmed.size() && std::isdigit(static_cast<unsigned char>(trimmed[pos])); ++pos) {
    integer = integer * 10 + static_cast<unsigned>(trimmed[pos] - '0');
    if (integer > std::numeric_limits<uint64_t>::max()) return error("overflows 64 bits");
    ++digits;
  }
  if (pos < trimmed.size() && trimmed[pos] == '.') {
    for (++pos; pos < trimmed.size() && std::isdigit(static_cast<unsigned char>(trimmed[pos]));
         ++pos) {
      if (scale > 1'000'000'000'000'000'000ull) return error("has too many fraction digits");
      fraction = fraction * 10 + static_cast<unsigned>(trimmed[pos] - '0');
      scale *= 10;
      ++digits;
    }
  }
  if (digits == 0) return error("does not start with a number");
  const std::string_view unit = Trim(trimmed.substr(pos));
  const uint64_t multiplier = UnitMultiplier(unit);
  if (multiplier == 0) return error(fmt::format("has an unknown unit '{}'", unit));
  const Uint128 fraction_bytes = fraction * multiplier;
  if (fraction_bytes % scale != 0) return error("is not a whole number of bytes");
  const Uint128 bytes = integer * multiplier + fraction_bytes / scale;
  if (bytes > std::numeric_limits<uint64_t>::max()) return error("overflows 64 bits");
  return static_cast<uint64_t>(bytes);
}

Result<uint64_t> ParseSize(const Json& value) {
  if (value.is_string()) return ParseSizeString(value.get_ref<const std::string&>());
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  const std::string shown = Describe(value);
  auto error = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format("size {} {}; allowed: {}", shown, why, kSizeForms));
  };
  if (value.is_number_integer()) {  // signed: what nlohmann makes of a C++ int
    if (value.get<int64_t>() < 0) return error("is negative");
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  if (!value.is_number_float()) return error(fmt::format("has type {}", JsonTypeName(value)));
  const double d = value.get<double>();
  if (!std::isfinite(d)) return error("is not finite");
  if (d < 0) return error("is negative");
  if (d != std::floor(d)) return error("is not a whole number of bytes");
  if (d >= kTwoToThe64) return error("overflows 64 bits");
  return static_cast<uint64_t>(d);
}

std::string ClosestMatch(std::string_view name, std::span<const std::string> candidates) {
  const std::string lower_name = Lower(name);
  // A plausible typo differs in about a third of the name, or names a part of the candidate.
  const size_t limit = std::max<size_t>(2, lower_name.size() / 3);
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const std::string& candidate : candidates) {
    const std::string lower = Lower(candidate);
    size_t distance = EditDistance(lower_name, lower);
    const bool contains = lower_name.size() >= 3 && (lower.find(lower_name) != std::string::npos ||
                                                     lower_name.find(lower) != std::string::npos);
    if (distance > limit && !contains) continue;
    if (contains) distance = std::min(distance, limit);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// ObjectReader

ObjectReader::ObjectReader(const Json& object, std::string path)
    : object_(object), path_(std::move(path)) {
  if (!object_.is_object()) {
    status_ = Status::InvalidArgument(fmt::format("'{}' must be a JSON object, got {} ({})",
                                                  path_.empty() ? "<root>" : path_,
                                                  Describe(object_), JsonTypeName(object_)));
  }
}

std::string ObjectReader::KeyPath(std::string_view key) const {
  return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
}

ObjectReader& ObjectReader::Alias(std::string_view old_name, std::string_view canonical) {
  aliases_.emplace_back(std::string(old_name), std::string(canonical));
  return *this;
}

// Looks `key` up under its own name and every alias of it, marks what it found as consumed, and
// fails when two spellings of the same option are both present.
const Json* ObjectReader::Find(std::string_view key) {
  known_.emplace_back(key);
  if (!status_.ok()) return nullptr;
  const Json* found = nullptr;
  std::string found_name;
  auto look = [&](const std::string& name) {
    auto it = object_.find(name);
    if (it == object_.end()) return;
    if (found != nullptr) {
      status_ = Status::InvalidArgument(
          fmt::format("both '{}' and '{}' are given; they are the same option, keep one",
                      KeyPath(found_name), KeyPath(name)));
      return;
    }
    found = &*it;
    found_name = name;
    consumed_.push_back(name);
  };
  look(std::string(key));
  for (const auto& [old_name, canonical] : aliases_) {
    if (canonical == key) look(old_name);
  }
  found_key_ = found_name;
  return status_.ok() ? found : nullptr;
}

namespace {

Status WrongType(const std::string& key_path, std::string_view expected, const Json& value) {
  return Status::InvalidArgument(fmt::format("{}: expected {}, got {} ({})", key_path, expected,
                                             Describe(value), JsonTypeName(value)));
}

Status OutOfRange(const std::string& key_path, const std::string& value, const std::string& min,
                  const std::string& max) {
  return Status::InvalidArgument(
      fmt::format("{} = {} is out of range; allowed: {}..{}", key_path, value, min, max));
}

}  // namespace

ObjectReader& ObjectReader::Size(std::string_view key, uint64_t* out, uint64_t min, uint64_t max) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  Result<uint64_t> bytes = ParseSize(*value);
  if (!bytes.ok()) {
    status_ = std::move(bytes).status().WithContext(KeyPath(found_key_));
  } else if (*bytes < min || *bytes > max) {
    status_ =
        OutOfRange(KeyPath(found_key_), Describe(*value), DescribeSize(min), DescribeSize(max));
  } else {
    *out = *bytes;
  }
  return *this;
}

ObjectReader& ObjectReader::UInt(std::string_view key, uint64_t* out, uint64_t min, uint64_t max) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  const std::string expected = fmt::format("an integer in {}..{}", min, max);
  if (value->is_number_unsigned() || (value->is_number_integer() && value->get<int64_t>() >= 0)) {
    const uint64_t v = value->get<uint64_t>();
    if (v < min || v > max) {
      status_ = OutOfRange(KeyPath(found_key_), std::to_string(v), std::to_string(min),
                           std::to_string(max));
    } else {
      *out = v;
    }
  } else if (value->is_number_integer()) {
    status_ =
        OutOfRange(KeyPath(found_key_), Describe(*value), std::to_string(min), std::to_string(max));
  } else if (value->is_number_float() && value->get<double>() == std::floor(value->get<double>()) &&
             std::isfinite(value->get<double>())) {
    const double d = value->get<double>();
    // 2^64 is the first double a uint64_t cannot hold (the largest one rounds up to it).
    if (d < static_cast<double>(min) || d > static_cast<double>(max) || d >= kTwoToThe64) {
      status_ = OutOfRange(KeyPath(found_key_), Describe(*value), std::to_string(min),
                           std::to_string(max));
    } else {
      *out = static_cast<uint64_t>(d);
    }
  } else {
    status_ = WrongType(KeyPath(found_key_), expected, *value);
  }
  return *this;
}

ObjectReader& ObjectReader::Double(std::string_view key, double* out, double min, double max) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  if (!value->is_number()) {
    status_ = WrongType(KeyPath(found_key_), fmt::format("a number in {}..{}", min, max), *value);
    return *this;
  }
  const double d = value->get<double>();
  if (!(d >= min && d <= max)) {
    status_ = OutOfRange(KeyPath(found_key_), Describe(*value), fmt::format("{}", min),
                         fmt::format("{}", max));
  } else {
    *out = d;
  }
  return *this;
}

template <class T>
ObjectReader& ObjectReader::Typed(std::string_view key, T* out, bool (Json::*is)() const noexcept,
                                  std::string_view expected) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  if (!(value->*is)()) {
    status_ = WrongType(KeyPath(found_key_), expected, *value);
  } else {
    *out = value->get<T>();
  }
  return *this;
}

ObjectReader& ObjectReader::Bool(std::string_view key, bool* out) {
  return Typed(key, out, &Json::is_boolean, "true or false");
}

ObjectReader& ObjectReader::String(std::string_view key, std::string* out) {
  return Typed(key, out, &Json::is_string, "a string");
}

ObjectReader& ObjectReader::StringList(std::string_view key, std::vector<std::string>* out) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  if (value->is_string()) {
    *out = {value->get<std::string>()};
    return *this;
  }
  const bool all_strings =
      value->is_array() &&
      std::all_of(value->begin(), value->end(), [](const Json& v) { return v.is_string(); });
  if (!all_strings) {
    status_ = WrongType(KeyPath(found_key_), "a string or an array of strings", *value);
    return *this;
  }
  out->clear();
  for (const Json& item : *value) out->push_back(item.get<std::string>());
  return *this;
}

ObjectReader& ObjectReader::Enum(std::string_view key, std::string* out,
                                 std::span<const std::string_view> allowed) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  const std::string allowed_list = fmt::format("{}", fmt::join(allowed, ", "));
  if (!value->is_string()) {
    status_ = WrongType(KeyPath(found_key_), fmt::format("one of {}", allowed_list), *value);
    return *this;
  }
  const std::string& text = value->get_ref<const std::string&>();
  if (std::find(allowed.begin(), allowed.end(), text) != allowed.end()) {
    *out = text;
    return *this;
  }
  const std::vector<std::string> candidates(allowed.begin(), allowed.end());
  const std::string closest = ClosestMatch(text, candidates);
  status_ = Status::InvalidArgument(fmt::format(
      "{} = '{}' is not allowed;{} allowed: {}", KeyPath(found_key_), text,
      closest.empty() ? "" : fmt::format(" did you mean '{}'?", closest), allowed_list));
  return *this;
}

ObjectReader& ObjectReader::Object(std::string_view key,
                                   const std::function<Status(ObjectReader&)>& read) {
  const Json* value = Find(key);
  if (value == nullptr) return *this;
  ObjectReader nested(*value, KeyPath(found_key_));
  Status status = nested.status_;  // a non-object is reported before `read` runs
  if (status.ok()) status = read(nested);
  if (status.ok()) status = nested.Finish();
  status_ = std::move(status);
  return *this;
}

ObjectReader& ObjectReader::Ignore(std::string_view key) {
  Find(key);
  return *this;
}

ObjectReader& ObjectReader::Ignore(std::string_view key, std::vector<std::string>* ignored) {
  if (Find(key) != nullptr) ignored->push_back(KeyPath(found_key_));
  return *this;
}

ObjectReader& ObjectReader::Value(std::string_view key, std::optional<nlohmann::json>* out) {
  const Json* value = Find(key);
  if (value != nullptr) *out = *value;
  return *this;
}

Status ObjectReader::Finish() {
  if (!status_.ok()) return status_;
  for (const auto& [name, value] : object_.items()) {
    if (std::find(consumed_.begin(), consumed_.end(), name) != consumed_.end()) continue;
    std::vector<std::string> allowed = known_;
    std::sort(allowed.begin(), allowed.end());
    allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());
    std::vector<std::string> candidates = allowed;
    for (const auto& alias : aliases_) candidates.push_back(alias.first);
    const std::string closest = ClosestMatch(name, candidates);
    return Status::InvalidArgument(
        fmt::format("unknown key '{}';{} allowed: {}", KeyPath(name),
                    closest.empty() ? "" : fmt::format(" did you mean '{}'?", closest),
                    fmt::join(allowed, ", ")));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Sections

Result<AioConfig> ParseAioConfig(const Json& aio, std::vector<std::string>* ignored) {
  AioConfig config;
  if (aio.is_null()) return config;
  static constexpr std::array<std::string_view, 4> kBackends = {"auto", "io_uring", "libaio",
                                                                "psync"};
  ObjectReader reader(aio, "aio");
  reader.Alias("thread_count", "intra_op_parallelism")
      .Alias("num_threads", "intra_op_parallelism")
      .Size("block_size", &config.block_size, 4096, 1ull << 30)
      .UInt("queue_depth", &config.queue_depth, 1, 4096)
      .UInt("intra_op_parallelism", &config.intra_op_parallelism, 1, 256)
      .Bool("single_submit", &config.single_submit)
      .Bool("overlap_events", &config.overlap_events)
      .Enum("backend", &config.backend, kBackends)
      .Bool("use_direct", &config.use_direct)
      .Bool("checksum", &config.checksum);
  // DeepSpeed's GPUDirect Storage switch: a transfer path, not a setting of the swap data.
  if (ignored != nullptr) {
    reader.Ignore("use_gds", ignored);
  } else {
    reader.Ignore("use_gds");
  }
  ZOE_RETURN_IF_ERROR(reader.Finish());
  if (config.block_size % 4096 != 0) {
    return Status::InvalidArgument(fmt::format(
        "aio.block_size = {} is not a multiple of 4096; allowed: multiples of 4096 in {}..{}",
        config.block_size, DescribeSize(4096), DescribeSize(1ull << 30)));
  }
  return config;
}

}  // namespace zoe::config
