// Description: configuration: JSON syntax errors, sizes in every form, ObjectReader messages, the
// aio section.
#include "core/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

namespace zoe::config {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// ParseJson

TEST(ParseJson, AcceptsValidDocuments) {
  auto parsed = ParseJson(R"({"aio": {"block_size": "1M"}, "list": [1, 2]})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ((*parsed)["aio"]["block_size"], "1M");
  EXPECT_EQ((*parsed)["list"].size(), 2u);
}

TEST(ParseJson, SyntaxErrorNamesByteOffsetLineAndWhatWasExpected) {
  //                     0123456789012345678
  const std::string text = "{\n  \"a\": 1,\n  }";
  auto parsed = ParseJson(text);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  const std::string message(parsed.status().message());
  EXPECT_THAT(message, HasSubstr("byte offset 14"));
  EXPECT_THAT(message, HasSubstr("line 3, column 3"));
  EXPECT_THAT(message, HasSubstr("expected string literal"));
  EXPECT_THAT(message, ::testing::Not(HasSubstr("[json.exception")));
}

TEST(ParseJson, EmptyAndTruncatedInputAreErrors) {
  EXPECT_FALSE(ParseJson("").ok());
  auto truncated = ParseJson(R"({"a": [1, 2)");
  ASSERT_FALSE(truncated.ok());
  EXPECT_THAT(std::string(truncated.status().message()), HasSubstr("byte offset 11"));
  EXPECT_FALSE(ParseJson(R"({"a": 1} trailing)").ok());
}

// `levels` arrays nested in one another: "[[...]]".
std::string NestedArrays(size_t levels) {
  return std::string(levels, '[') + std::string(levels, ']');
}

TEST(ParseJson, AcceptsNestingUpToTheLimit) {
  auto parsed = ParseJson(NestedArrays(kMaxJsonDepth));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  auto in_object = ParseJson(R"({"a": )" + NestedArrays(kMaxJsonDepth - 1) + "}");
  EXPECT_TRUE(in_object.ok()) << in_object.status().ToString();
}

// Found by fuzz_config: copying and printing a parsed document recurse once per level, so a
// document nested some ten thousand levels deep overflowed the stack.
TEST(ParseJson, DeeperNestingIsRefusedInsteadOfExhaustingTheStack) {
  for (size_t levels : {size_t{kMaxJsonDepth} + 1, size_t{1'000'000}}) {
    auto parsed = ParseJson(NestedArrays(levels));
    ASSERT_FALSE(parsed.ok()) << levels;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("nested deeper than 100"));
  }
  auto objects = ParseJson(R"({"a": )" + NestedArrays(kMaxJsonDepth) + "}");
  EXPECT_FALSE(objects.ok());
}

// ---------------------------------------------------------------------------------------------
// ParseSize / ParseSizeString

struct SizeCase {
  Json input;
  uint64_t bytes;
};

TEST(ParseSize, AcceptsEveryDocumentedForm) {
  const std::vector<SizeCase> cases = {
      {1048576, 1048576},      {0, 0},
      {1e6, 1000000},          {4096.0, 4096},
      {"1048576", 1048576},    {"1M", 1ull << 20},
      {"1m", 1ull << 20},      {"4KiB", 4096},
      {"4kib", 4096},          {"4K", 4096},
      {"1.5GiB", 3ull << 29},  {"1.5G", 3ull << 29},
      {"1MB", 1000000},        {"2KB", 2000},
      {"3GB", 3000000000ull},  {"1TB", 1000000000000ull},
      {"2T", 2ull << 40},      {"2TiB", 2ull << 40},
      {"512B", 512},           {"512b", 512},
      {" 8 MiB ", 8ull << 20}, {"0.5K", 512},
      {"16384.0", 16384},      {"18446744073709551615", UINT64_MAX},
  };
  for (const SizeCase& c : cases) {
    auto parsed = ParseSize(c.input);
    ASSERT_TRUE(parsed.ok()) << c.input.dump() << ": " << parsed.status().ToString();
    EXPECT_EQ(*parsed, c.bytes) << c.input.dump();
  }
}

// Each bad input, and a fragment its error message must contain besides the allowed forms.
struct BadSize {
  Json input;
  std::string why;
};

TEST(ParseSize, RejectsBadSizesNamingWhatIsAllowed) {
  const std::vector<BadSize> cases = {
      {-1, "size -1 is negative"},
      {-1.0, "size -1.0 is negative"},
      {"-4K", "size '-4K' is negative"},
      {1.5, "size 1.5 is not a whole number of bytes"},
      {"1.3B", "size '1.3B' is not a whole number of bytes"},
      {"0.1K", "size '0.1K' is not a whole number of bytes"},
      {"4XB", "size '4XB' has an unknown unit 'XB'"},
      {"4 PiB", "has an unknown unit 'PiB'"},
      {"", "size '' is empty"},
      {"MiB", "size 'MiB' does not start with a number"},
      {"18446744073709551616", "overflows 64 bits"},
      {"16777216T", "overflows 64 bits"},
      {1e20, "overflows 64 bits"},
      {true, "size true has type boolean"},
      {nullptr, "size null has type null"},
      {Json::object(), "size an object has type object"},
  };
  for (const BadSize& c : cases) {
    auto parsed = ParseSize(c.input);
    ASSERT_FALSE(parsed.ok()) << c.input.dump() << " parsed as " << *parsed;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    const std::string message(parsed.status().message());
    EXPECT_THAT(message, HasSubstr(c.why)) << c.input.dump();
    EXPECT_THAT(message, HasSubstr("allowed: a byte count such as 1048576 or 1e6")) << message;
    EXPECT_THAT(message, HasSubstr("KB, MB, GB, TB (decimal)")) << message;
  }
}

// ---------------------------------------------------------------------------------------------
// ClosestMatch

TEST(ClosestMatch, FindsTyposCaseInsensitivelyAndRejectsUnrelatedNames) {
  const std::vector<std::string> keys = {"block_size", "queue_depth", "intra_op_parallelism",
                                         "single_submit"};
  EXPECT_EQ(ClosestMatch("queue_dept", keys), "queue_depth");
  EXPECT_EQ(ClosestMatch("Queue_Depth", keys), "queue_depth");
  EXPECT_EQ(ClosestMatch("blocksize", keys), "block_size");
  EXPECT_EQ(ClosestMatch("single_sumbit", keys), "single_submit");
  EXPECT_EQ(ClosestMatch("parallelism", keys), "intra_op_parallelism");
  EXPECT_EQ(ClosestMatch("zzz", keys), "");
  EXPECT_EQ(ClosestMatch("learning_rate", keys), "");
  EXPECT_EQ(ClosestMatch("anything", {}), "");
}

// ---------------------------------------------------------------------------------------------
// ObjectReader

TEST(ObjectReader, ReadsEveryTypeAndLeavesAbsentKeysAlone) {
  const Json json = Json::parse(R"({"n": 7, "d": 0.5, "b": true, "s": "x", "l": ["a", "b"],
                                    "one": "c", "e": "psync", "size": "2K", "skip": {"x": 1}})");
  uint64_t n = 0, size = 0, absent = 99;
  double d = 0;
  bool b = false;
  std::string s, e;
  std::vector<std::string> l, one;
  static constexpr std::array<std::string_view, 2> kModes = {"psync", "libaio"};
  ObjectReader reader(json, "sec");
  reader.UInt("n", &n, 1, 10)
      .Double("d", &d, 0, 1)
      .Bool("b", &b)
      .String("s", &s)
      .StringList("l", &l)
      .StringList("one", &one)
      .Enum("e", &e, kModes)
      .Size("size", &size, 0, 1 << 20)
      .UInt("absent", &absent, 0, 100)
      .Ignore("skip");
  ASSERT_TRUE(reader.Finish().ok()) << reader.Finish().ToString();
  EXPECT_EQ(n, 7u);
  EXPECT_EQ(d, 0.5);
  EXPECT_TRUE(b);
  EXPECT_EQ(s, "x");
  EXPECT_EQ(l, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(one, (std::vector<std::string>{"c"}));
  EXPECT_EQ(e, "psync");
  EXPECT_EQ(size, 2048u);
  EXPECT_EQ(absent, 99u);
}

Status ReadOne(const Json& json, const std::function<void(ObjectReader&)>& read) {
  ObjectReader reader(json, "aio");
  read(reader);
  return reader.Finish();
}

TEST(ObjectReader, UnknownKeyNamesClosestKeyAndAllowedKeys) {
  uint64_t depth = 0, block = 0;
  Status status = ReadOne(Json::parse(R"({"queue_dept": 8})"), [&](ObjectReader& r) {
    r.UInt("queue_depth", &depth, 1, 4096).Size("block_size", &block, 0, 1 << 30);
  });
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "unknown key 'aio.queue_dept'; did you mean 'queue_depth'? allowed: block_size, "
            "queue_depth");
  status = ReadOne(Json::parse(R"({"colour": 1})"),
                   [&](ObjectReader& r) { r.UInt("queue_depth", &depth, 1, 4096); });
  EXPECT_EQ(status.message(), "unknown key 'aio.colour'; allowed: queue_depth");
}

