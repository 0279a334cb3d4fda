// Configuration from JSON. zoe takes its options as one JSON document whose keys follow
// DeepSpeed's where DeepSpeed has one (so existing configs carry over), and adds its own.
//
// Contract for every section reader:
//  - an unknown key is an error naming the closest valid key and listing the allowed ones;
//  - a value out of range is an error naming the key (as a dotted path) and the allowed range;
//  - sizes may be written 1048576, 1e6, "1M", "4KiB", "1.5GiB" (see ParseSize).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace zoe::config {

// Objects and arrays nested deeper than this are refused (a configuration needs fewer than 10).
inline constexpr int kMaxJsonDepth = 100;

// Parses JSON text; a syntax error names the byte offset and what was expected, a document nested
// deeper than kMaxJsonDepth is refused (InvalidArgument) instead of exhausting the stack.
Result<nlohmann::json> ParseJson(std::string_view text);

// ParseJson for configuration documents: also reads the tokens Python's json module writes for
// float("inf"), float("-inf") and float("nan") (Infinity, -Infinity, NaN) as those numbers, as
// DeepSpeed reads them (accelerate writes "steps_per_print": float("inf")). Outside strings only;
// a syntax error still names the byte offset in `text`. The section readers refuse a non-finite
// value wherever zoe needs a number, so only keys zoe ignores keep one.
Result<nlohmann::json> ParseConfigJson(std::string_view text);

// A configuration document as compact JSON text that ParseConfigJson and Python's json.loads read
// back as the same document: non-finite numbers are written NaN, Infinity and -Infinity, as
// Python's json module writes them (nlohmann writes null, which would read as absent). Except:
// ParseConfigJson reads a document with a NUL character in a string as plain JSON, without them.
std::string WriteConfigJson(const nlohmann::json& value);

// A value as messages show it: WriteConfigJson's text, an object (in an array too) as "an
// object".
std::string DescribeJson(const nlohmann::json& value);

// A byte count from a JSON number (integral, or a float with an integral value such as 1e6) or a
// string: digits with an optional fraction and an optional unit. K, M, G, T and KiB, MiB, GiB,
// TiB are binary (1K = 1024, as in fio); KB, MB, GB, TB are decimal (1KB = 1000); B or no unit
// is bytes. Units are case-insensitive. Negative, fractional-byte and overflowing values are
// errors naming what is allowed.
Result<uint64_t> ParseSize(const nlohmann::json& value);
Result<uint64_t> ParseSizeString(std::string_view text);

// The candidate closest to `name` by edit distance (case-insensitive), or empty when none is
// within a plausible distance.
std::string ClosestMatch(std::string_view name, std::span<const std::string> candidates);

// Reads the keys of one JSON object into typed fields, remembering which keys it consumed.
// Readers chain; the first error sticks and is returned by Finish(), which also rejects keys that
// were never read. `path` prefixes key names in messages ("aio" -> "aio.queue_depth").
class ObjectReader {
 public:
  ObjectReader(const nlohmann::json& object, std::string path);

  // Declares `old_name` as another spelling of `canonical`; must precede the read of canonical.
  ObjectReader& Alias(std::string_view old_name, std::string_view canonical);

  ObjectReader& Size(std::string_view key, uint64_t* out, uint64_t min, uint64_t max);
  ObjectReader& UInt(std::string_view key, uint64_t* out, uint64_t min, uint64_t max);
  ObjectReader& Double(std::string_view key, double* out, double min, double max);
  ObjectReader& Bool(std::string_view key, bool* out);
  ObjectReader& String(std::string_view key, std::string* out);
  // Accepts "a" or ["a", "b"].
  ObjectReader& StringList(std::string_view key, std::vector<std::string>* out);
  ObjectReader& Enum(std::string_view key, std::string* out,
                     std::span<const std::string_view> allowed);
  // Hands a nested object to `read` with a reader whose path is "<path>.<key>", then reports the
  // nested object's unknown keys as well (Finish runs on it after `read`). Absent: not called.
  ObjectReader& Object(std::string_view key, const std::function<Status(ObjectReader&)>& read);
  // Accepts a key zoe does not use (a DeepSpeed option with no meaning here) and ignores it.
  ObjectReader& Ignore(std::string_view key);
  // As Ignore(key), and appends the key's dotted path (as spelled) to `ignored` when present.
  ObjectReader& Ignore(std::string_view key, std::vector<std::string>* ignored);
  // Copies the value of `key` as it is when present, for shapes the typed readers do not cover
  // (the caller validates it). Absent: `out` is left alone.
  ObjectReader& Value(std::string_view key, std::optional<nlohmann::json>* out);

  // OK, or the first error, or an error for the first key that was never read.
  Status Finish();

  const std::string& path() const { return path_; }

 private:
  // Reads `key` into *out when its JSON value passes `is` (else a wrong-type error naming
  // `expected`).
  template <class T>
  ObjectReader& Typed(std::string_view key, T* out, bool (nlohmann::json::*is)() const noexcept,
                      std::string_view expected);
  const nlohmann::json* Find(std::string_view key);
  std::string KeyPath(std::string_view key) const;

  const nlohmann::json& object_;
  std::string path_;
  std::vector<std::pair<std::string, std::string>> aliases_;  // (old, canonical)
  std::vector<std::string> known_;                            // every key a read declared
  std::vector<std::string> consumed_;                         // keys present and read
  std::string found_key_;  // the spelling (canonical or alias) the last Find() found
  Status status_;
};

// DeepSpeed's "aio" section plus zoe's own I/O options.
struct AioConfig {
  uint64_t block_size = 1 << 20;  // bytes per request
  uint64_t queue_depth = 32;      // requests in flight per worker
  // I/O workers; DeepSpeed's older names: thread_count, num_threads.
  uint64_t intra_op_parallelism = 1;
  bool single_submit = false;    // submit one request per call instead of batches
  bool overlap_events = true;    // keep submitting while completions are reaped
  std::string backend = "auto";  // auto | io_uring | libaio | psync
  bool use_direct = true;        // O_DIRECT, with a buffered fallback where refused
  bool checksum = true;          // xxh3 per block, verified on read

  bool operator==(const AioConfig&) const = default;
};

// Parses the "aio" object. Ranges: block_size 4KiB..1GiB and a multiple of 4096; queue_depth
// 1..4096; intra_op_parallelism 1..256; backend one of auto, io_uring, libaio, psync. A null
// value (no "aio" section) gives the defaults.
// `ignored`, when given, receives the DeepSpeed keys accepted and not acted on (aio.use_gds).
Result<AioConfig> ParseAioConfig(const nlohmann::json& aio,
                                 std::vector<std::string>* ignored = nullptr);

}  // namespace zoe::config
