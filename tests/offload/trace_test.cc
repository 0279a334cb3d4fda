// Description: traces: recording several named traces, expanding acquires into chunk events, and
// the trace file (round trip, and rejection of wrong magic, unknown version, truncation, trailing
// bytes, checksum mismatch, foreign registry, malformed events and I/O failures).
#include "offload/paging/trace.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <xxhash.h>

#include <string>
#include <vector>

#include "temp_dir.h"

namespace zoe::offload {
namespace {

using testing::ReadBytes;
using testing::TempDir;
using testing::WriteBytes;

constexpr uint64_t kChunk = 4096;
constexpr uint64_t kFingerprint = 0x1234abcd5678ef90;

Trace SampleTrace(size_t events = 5) {
  Trace trace{"train_step", kFingerprint, {}};
  for (size_t i = 0; i < events; ++i) {
    trace.events.push_back(TraceEvent{TensorId(static_cast<uint32_t>(i % 3)),
                                      ChunkId(static_cast<uint32_t>(i)), static_cast<Access>(i % 3),
                                      1000 + i, i % 2 ? Tier::kDevice : Tier::kHost});
  }
  return trace;
}

void PutU32At(std::string& bytes, size_t offset, uint32_t v) {
  for (int i = 0; i < 4; ++i) bytes[offset + i] = static_cast<char>(v >> (8 * i));
}

TEST(TraceEvents, AnAcquireBecomesOneEventPerPiece) {
  Result<ChunkLayout> layout = ChunkLayout::Create({kChunk, 256, uint64_t{1} << 30});
  ASSERT_TRUE(layout.ok());
  TensorId small = *layout->Register({"small", 100, DType::kUInt8, Tier::kHost, ""});
  TensorId big = *layout->Register({"big", 2 * kChunk + 8, DType::kUInt8, Tier::kHost, ""});
  Result<std::vector<TraceEvent>> one = EventsForAcquire(*layout, small, Access::kRead);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, (std::vector<TraceEvent>{{small, ChunkId(0), Access::kRead, 100}}));
  Result<std::vector<TraceEvent>> three = EventsForAcquire(*layout, big, Access::kWrite);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(*three, (std::vector<TraceEvent>{{big, ChunkId(1), Access::kWrite, kChunk},
                                             {big, ChunkId(2), Access::kWrite, kChunk},
                                             {big, ChunkId(3), Access::kWrite, 8}}));
  EXPECT_EQ(EventsForAcquire(*layout, TensorId(7), Access::kRead).status().code(),
            StatusCode::kNotFound);
}

TEST(TraceEvents, EventsKeepTheTierOfTheAcquire) {
  Result<ChunkLayout> layout = ChunkLayout::Create({kChunk, 256, uint64_t{1} << 30});
  ASSERT_TRUE(layout.ok());
  TensorId big = *layout->Register({"big", kChunk + 8, DType::kUInt8, Tier::kHost, ""});
  Result<std::vector<TraceEvent>> events =
      EventsForAcquire(*layout, big, Access::kRead, Tier::kDevice);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 2u);
  for (const TraceEvent& e : *events) EXPECT_EQ(e.tier, Tier::kDevice);
  EXPECT_EQ(EventsForAcquire(*layout, big, Access::kRead)->front().tier, Tier::kHost);
  // Matching ignores the tier: a replay acquiring on HOST what was recorded on DEVICE matches.
  TraceEvent on_host = events->front();
  on_host.tier = Tier::kHost;
  EXPECT_TRUE(on_host.SameTarget(events->front()));
}

TEST(TraceSet, RecordsSeveralNamedTraces) {
  TraceSet set;
  ASSERT_TRUE(set.Begin("train", kFingerprint).ok());
  EXPECT_TRUE(set.recording());
  ASSERT_TRUE(set.Record({TensorId(0), ChunkId(0), Access::kRead, 4}).ok());
  ASSERT_TRUE(set.Record({TensorId(1), ChunkId(1), Access::kWrite, 8}).ok());
  EXPECT_EQ(set.current().events.size(), 2u);
  Result<const Trace*> train = set.End();
  ASSERT_TRUE(train.ok());
  EXPECT_EQ((*train)->events.size(), 2u);
  EXPECT_EQ((*train)->registry_fingerprint, kFingerprint);
  ASSERT_TRUE(set.Begin("eval", kFingerprint).ok());
  ASSERT_TRUE(set.Record({TensorId(0), ChunkId(0), Access::kRead, 4}).ok());
  ASSERT_TRUE(set.End().ok());
  EXPECT_EQ(set.Names(), (std::vector<std::string>{"eval", "train"}));
  EXPECT_EQ((*set.Find("eval"))->events.size(), 1u);
  EXPECT_EQ((*set.Find("train"))->events.size(), 2u);
}