TEST(ObjectReader, OutOfRangeNamesDottedKeyValueAndRange) {
  uint64_t depth = 0;
  Status status = ReadOne(Json::parse(R"({"queue_depth": 5000})"),
                          [&](ObjectReader& r) { r.UInt("queue_depth", &depth, 1, 4096); });
  EXPECT_EQ(status.message(), "aio.queue_depth = 5000 is out of range; allowed: 1..4096");
  status = ReadOne(Json::parse(R"({"queue_depth": -3})"),
                   [&](ObjectReader& r) { r.UInt("queue_depth", &depth, 1, 4096); });
  EXPECT_EQ(status.message(), "aio.queue_depth = -3 is out of range; allowed: 1..4096");
  double ratio = 0;
  status = ReadOne(Json::parse(R"({"ratio": 1.5})"),
                   [&](ObjectReader& r) { r.Double("ratio", &ratio, 0, 1); });
  EXPECT_EQ(status.message(), "aio.ratio = 1.5 is out of range; allowed: 0..1");
  uint64_t bytes = 0;
  status = ReadOne(Json::parse(R"({"block_size": "2GiB"})"),
                   [&](ObjectReader& r) { r.Size("block_size", &bytes, 4096, 1ull << 30); });
  EXPECT_EQ(status.message(),
            "aio.block_size = \"2GiB\" is out of range; allowed: 4096 (4 KiB)..1073741824 (1 GiB)");
  EXPECT_EQ(depth, 0u);
  EXPECT_EQ(bytes, 0u);
}

