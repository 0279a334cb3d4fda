// Description: CheckpointWriter / CheckpointReader: round trips of odd-sized files and metadata,
// every misuse, every kind of damage on disk, abandoned saves, and a failure injected at each
// system call of a save in turn (the error surfaces, the previous checkpoint still loads).
#include "offload/checkpoint/checkpoint_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using testing::ReadBytes;
using testing::TempDir;
using testing::WriteBytes;

// Deterministic bytes: splitmix64 of (seed, index).
std::string PatternBytes(uint64_t seed, size_t size) {
  std::string bytes(size, '\0');
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < size; ++i) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    bytes[i] = static_cast<char>(z ^ (z >> 31));
  }
  return bytes;
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// The files of generation `g`: odd sizes, one empty.
std::map<std::string, std::string> FilesOf(uint64_t g) {
  return {{"empty", ""},
          {"one", PatternBytes(g * 10 + 1, 1)},
          {"master.f32", PatternBytes(g * 10 + 2, 100003)},
          {"moments", PatternBytes(g * 10 + 3, 4097)}};
}

// Writes every file in appends of cycling odd sizes.
Status WriteFiles(CheckpointWriter& writer, const std::map<std::string, std::string>& files) {
  const size_t appends[] = {1, 7, 4095, 65537, 3};
  size_t k = 0;
  for (const auto& [name, bytes] : files) {
    ZOE_RETURN_IF_ERROR(writer.BeginFile(name, {{"bytes", bytes.size()}, {"name", name}}));
    for (size_t at = 0; at < bytes.size();) {
      const size_t n = std::min(appends[k++ % std::size(appends)], bytes.size() - at);
      ZOE_RETURN_IF_ERROR(writer.Append(AsBytes(bytes).subspan(at, n)));
      at += n;
    }
    ZOE_RETURN_IF_ERROR(writer.EndFile());
  }
  return Status::Ok();
}

Status Save(const std::string& dir, uint64_t g, CheckpointWriterOptions options = {}) {
  ZOE_ASSIGN_OR_RETURN(auto writer,
                       CheckpointWriter::Begin(dir, {{"generation", g}}, std::move(options)));
  ZOE_RETURN_IF_ERROR(WriteFiles(*writer, FilesOf(g)));
  return writer->Commit();
}

// Reads one whole file in reads of cycling odd sizes.
Result<std::string> ReadFile(CheckpointReader& reader, const std::string& name) {
  ZOE_ASSIGN_OR_RETURN(uint64_t size, reader.file_size(name));
  ZOE_RETURN_IF_ERROR(reader.BeginFile(name));
  std::string bytes(size, '\0');
  const size_t reads[] = {5, 65536, 1, 333};
  size_t k = 0;
  for (size_t at = 0; at < size;) {
    const size_t n = std::min<size_t>(reads[k++ % std::size(reads)], size - at);
    ZOE_RETURN_IF_ERROR(reader.Read(std::as_writable_bytes(std::span(bytes.data() + at, n))));
    at += n;
  }
  ZOE_RETURN_IF_ERROR(reader.EndFile());
  return bytes;
}

// Opens `dir` and checks that it holds generation `g` exactly.
void ExpectGeneration(const std::string& dir, uint64_t g) {
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->metadata(), nlohmann::json({{"generation", g}}));
  const auto files = FilesOf(g);
  std::vector<std::string> names;
  for (const auto& [name, bytes] : files) {
    names.push_back(name);
    auto read = ReadFile(**reader, name);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_TRUE(*read == bytes) << name;
    auto meta = (*reader)->file_metadata(name);
    ASSERT_TRUE(meta.ok());
    EXPECT_EQ(*meta, nlohmann::json({{"bytes", bytes.size()}, {"name", name}}));
  }
  EXPECT_EQ((*reader)->file_names(), names);
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class CheckpointStoreTest : public ::testing::Test {
 protected:
  std::string root() const { return temp_.File("ckpt"); }
  TempDir temp_;
};