TEST(TraceSet, RecordingANameAgainReplacesIt) {
  TraceSet set;
  ASSERT_TRUE(set.Begin("train", 1).ok());
  ASSERT_TRUE(set.Record({TensorId(0), ChunkId(0), Access::kRead, 4}).ok());
  ASSERT_TRUE(set.End().ok());
  ASSERT_TRUE(set.Begin("train", 2).ok());
  EXPECT_EQ((*set.Find("train"))->events.size(), 1u) << "the old trace serves until End()";
  ASSERT_TRUE(set.End().ok());
  EXPECT_TRUE((*set.Find("train"))->events.empty());
  EXPECT_EQ((*set.Find("train"))->registry_fingerprint, 2u);
}

TEST(TraceSet, CallsOutOfOrderAreErrors) {
  TraceSet set(2);
  EXPECT_EQ(set.Record({}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(set.End().status().message(), "trace end without a trace begin");
  EXPECT_EQ(set.Begin("", 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(set.Begin(std::string(kMaxTraceNameBytes + 1, 'x'), 0).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(set.Begin("a", 0).ok());
  Status again = set.Begin("b", 0);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(again.message(),
            "cannot begin trace 'b': trace 'a' is still being recorded; end it first");
  ASSERT_TRUE(set.Record({}).ok());
  ASSERT_TRUE(set.Record({}).ok());
  Status full = set.Record({});
  EXPECT_EQ(full.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(set.current().events.size(), 2u);
  set.Abandon();
  EXPECT_FALSE(set.recording());
  EXPECT_FALSE(set.Find("a").ok());
  EXPECT_EQ(set.Find("a").status().message(), "no trace named 'a'; known: []");
  EXPECT_FALSE(set.Insert(Trace{}).ok());
  ASSERT_TRUE(set.Insert(SampleTrace()).ok());
  EXPECT_EQ(set.Names(), (std::vector<std::string>{"train_step"}));
}

TEST(TraceFile, SaveLoadRoundTrip) {
  TempDir dir;
  const Trace trace = SampleTrace(100);
  ASSERT_TRUE(SaveTrace(trace, dir.File("t.trace")).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.File("t.trace.tmp")));
  Result<Trace> loaded = LoadTrace(dir.File("t.trace"), kFingerprint);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->name, trace.name);
  EXPECT_EQ(loaded->registry_fingerprint, kFingerprint);
  EXPECT_EQ(loaded->events, trace.events);  // tiers included
  EXPECT_EQ(loaded->events[1].tier, Tier::kDevice);
  EXPECT_EQ(ReadBytes(dir.File("t.trace")).size(), 32 + trace.name.size() + 100 * 18 + 8);
}

TEST(TraceFile, EmptyTraceRoundTrips) {
  TempDir dir;
  Trace empty{"eval", kFingerprint, {}};
  ASSERT_TRUE(SaveTrace(empty, dir.File("e.trace")).ok());
  Result<Trace> loaded = LoadTrace(dir.File("e.trace"), kFingerprint);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(loaded->events.empty());
}

TEST(TraceFile, SavingReplacesAnOlderFile) {
  TempDir dir;
  ASSERT_TRUE(SaveTrace(SampleTrace(50), dir.File("t.trace")).ok());
  ASSERT_TRUE(SaveTrace(SampleTrace(3), dir.File("t.trace")).ok());
  EXPECT_EQ(LoadTrace(dir.File("t.trace"), kFingerprint)->events.size(), 3u);
}

// Writes a valid trace, lets `corrupt` edit its bytes, and loads the result.
template <class Edit>
Status LoadCorrupted(Edit corrupt, const std::string& name = "c.trace") {
  TempDir dir;
  const std::string path = dir.File(name);
  EXPECT_TRUE(SaveTrace(SampleTrace(), path).ok());
  std::string bytes = ReadBytes(path);
  corrupt(bytes);
  WriteBytes(path, bytes);
  Result<Trace> loaded = LoadTrace(path, kFingerprint);
  EXPECT_FALSE(loaded.ok());
  Status status = loaded.ok() ? Status::Ok() : loaded.status();
  // Every message names the file it is about.
  EXPECT_NE(status.message().find(path), std::string_view::npos) << status.ToString();
  return status;
}

TEST(TraceFile, WrongMagicIsRejected) {
  Status s = LoadCorrupted([](std::string& b) { b[0] = 'X'; });
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("is not a zoe trace file"), std::string_view::npos);
  Status json = LoadCorrupted([](std::string& b) { b = "{\"not\": \"a trace\"}\n"; });
  EXPECT_NE(json.message().find("is not a zoe trace file"), std::string_view::npos);
}

TEST(TraceFile, UnknownVersionIsRejected) {
  Status s = LoadCorrupted([](std::string& b) { PutU32At(b, 8, 7); });
  EXPECT_EQ(s.code(), StatusCode::kNotSupported);
  EXPECT_NE(s.message().find("has trace format version 7; this build reads version 2"),
            std::string_view::npos);
}

// A file of the previous version (17-byte events without a tier, with a valid checksum) is
// refused by its version, before its size is looked at.
TEST(TraceFile, VersionOneFileIsRejectedAsUnsupported) {
  TempDir dir;
  std::string bytes(kTraceMagic, sizeof kTraceMagic);
  const auto put = [&bytes](uint64_t v, int width) {
    for (int i = 0; i < width; ++i) bytes.push_back(static_cast<char>(v >> (8 * i)));
  };
  put(1, 4);  // version
  put(4, 4);  // name length
  put(kFingerprint, 8);
  put(1, 8);  // one event
  bytes += "step";
  put(0, 4), put(0, 4), put(0, 1), put(64, 8);  // tensor, chunk, access, bytes
  put(XXH3_64bits(bytes.data(), bytes.size()), 8);
  WriteBytes(dir.File("v1.trace"), bytes);
  Result<Trace> loaded = LoadTrace(dir.File("v1.trace"), kFingerprint);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(
      loaded.status().message().find("has trace format version 1; this build reads version 2"),
      std::string_view::npos)
      << loaded.status().ToString();
}

TEST(TraceFile, TruncatedFilesAreRejected) {
  for (size_t keep : {size_t{0}, size_t{5}, size_t{20}, size_t{60}}) {
    Status s = LoadCorrupted([keep](std::string& b) { b.resize(keep); });
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << keep;
    EXPECT_NE(s.message().find("is truncated"), std::string_view::npos) << s.ToString();
  }
  Status last_byte = LoadCorrupted([](std::string& b) { b.pop_back(); });
  EXPECT_NE(last_byte.message().find("its header declares"), std::string_view::npos);
  Status huge_count = LoadCorrupted([](std::string& b) { PutU32At(b, 28, 0x7fffffff); });
  EXPECT_NE(huge_count.message().find("is truncated"), std::string_view::npos);
}

TEST(TraceFile, TrailingBytesAreRejected) {
  Status s = LoadCorrupted([](std::string& b) { b += "extra"; });
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("5 unexpected bytes"), std::string_view::npos);
}

TEST(TraceFile, ChecksumMismatchIsRejected) {
  const size_t first_event = 32 + std::string("train_step").size();
  for (size_t offset : {size_t{16}, first_event + 3, first_event + 18 * 4 + 16}) {
    Status s = LoadCorrupted([offset](std::string& b) { b[offset] ^= 0x40; });
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << offset;
    EXPECT_NE(s.message().find("checksum mismatch"), std::string_view::npos) << s.ToString();
  }
}

TEST(TraceFile, OverlongNameIsRejected) {
  Status s = LoadCorrupted([](std::string& b) { PutU32At(b, 12, 1 << 20); });
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("trace name length 1048576 exceeds the limit"),
            std::string_view::npos);
}

TEST(TraceFile, TraceOfAnotherRegistryIsRejected) {
  TempDir dir;
  Result<ChunkLayout> model_a = ChunkLayout::Create({kChunk, 256, 1 << 20});
  Result<ChunkLayout> model_b = ChunkLayout::Create({kChunk, 256, 1 << 20});
  ASSERT_TRUE(model_a->Register({"w", 64, DType::kFloat32, Tier::kHost, ""}).ok());
  ASSERT_TRUE(model_b->Register({"w", 128, DType::kFloat32, Tier::kHost, ""}).ok());
  Trace trace{"step", model_a->Fingerprint(), {{TensorId(0), ChunkId(0), Access::kRead, 64}}};
  ASSERT_TRUE(SaveTrace(trace, dir.File("a.trace")).ok());
  EXPECT_TRUE(LoadTrace(dir.File("a.trace"), model_a->Fingerprint()).ok());
  Result<Trace> foreign = LoadTrace(dir.File("a.trace"), model_b->Fingerprint());
  ASSERT_FALSE(foreign.ok());
  EXPECT_EQ(foreign.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(foreign.status().message().find("trace 'step' was recorded against another tensor "
                                            "registry"),
            std::string_view::npos);
}

// An event that survives the checksum (a file written by a buggy or hostile writer) is still
// checked.
TEST(TraceFile, MalformedEventWithAValidChecksumIsRejected) {
  Trace trace = SampleTrace(2);
  trace.events[1].access = static_cast<Access>(9);
  Result<Trace> decoded = DecodeTrace(EncodeTrace(trace), kFingerprint, "memory");
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(decoded.status().message(),
            "memory: event 1 is malformed (tensor 1, chunk 1, access 9, tier 0)");
  trace.events[1].access = Access::kRead;
  trace.events[1].tier = Tier::kNvme;  // NVMe bytes are never acquired
  EXPECT_EQ(DecodeTrace(EncodeTrace(trace), kFingerprint, "memory").status().message(),
            "memory: event 1 is malformed (tensor 1, chunk 1, access 0, tier 2)");
  trace.events[1].tier = Tier::kHost;
  trace.events[0].chunk = ChunkId();
  EXPECT_EQ(DecodeTrace(EncodeTrace(trace), kFingerprint, "memory").status().code(),
            StatusCode::kCorruption);
}

TEST(TraceFile, IoFailuresNameThePath) {
  TempDir dir;
  Status no_dir = SaveTrace(SampleTrace(), dir.File("missing/t.trace"));
  EXPECT_EQ(no_dir.code(), StatusCode::kNotFound);
  EXPECT_NE(no_dir.message().find(dir.File("missing/t.trace.tmp")), std::string_view::npos);
  std::filesystem::create_directory(dir.File("is_a_dir"));
  Status onto_dir = SaveTrace(SampleTrace(), dir.File("is_a_dir"));
  EXPECT_FALSE(onto_dir.ok());
  EXPECT_NE(onto_dir.message().find("rename"), std::string_view::npos) << onto_dir.ToString();
  EXPECT_FALSE(std::filesystem::exists(dir.File("is_a_dir.tmp")));
  Result<Trace> missing = LoadTrace(dir.File("nope.trace"), kFingerprint);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("open " + dir.File("nope.trace")),
            std::string_view::npos);
  Result<Trace> directory = LoadTrace(dir.File("is_a_dir"), kFingerprint);
  EXPECT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("read " + dir.File("is_a_dir")),
            std::string_view::npos)
      << directory.status().ToString();
  EXPECT_EQ(SaveTrace(Trace{}, dir.File("x")).code(), StatusCode::kInvalidArgument);
}

// A file-size limit makes the write fail with EFBIG, as a full disk would; it runs in a child
// process so the limit cannot leak into other tests.
TEST(TraceFileDeathTest, WriteFailureIsReportedAndLeavesNoTemporary) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempDir dir;
  const std::string path = dir.File("big.trace");
  auto save_under_limit = [&] {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    Status s = SaveTrace(SampleTrace(10000), path);
    const bool as_expected = s.code() == StatusCode::kNoSpace &&
                             s.message().find("write " + path + ".tmp") != std::string_view::npos &&
                             !std::filesystem::exists(path + ".tmp") &&
                             !std::filesystem::exists(path);
    std::exit(as_expected ? 0 : 1);
  };
  EXPECT_EXIT(save_under_limit(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace zoe::offload