TEST(ObjectReader, WrongTypesNameKeyExpectedTypeAndValue) {
  uint64_t depth = 0;
  bool flag = false;
  std::string text;
  std::vector<std::string> list;
  Status status = ReadOne(Json::parse(R"({"queue_depth": "deep"})"),
                          [&](ObjectReader& r) { r.UInt("queue_depth", &depth, 1, 4096); });
  EXPECT_EQ(status.message(),
            "aio.queue_depth: expected an integer in 1..4096, got \"deep\" (string)");
  status = ReadOne(Json::parse(R"({"queue_depth": 2.5})"),
                   [&](ObjectReader& r) { r.UInt("queue_depth", &depth, 1, 4096); });
  EXPECT_EQ(status.message(), "aio.queue_depth: expected an integer in 1..4096, got 2.5 (number)");
  status = ReadOne(Json::parse(R"({"use_direct": 1})"),
                   [&](ObjectReader& r) { r.Bool("use_direct", &flag); });
  EXPECT_EQ(status.message(), "aio.use_direct: expected true or false, got 1 (integer)");
  status =
      ReadOne(Json::parse(R"({"name": [1]})"), [&](ObjectReader& r) { r.String("name", &text); });
  EXPECT_EQ(status.message(), "aio.name: expected a string, got an array (array)");
  status = ReadOne(Json::parse(R"({"paths": ["a", 2]})"),
                   [&](ObjectReader& r) { r.StringList("paths", &list); });
  EXPECT_EQ(status.message(),
            "aio.paths: expected a string or an array of strings, got an array (array)");
  status = ReadOne(Json::parse(R"({"block_size": true})"),
                   [&](ObjectReader& r) { r.Size("block_size", &depth, 0, 1 << 20); });
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("aio.block_size: size true has type boolean"));
  double ratio = 0.25;
  status = ReadOne(Json::parse(R"({"ratio": "high"})"),
                   [&](ObjectReader& r) { r.Double("ratio", &ratio, 0, 1); });
  EXPECT_EQ(status.message(), "aio.ratio: expected a number in 0..1, got \"high\" (string)");
  EXPECT_EQ(ratio, 0.25);
}

TEST(ObjectReader, IntegralFloatsAreAcceptedAsIntegers) {
  uint64_t depth = 0;
  ASSERT_TRUE(ReadOne(Json::parse(R"({"queue_depth": 1e3})"), [&](ObjectReader& r) {
                r.UInt("queue_depth", &depth, 1, 4096);
              }).ok());
  EXPECT_EQ(depth, 1000u);
}