TEST_F(CheckpointStoreTest, RoundTripOfOddSizesAndMetadata) {
  nlohmann::json metadata = {{"generation", 7}, {"nested", {{"lr", 1e-3}, {"names", {"a", "b"}}}}};
  auto writer = CheckpointWriter::Begin(root(), metadata);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_EQ((*writer)->version_path(), root() + "/v000001.tmp");
  ASSERT_TRUE(WriteFiles(**writer, FilesOf(7)).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  EXPECT_EQ((*writer)->version_path(), root() + "/v000001");
  EXPECT_EQ(ReadBytes(root() + "/LATEST"), "v000001\n");
  EXPECT_EQ(Entries(root()), (std::vector<std::string>{"LATEST", "v000001"}));

  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->metadata(), metadata);
  EXPECT_EQ((*reader)->version_path(), root() + "/v000001");
  for (const auto& [name, bytes] : FilesOf(7)) {
    auto size = (*reader)->file_size(name);
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, bytes.size());
    auto read = ReadFile(**reader, name);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_TRUE(*read == bytes) << name;
  }
}

TEST_F(CheckpointStoreTest, ANewSaveReplacesLatestAndRemovesTheOlderVersion) {
  ASSERT_TRUE(Save(root(), 1).ok());
  ASSERT_TRUE(Save(root(), 2).ok());
  ExpectGeneration(root(), 2);
  EXPECT_EQ(Entries(root()), (std::vector<std::string>{"LATEST", "v000002"}));
}

