// Fuzzes the configuration parser: the input is a JSON document for ParseEngineConfig and a size
// string for ParseSizeString; accepted documents must survive ToJson and parse back unchanged, and
// a document normalized for zoe.torch (ReadPydanticSections, WriteConfigJson) must read back the
// same and configure the engine as the document given does.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/config.h"
#include "core/engine_config.h"
#include "core/engine_config_pydantic.h"
#include "tests/fuzz/fuzz_check.h"

namespace zoe::fuzz {
namespace {

// An accepted size prints as a byte count that parses back to itself, with and without "B".
void CheckSizeString(std::string_view text) {
  Result<uint64_t> size = config::ParseSizeString(text);
  if (!size.ok()) {
    FUZZ_CHECK(!size.status().message().empty(), "a rejected size has no message");
    return;
  }
  const std::string bytes = std::to_string(*size);
  Result<uint64_t> again = config::ParseSizeString(bytes);
  FUZZ_CHECK(again.ok() && *again == *size, bytes);
  Result<uint64_t> with_unit = config::ParseSizeString(bytes + "B");
  FUZZ_CHECK(with_unit.ok() && *with_unit == *size, bytes + "B");
}

// A JSON value read as a size agrees with the string form of the same number.
void CheckSizeValue(const nlohmann::json& value) {
  Result<uint64_t> size = config::ParseSize(value);
  if (!size.ok()) {
    FUZZ_CHECK(!size.status().message().empty(), "a rejected size value has no message");
    return;
  }
  if (value.is_number_integer()) {
    FUZZ_CHECK(*size == value.get<uint64_t>(), value.dump());
  }
}

// ToJson promises a document that ParseEngineConfig maps back to the same configuration.
void CheckRoundTrip(const config::EngineConfig& parsed, std::string_view input) {
  const std::string printed = config::ToJson(parsed).dump();
  Result<config::EngineConfig> reparsed = config::ParseEngineConfig(printed);
  FUZZ_CHECK(reparsed.ok(), std::string(input) + "\n  printed as " + printed +
                                "\n  rejected: " + reparsed.status().ToString());
  config::EngineConfig expected = parsed;
  expected.ignored_keys.clear();
  expected.framework_keys.clear();
  expected.warnings.clear();
  FUZZ_CHECK(*reparsed == expected, std::string(input) + "\n  printed as " + printed +
                                        "\n  parsed back to " + config::ToJson(*reparsed).dump());
  (void)config::DescribeIgnoredKeys(parsed);
  (void)config::DescribeFrameworkKeys(parsed);
}

void CheckDocument(std::string_view text) {
  Result<config::EngineConfig> parsed = config::ParseEngineConfig(text);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == StatusCode::kInvalidArgument, parsed.status().ToString());
    FUZZ_CHECK(!parsed.status().message().empty(), "a rejected document has no message");
    return;
  }
  CheckRoundTrip(*parsed, text);
}

// What zoe_config_normalize hands to zoe.torch.initialize reads back as the same document, which
// the engine reads as it reads the document given.
void CheckNormalized(std::string_view text) {
  Result<nlohmann::json> document = config::ParseConfigJson(text);
  if (!document.ok() || !config::ReadPydanticSections(&*document).ok()) return;
  const std::string written = config::WriteConfigJson(*document);
  // ParseConfigJson reads a document with a NUL character in a string as plain JSON.
  if (written.find("\\u0000") != std::string::npos) return;
  Result<nlohmann::json> again = config::ParseConfigJson(written);
  FUZZ_CHECK(again.ok(), std::string(text) + "\n  written as " + written);
  FUZZ_CHECK(config::WriteConfigJson(*again) == written, std::string(text) + "\n  " + written);
  Result<config::EngineConfig> given = config::ParseEngineConfig(text);
  Result<config::EngineConfig> normalized = config::ParseEngineConfig(written);
  FUZZ_CHECK(given.ok() == normalized.ok(), std::string(text) + "\n  written as " + written);
  if (given.ok()) {
    FUZZ_CHECK(*given == *normalized, std::string(text) + "\n  written as " + written);
  } else {
    FUZZ_CHECK(given.status().ToString() == normalized.status().ToString(),
               given.status().ToString() + "\n  normalized: " + normalized.status().ToString());
  }
}

}  // namespace
}  // namespace zoe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  zoe::fuzz::CheckSizeString(text);
  zoe::fuzz::CheckDocument(text);
  zoe::fuzz::CheckNormalized(text);
  zoe::Result<nlohmann::json> json = zoe::config::ParseJson(text);
  if (json.ok()) {
    zoe::fuzz::CheckSizeValue(*json);
    (void)zoe::config::ParseAioConfig(*json);
  }
  return 0;
}