TEST(ObjectReader, EnumRejectsOtherValuesSuggestingTheClosest) {
  static constexpr std::array<std::string_view, 4> kBackends = {"auto", "io_uring", "libaio",
                                                                "psync"};
  std::string backend = "auto";
  Status status = ReadOne(Json::parse(R"({"backend": "iouring"})"),
                          [&](ObjectReader& r) { r.Enum("backend", &backend, kBackends); });
  EXPECT_EQ(status.message(),
            "aio.backend = 'iouring' is not allowed; did you mean 'io_uring'? allowed: auto, "
            "io_uring, libaio, psync");
  status = ReadOne(Json::parse(R"({"backend": 3})"),
                   [&](ObjectReader& r) { r.Enum("backend", &backend, kBackends); });
  EXPECT_EQ(status.message(),
            "aio.backend: expected one of auto, io_uring, libaio, psync, got 3 (integer)");
  EXPECT_EQ(backend, "auto");
}

TEST(ObjectReader, AliasesReadTheCanonicalFieldAndConflictsAreErrors) {
  uint64_t threads = 0;
  auto read = [&](ObjectReader& r) {
    r.Alias("thread_count", "intra_op_parallelism").UInt("intra_op_parallelism", &threads, 1, 256);
  };
  ASSERT_TRUE(ReadOne(Json::parse(R"({"thread_count": 4})"), read).ok());
  EXPECT_EQ(threads, 4u);
  Status status = ReadOne(Json::parse(R"({"thread_count": 4, "intra_op_parallelism": 2})"), read);
  EXPECT_EQ(status.message(),
            "both 'aio.intra_op_parallelism' and 'aio.thread_count' are given; they are the same "
            "option, keep one");
  status = ReadOne(Json::parse(R"({"thread_cont": 4})"), read);
  EXPECT_EQ(status.message(),
            "unknown key 'aio.thread_cont'; did you mean 'thread_count'? allowed: "
            "intra_op_parallelism");
}

TEST(ObjectReader, NestedObjectsUseDottedPathsAndReportTheirOwnUnknownKeys) {
  const Json json = Json::parse(R"({"offload": {"nvme": {"path": "/x", "bufer_count": 4}}})");
  std::string path;
  uint64_t count = 0;
  ObjectReader root(json, "");
  root.Object("offload", [&](ObjectReader& offload) {
    offload.Object("nvme", [&](ObjectReader& nvme) {
      nvme.String("path", &path).UInt("buffer_count", &count, 1, 64);
      return Status::Ok();
    });
    return offload.Finish();
  });
  Status status = root.Finish();
  EXPECT_EQ(status.message(),
            "unknown key 'offload.nvme.bufer_count'; did you mean 'buffer_count'? allowed: "
            "buffer_count, path");
  EXPECT_EQ(path, "/x");
}

TEST(ObjectReader, NestedReadFailuresAndNonObjectsPropagate) {
  const Json json = Json::parse(R"({"nvme": {"depth": 0}, "flat": 3})");
  uint64_t depth = 0;
  ObjectReader bad_value(json, "zero");
  bad_value.Object("nvme", [&](ObjectReader& nvme) {
    nvme.UInt("depth", &depth, 1, 8);
    return Status::Ok();
  });
  EXPECT_EQ(bad_value.Finish().message(), "zero.nvme.depth = 0 is out of range; allowed: 1..8");
  ObjectReader not_object(json, "zero");
  bool called = false;
  not_object.Ignore("nvme").Object("flat", [&](ObjectReader&) {
    called = true;
    return Status::Ok();
  });
  EXPECT_EQ(not_object.Finish().message(), "'zero.flat' must be a JSON object, got 3 (integer)");
  EXPECT_FALSE(called);
  ObjectReader failing(json, "zero");
  failing.Ignore("flat").Object("nvme", [](ObjectReader&) { return Status::Busy("held"); });
  EXPECT_EQ(failing.Finish().code(), StatusCode::kBusy);
}

TEST(ObjectReader, FirstErrorSticksAndLaterReadsDoNotOverwriteIt) {
  uint64_t a = 0, b = 0;
  Status status = ReadOne(Json::parse(R"({"a": 0, "b": "x", "c": 1})"),
                          [&](ObjectReader& r) { r.UInt("a", &a, 1, 2).UInt("b", &b, 1, 2); });
  EXPECT_EQ(status.message(), "aio.a = 0 is out of range; allowed: 1..2");
}