TEST_F(CheckpointStoreTest, WriterMisuseIsRefusedAndLeavesTheSaveUsable) {
  auto writer = CheckpointWriter::Begin(root(), {});
  ASSERT_TRUE(writer.ok());
  CheckpointWriter& w = **writer;
  const std::string data = "abc";
  EXPECT_EQ(w.Append(AsBytes(data)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.EndFile().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(w.BeginFile("a").ok());
  EXPECT_EQ(w.BeginFile("b").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.Commit().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(w.Append(AsBytes(data)).ok());
  ASSERT_TRUE(w.EndFile().ok());
  Status duplicate = w.BeginFile("a");
  EXPECT_EQ(duplicate.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(duplicate.message().find("'a'"), std::string_view::npos) << duplicate.ToString();
  for (std::string bad :
       {std::string(""), std::string("."), std::string(".."), std::string("x/y"),
        std::string("manifest.json"), std::string("LATEST"), std::string("LATEST.tmp"),
        std::string("nul\0byte", 8), std::string(NAME_MAX + 1, 'n')}) {
    EXPECT_EQ(w.BeginFile(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
  // Found by fuzz_checkpoint: a name longer than a directory entry failed as an I/O error.
  ASSERT_TRUE(w.BeginFile(std::string(NAME_MAX, 'n')).ok());
  ASSERT_TRUE(w.EndFile().ok());
  ASSERT_TRUE(w.Commit().ok());
  EXPECT_EQ(w.Commit().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.BeginFile("c").code(), StatusCode::kFailedPrecondition);

  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->file_names(), (std::vector<std::string>{"a", std::string(NAME_MAX, 'n')}));
  auto read = ReadFile(**reader, "a");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, data);
}

// Found by fuzz_checkpoint: text that is not UTF-8 cannot be printed into manifest.json, and
// Commit threw nlohmann's type_error out of a Status function instead of refusing it up front.
TEST_F(CheckpointStoreTest, TextThatIsNotUtf8IsRefusedBeforeAnythingIsWritten) {
  const std::string not_utf8 = "v\x9e";  // a continuation byte without a lead byte
  auto refused = CheckpointWriter::Begin(root(), {{"latest", not_utf8}});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("UTF-8"), std::string_view::npos)
      << refused.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(root()));

  auto writer = CheckpointWriter::Begin(root(), {{"generation", 1}});
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  Status bad_name = (*writer)->BeginFile(not_utf8);
  EXPECT_EQ(bad_name.code(), StatusCode::kInvalidArgument) << bad_name.ToString();
  EXPECT_NE(bad_name.message().find("file name"), std::string_view::npos) << bad_name.ToString();
  Status bad_metadata = (*writer)->BeginFile("a", {{"note", not_utf8}});
  EXPECT_EQ(bad_metadata.code(), StatusCode::kInvalidArgument) << bad_metadata.ToString();
  EXPECT_NE(bad_metadata.message().find("'a'"), std::string_view::npos) << bad_metadata.ToString();
  // Both refusals leave the save usable.
  ASSERT_TRUE((*writer)->BeginFile("a").ok());
  ASSERT_TRUE((*writer)->EndFile().ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->file_names(), std::vector<std::string>{"a"});
}

TEST_F(CheckpointStoreTest, ReaderMisuseIsRefused) {
  ASSERT_TRUE(Save(root(), 3).ok());
  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok());
  CheckpointReader& r = **reader;
  std::byte buffer[8];
  EXPECT_EQ(r.Read(buffer).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.EndFile().code(), StatusCode::kFailedPrecondition);

  Status missing = r.BeginFile("nope");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("master.f32"), std::string_view::npos) << missing.ToString();
  EXPECT_EQ(r.file_metadata("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.file_size("nope").status().code(), StatusCode::kNotFound);

  // Past the end of "one" (1 byte).
  ASSERT_TRUE(r.BeginFile("one").ok());
  EXPECT_EQ(r.BeginFile("moments").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.Read(std::span(buffer, 2)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(r.Read(std::span(buffer, 1)).ok());
  EXPECT_EQ(r.Read(std::span(buffer, 1)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(r.EndFile().ok());

  // EndFile before the last byte: the checksum cannot be verified.
  ASSERT_TRUE(r.BeginFile("moments").ok());
  ASSERT_TRUE(r.Read(buffer).ok());
  Status early = r.EndFile();
  EXPECT_EQ(early.code(), StatusCode::kCorruption);
  EXPECT_NE(early.message().find("moments"), std::string_view::npos) << early.ToString();
  // The reader is usable again, and a full read verifies.
  auto read = ReadFile(r, "moments");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_TRUE(*read == FilesOf(3).at("moments"));
}

TEST_F(CheckpointStoreTest, OpenOfAMissingDirectoryOrAnEmptyOneIsNotFound) {
  EXPECT_EQ(CheckpointReader::Open(root()).status().code(), StatusCode::kNotFound);
  ASSERT_EQ(::mkdir(root().c_str(), 0755), 0);
  Status empty = CheckpointReader::Open(root()).status();
  EXPECT_EQ(empty.code(), StatusCode::kNotFound);
  EXPECT_NE(empty.message().find(root()), std::string_view::npos) << empty.ToString();
}

TEST_F(CheckpointStoreTest, BeginNeedsTheParentOfTheDirectory) {
  Status status = CheckpointWriter::Begin(temp_.File("no/such/parent"), {}).status();
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_NE(status.message().find("no/such"), std::string_view::npos) << status.ToString();
}

TEST_F(CheckpointStoreTest, AnotherFormatVersionIsNotSupported) {
  ASSERT_TRUE(Save(root(), 1).ok());
  const std::string manifest = root() + "/v000001/manifest.json";
  nlohmann::json json = nlohmann::json::parse(ReadBytes(manifest));
  json["format_version"] = kCheckpointFormatVersion + 1;
  WriteBytes(manifest, json.dump());
  Status status = CheckpointReader::Open(root()).status();
  EXPECT_EQ(status.code(), StatusCode::kNotSupported);
  EXPECT_NE(status.message().find(manifest), std::string_view::npos) << status.ToString();
}

TEST_F(CheckpointStoreTest, AFlippedByteIsCorruptionNamingTheFile) {
  ASSERT_TRUE(Save(root(), 1).ok());
  const std::string path = root() + "/v000001/master.f32";
  std::string bytes = ReadBytes(path);
  bytes[54321] ^= 0x10;
  WriteBytes(path, bytes);
  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok());
  Status status = ReadFile(**reader, "master.f32").status();
  EXPECT_EQ(status.code(), StatusCode::kCorruption);
  EXPECT_NE(status.message().find(path), std::string_view::npos) << status.ToString();
  EXPECT_TRUE(ReadFile(**reader, "moments").ok());  // the other files still verify
}

TEST_F(CheckpointStoreTest, ATruncatedExtendedOrMissingFileIsCorruption) {
  ASSERT_TRUE(Save(root(), 1).ok());
  const std::string path = root() + "/v000001/moments";
  const std::string bytes = ReadBytes(path);
  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok());
  ASSERT_EQ(::truncate(path.c_str(), 4000), 0);
  Status shorter = (*reader)->BeginFile("moments");
  EXPECT_EQ(shorter.code(), StatusCode::kCorruption);
  EXPECT_NE(shorter.message().find(path), std::string_view::npos) << shorter.ToString();
  WriteBytes(path, bytes + "x");
  EXPECT_EQ((*reader)->BeginFile("moments").code(), StatusCode::kCorruption);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  Status missing = (*reader)->BeginFile("moments");
  EXPECT_EQ(missing.code(), StatusCode::kCorruption);
  EXPECT_NE(missing.message().find(path), std::string_view::npos) << missing.ToString();
  EXPECT_TRUE(ReadFile(**reader, "master.f32").ok());  // a failed BeginFile leaves none open
}

TEST_F(CheckpointStoreTest, AFileShortenedWhileBeingReadIsCorruption) {
  ASSERT_TRUE(Save(root(), 1).ok());
  const std::string path = root() + "/v000001/master.f32";
  auto reader = CheckpointReader::Open(root());
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE((*reader)->BeginFile("master.f32").ok());
  ASSERT_EQ(::truncate(path.c_str(), 1000), 0);
  std::vector<std::byte> buffer(2000);
  Status status = (*reader)->Read(buffer);
  EXPECT_EQ(status.code(), StatusCode::kCorruption);
  EXPECT_NE(status.message().find(path), std::string_view::npos) << status.ToString();
}

TEST_F(CheckpointStoreTest, AGarbledManifestIsCorruption) {
  ASSERT_TRUE(Save(root(), 1).ok());
  const std::string manifest = root() + "/v000001/manifest.json";
  const std::string good = ReadBytes(manifest);
  nlohmann::json json = nlohmann::json::parse(good);
  auto expect_corruption = [&](const std::string& text, const char* what) {
    WriteBytes(manifest, text);
    Status status = CheckpointReader::Open(root()).status();
    EXPECT_EQ(status.code(), StatusCode::kCorruption) << what << ": " << status.ToString();
    EXPECT_NE(status.message().find(manifest), std::string_view::npos) << status.ToString();
  };
  expect_corruption(good.substr(0, good.size() / 2), "cut in half");
  expect_corruption("[1, 2]", "not an object");
  expect_corruption(nlohmann::json({{"files", json["files"]}}).dump(), "no format version");
  nlohmann::json edited = json;
  edited.erase("files");
  expect_corruption(edited.dump(), "no files");
  edited = json;
  edited["files"][0]["xxh3"] = "xyz";
  expect_corruption(edited.dump(), "bad checksum text");
  edited = json;
  edited["files"][0]["size"] = -1;
  expect_corruption(edited.dump(), "negative size");
  edited = json;
  edited["files"][1]["name"] = "../escape";
  expect_corruption(edited.dump(), "path in a name");
  edited = json;
  edited["files"][1] = json["files"][0];
  expect_corruption(edited.dump(), "a file listed twice");
  ::unlink(manifest.c_str());
  expect_corruption("", "empty");
}

// A manifest is read with the configuration's JSON reader, which refuses nesting that would
// exhaust the stack when the metadata is copied (the same bug fuzz_config found).
TEST_F(CheckpointStoreTest, AnAbsurdlyNestedManifestIsCorruption) {
  ASSERT_TRUE(Save(root(), 1).ok());
  const size_t levels = 1'000'000;
  WriteBytes(root() + "/v000001/manifest.json",
             R"({"format_version": 1, "files": [], "metadata": )" + std::string(levels, '[') +
                 std::string(levels, ']') + "}");
  auto reader = CheckpointReader::Open(root());
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kCorruption);
  EXPECT_NE(reader.status().message().find("nested deeper than"), std::string_view::npos)
      << reader.status().ToString();
}

TEST_F(CheckpointStoreTest, AMissingManifestOrVersionOrGarbledLatestIsCorruption) {
  ASSERT_TRUE(Save(root(), 1).ok());
  ASSERT_EQ(::unlink((root() + "/v000001/manifest.json").c_str()), 0);
  EXPECT_EQ(CheckpointReader::Open(root()).status().code(), StatusCode::kCorruption);

  WriteBytes(root() + "/LATEST", "v000009\n");
  Status missing = CheckpointReader::Open(root()).status();
  EXPECT_EQ(missing.code(), StatusCode::kCorruption);
  EXPECT_NE(missing.message().find("v000009"), std::string_view::npos) << missing.ToString();

  WriteBytes(root() + "/LATEST", "../../etc\n");
  EXPECT_EQ(CheckpointReader::Open(root()).status().code(), StatusCode::kCorruption);
}

TEST_F(CheckpointStoreTest, AnAbandonedSaveLeavesThePreviousCheckpoint) {
  ASSERT_TRUE(Save(root(), 1).ok());
  std::string tmp_path;
  {
    auto writer = CheckpointWriter::Begin(root(), {{"generation", 2}});
    ASSERT_TRUE(writer.ok());
    tmp_path = (*writer)->version_path();
    ASSERT_TRUE((*writer)->BeginFile("half").ok());
    ASSERT_TRUE((*writer)->Append(AsBytes(PatternBytes(5, 1000))).ok());
    ExpectGeneration(root(), 1);  // visible only after Commit
  }
  EXPECT_FALSE(std::filesystem::exists(tmp_path));
  ExpectGeneration(root(), 1);
  EXPECT_EQ(Entries(root()), (std::vector<std::string>{"LATEST", "v000001"}));
}

TEST_F(CheckpointStoreTest, BeginRemovesWhatACrashedSaveLeft) {
  ASSERT_TRUE(Save(root(), 1).ok());
  // What a process killed mid-save leaves: a ".tmp" version with files in it, a LATEST.tmp, and
  // a renamed version that LATEST never came to name.
  ASSERT_EQ(::mkdir((root() + "/v000009.tmp").c_str(), 0755), 0);
  WriteBytes(root() + "/v000009.tmp/master.f32", PatternBytes(1, 5000));
  WriteBytes(root() + "/LATEST.tmp", "v000005");
  ASSERT_EQ(::mkdir((root() + "/v000005").c_str(), 0755), 0);
  WriteBytes(root() + "/v000005/moments", "x");
  WriteBytes(root() + "/unrelated", "kept");
  ExpectGeneration(root(), 1);

  auto writer = CheckpointWriter::Begin(root(), {{"generation", 2}});
  ASSERT_TRUE(writer.ok());
  EXPECT_EQ((*writer)->version_path(), root() + "/v000002.tmp");
  EXPECT_EQ(Entries(root()),
            (std::vector<std::string>{"LATEST", "unrelated", "v000001", "v000002.tmp"}));
  ASSERT_TRUE(WriteFiles(**writer, FilesOf(2)).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  ExpectGeneration(root(), 2);
  EXPECT_EQ(Entries(root()), (std::vector<std::string>{"LATEST", "unrelated", "v000002"}));
}

TEST_F(CheckpointStoreTest, BeginKeepsVersionsWhenLatestIsUnreadable) {
  ASSERT_TRUE(Save(root(), 1).ok());
  WriteBytes(root() + "/LATEST", "garbage");
  auto writer = CheckpointWriter::Begin(root(), {{"generation", 2}});
  ASSERT_TRUE(writer.ok());
  EXPECT_TRUE(std::filesystem::exists(root() + "/v000001"));  // maybe all that can be recovered
  ASSERT_TRUE(WriteFiles(**writer, FilesOf(2)).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  ExpectGeneration(root(), 2);
}

// The save runs in a child process; as root it first drops to an unprivileged user, for whom the
// 0555 directory really is read-only. The child's exit status is the save's status code.
TEST_F(CheckpointStoreTest, AReadOnlyDirectoryFailsAndKeepsThePreviousCheckpoint) {
  ASSERT_TRUE(Save(root(), 1).ok());
  ASSERT_EQ(::chmod(temp_.File("").c_str(), 0755), 0);
  ASSERT_EQ(::chmod(root().c_str(), 0555), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    constexpr uid_t kNobody = 65534;
    if (::geteuid() == 0 && (::setgid(kNobody) != 0 || ::setuid(kNobody) != 0)) ::_exit(100);
    if (::access(root().c_str(), W_OK) == 0) ::_exit(101);  // still writable: no real case
    ::_exit(static_cast<int>(Save(root(), 2).code()));
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_EQ(::chmod(root().c_str(), 0755), 0);
  ASSERT_TRUE(WIFEXITED(wstatus));
  if (WEXITSTATUS(wstatus) >= 100) GTEST_SKIP() << "no unprivileged user to test as";
  EXPECT_EQ(WEXITSTATUS(wstatus), static_cast<int>(StatusCode::kPermissionDenied));
  ExpectGeneration(root(), 1);
}

TEST_F(CheckpointStoreTest, AReadOnlyVersionFileIsReportedWithItsPath) {
  CheckpointWriterOptions options;
  options.fault_for_testing = [](CheckpointSyscall call, const std::string&) {
    return call == CheckpointSyscall::kOpen ? EROFS : 0;
  };
  auto writer = CheckpointWriter::Begin(root(), {}, std::move(options));
  ASSERT_TRUE(writer.ok());
  Status status = (*writer)->BeginFile("f");
  EXPECT_EQ(status.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(status.message().find((*writer)->version_path() + "/f"), std::string_view::npos)
      << status.ToString();
}

// Counts the system calls of a save and can fail the nth one.
struct FaultPlan {
  uint64_t fail_at = 0;  // 1-based; 0: none
  int error = EIO;
  uint64_t calls = 0;
  bool latest_replaced = false;  // the LATEST rename ran before the fault
  CheckpointSyscall failed_call{};
  std::string failed_path;

  CheckpointWriterOptions Options() {
    CheckpointWriterOptions options;
    options.fault_for_testing = [this](CheckpointSyscall call, const std::string& path) {
      if (++calls == fail_at) {
        failed_call = call;
        failed_path = path;
        return error;
      }
      if (call == CheckpointSyscall::kRename && path.ends_with("/LATEST.tmp")) {
        latest_replaced = true;
      }
      return 0;
    };
    return options;
  }
};

// Every system call of a save fails in turn: the error surfaces naming the path, the checkpoint
// that loads is the previous one (or, for a failure after LATEST was replaced, the new one, whole),
// and the next save succeeds and leaves nothing behind.
TEST_F(CheckpointStoreTest, AFailureAtEverySystemCallOfASaveKeepsACompleteCheckpoint) {
  ASSERT_TRUE(Save(root(), 1).ok());
  FaultPlan count;
  ASSERT_TRUE(Save(root(), 2, count.Options()).ok());
  ASSERT_GT(count.calls, 20u);
  uint64_t generation = 2;
  for (uint64_t k = 1; k <= count.calls; ++k) {
    SCOPED_TRACE("failing system call " + std::to_string(k));
    FaultPlan plan{.fail_at = k, .error = k % 2 ? EIO : ENOSPC};
    Status status = Save(root(), generation + 1, plan.Options());
    if (plan.failed_call == CheckpointSyscall::kRemove && plan.latest_replaced) {
      EXPECT_TRUE(status.ok()) << status.ToString();  // removal of the old version: a warning
    } else {
      ASSERT_FALSE(status.ok());
      EXPECT_EQ(status.code(), k % 2 ? StatusCode::kIoError : StatusCode::kNoSpace);
      EXPECT_NE(status.message().find(plan.failed_path), std::string_view::npos)
          << status.ToString();
    }
    if (plan.latest_replaced) ++generation;
    ExpectGeneration(root(), generation);
    for (const std::string& name : Entries(root())) EXPECT_FALSE(name.ends_with(".tmp")) << name;
  }
  ASSERT_TRUE(Save(root(), 100).ok());
  ExpectGeneration(root(), 100);
  EXPECT_EQ(Entries(root()).size(), 2u);
}

TEST_F(CheckpointStoreTest, AnErrorEndsTheSaveAndLaterCallsSayWhy) {
  ASSERT_TRUE(Save(root(), 1).ok());
  CheckpointWriterOptions options;
  options.fault_for_testing = [](CheckpointSyscall call, const std::string&) {
    return call == CheckpointSyscall::kWrite ? ENOSPC : 0;
  };
  auto writer = CheckpointWriter::Begin(root(), {{"generation", 2}}, std::move(options));
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->BeginFile("f").ok());
  std::string data = "data";
  EXPECT_EQ((*writer)->Append(AsBytes(data)).code(), StatusCode::kNoSpace);
  Status later = (*writer)->Append(AsBytes(data));
  EXPECT_EQ(later.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(later.message().find("No space left"), std::string_view::npos) << later.ToString();
  EXPECT_EQ((*writer)->EndFile().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*writer)->Commit().code(), StatusCode::kFailedPrecondition);
  writer->reset();
  ExpectGeneration(root(), 1);
  EXPECT_EQ(Entries(root()), (std::vector<std::string>{"LATEST", "v000001"}));
}

// A write that fails after an earlier one of the same Append got part of the bytes down (a file
// size limit: EFBIG after 2 MiB) counts that part: the message said 0 bytes were written.
TEST_F(CheckpointStoreTest, ANoSpaceErrorCountsTheBytesAPartialAppendWrote) {
  int writes = 0;
  CheckpointWriterOptions options;
  options.fault_for_testing = [&writes](CheckpointSyscall call, const std::string&) {
    if (call != CheckpointSyscall::kWrite) return 0;
    return ++writes == 1 ? CheckpointWriterOptions::kShortWrite : ENOSPC;
  };
  auto writer = CheckpointWriter::Begin(root(), {{"generation", 1}}, std::move(options));
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->BeginFile("f").ok());
  const std::string data(8192, 'x');
  const Status failed = (*writer)->Append(AsBytes(data));
  EXPECT_EQ(failed.code(), StatusCode::kNoSpace);
  EXPECT_NE(failed.message().find("after 4096 bytes of the save were written"),
            std::string_view::npos)
      << failed.ToString();
  EXPECT_NE(failed.message().find("at offset 4096"), std::string_view::npos) << failed.ToString();
}

TEST_F(CheckpointStoreTest, InterruptedAndShortWritesAndFsyncsAreResumed) {
  uint64_t calls = 0;
  std::map<std::pair<CheckpointSyscall, int>, int> injected;  // (call, what it returned) -> count
  CheckpointWriterOptions options;
  options.fault_for_testing = [&](CheckpointSyscall call, const std::string&) {
    ++calls;
    int fault = 0;
    if (call == CheckpointSyscall::kWrite) {
      fault = calls % 3 == 0 ? EINTR : CheckpointWriterOptions::kShortWrite;
    } else if (call == CheckpointSyscall::kFsync || call == CheckpointSyscall::kOpen) {
      fault = calls % 2 == 0 ? EINTR : 0;
    }
    if (fault != 0) ++injected[{call, fault}];
    return fault;
  };
  ASSERT_TRUE(Save(root(), 4, std::move(options)).ok());
  ExpectGeneration(root(), 4);
  // Every kind of fault the test names was injected, so each resumption path ran.
  EXPECT_GT((injected[{CheckpointSyscall::kWrite, EINTR}]), 0);
  EXPECT_GT((injected[{CheckpointSyscall::kWrite, CheckpointWriterOptions::kShortWrite}]), 0);
  EXPECT_GT((injected[{CheckpointSyscall::kFsync, EINTR}]), 0);
  EXPECT_GT((injected[{CheckpointSyscall::kOpen, EINTR}]), 0);
}

// mkdir, rename and the removal of the older version are resumed after EINTR too, like every
// other call of a save.
TEST_F(CheckpointStoreTest, InterruptedMkdirRenameAndRemoveAreResumed) {
  ASSERT_TRUE(Save(root(), 1).ok());
  std::vector<CheckpointSyscall> interrupted;
  CheckpointWriterOptions options;
  options.fault_for_testing = [&interrupted](CheckpointSyscall call, const std::string&) {
    const bool once = call == CheckpointSyscall::kMkdir || call == CheckpointSyscall::kRename ||
                      call == CheckpointSyscall::kRemove;
    if (!once || std::find(interrupted.begin(), interrupted.end(), call) != interrupted.end())
      return 0;
    interrupted.push_back(call);
    return EINTR;
  };
  const Status saved = Save(root(), 2, std::move(options));
  ASSERT_TRUE(saved.ok()) << saved.ToString();
  EXPECT_EQ(interrupted.size(), 3u);
  ExpectGeneration(root(), 2);
  EXPECT_EQ(Entries(root()), (std::vector<std::string>{"LATEST", "v000002"}));
}

}  // namespace
}  // namespace zoe::offload