TEST(ObjectReader, NonObjectRootIsAnError) {
  ObjectReader reader(Json::array(), "aio");
  uint64_t depth = 0;
  reader.UInt("queue_depth", &depth, 1, 2);
  EXPECT_EQ(reader.Finish().message(), "'aio' must be a JSON object, got an array (array)");
}

// ---------------------------------------------------------------------------------------------
// ParseAioConfig

TEST(ParseAioConfig, DefaultsWhenAbsentOrEmpty) {
  for (const Json& json : {Json(), Json::object()}) {
    auto config = ParseAioConfig(json);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    EXPECT_EQ(config->block_size, 1u << 20);
    EXPECT_EQ(config->queue_depth, 32u);
    EXPECT_EQ(config->intra_op_parallelism, 1u);
    EXPECT_EQ(config->backend, "auto");
    EXPECT_TRUE(config->use_direct);
    EXPECT_TRUE(config->checksum);  // nothing read back from disk is used unverified by default
  }
}

TEST(ParseAioConfig, ReadsDeepSpeedSectionWithOldThreadNames) {
  auto config = ParseAioConfig(Json::parse(R"({"block_size": 262144, "queue_depth": 8,
      "thread_count": 2, "single_submit": true, "overlap_events": false})"));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->block_size, 262144u);
  EXPECT_EQ(config->queue_depth, 8u);
  EXPECT_EQ(config->intra_op_parallelism, 2u);
  EXPECT_TRUE(config->single_submit);
  EXPECT_FALSE(config->overlap_events);
  config = ParseAioConfig(Json::parse(R"({"num_threads": 3, "block_size": "4MiB",
      "backend": "io_uring", "use_direct": false, "checksum": false})"));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->intra_op_parallelism, 3u);
  EXPECT_EQ(config->block_size, 4u << 20);
  EXPECT_EQ(config->backend, "io_uring");
  EXPECT_FALSE(config->use_direct);
  EXPECT_FALSE(config->checksum);
}

TEST(ParseAioConfig, AcceptsDocumentsBuiltInCode) {
  auto config = ParseAioConfig(Json{{"queue_depth", 8}, {"block_size", 8192}});
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->queue_depth, 8u);
  EXPECT_EQ(config->block_size, 8192u);
  EXPECT_EQ(ParseAioConfig(Json{{"queue_depth", -1}}).status().message(),
            "aio.queue_depth = -1 is out of range; allowed: 1..4096");
}

TEST(ParseAioConfig, EnforcesRangesAndBlockAlignment) {
  struct Bad {
    const char* json;
    const char* message;
  };
  const std::vector<Bad> cases = {
      {R"({"block_size": 2048})",
       "aio.block_size = 2048 is out of range; allowed: 4096 (4 KiB)..1073741824 (1 GiB)"},
      {R"({"block_size": "6000"})",
       "aio.block_size = 6000 is not a multiple of 4096; allowed: multiples of 4096 in 4096 (4 "
       "KiB)..1073741824 (1 GiB)"},
      {R"({"queue_depth": 0})", "aio.queue_depth = 0 is out of range; allowed: 1..4096"},
      {R"({"queue_depth": 4097})", "aio.queue_depth = 4097 is out of range; allowed: 1..4096"},
      {R"({"intra_op_parallelism": 257})",
       "aio.intra_op_parallelism = 257 is out of range; allowed: 1..256"},
      {R"({"thread_count": 0})", "aio.thread_count = 0 is out of range; allowed: 1..256"},
      {R"({"backend": "spdk"})",
       "aio.backend = 'spdk' is not allowed; allowed: auto, io_uring, libaio, psync"},
      {R"({"queue_dept": 4})",
       "unknown key 'aio.queue_dept'; did you mean 'queue_depth'? allowed: backend, block_size, "
       "checksum, intra_op_parallelism, overlap_events, queue_depth, single_submit, use_direct, "
       "use_gds"},
      {R"([1])", "'aio' must be a JSON object, got an array (array)"},
  };
  for (const Bad& c : cases) {
    auto config = ParseAioConfig(Json::parse(c.json));
    ASSERT_FALSE(config.ok()) << c.json;
    EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(config.status().message(), c.message) << c.json;
  }
}

}  // namespace
}  // namespace zoe::config
