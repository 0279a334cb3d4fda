// Fuzzes the checkpoint reader and writer: the input is a checkpoint directory (LATEST, the live
// version's manifest.json and its files) that CheckpointReader opens and reads through, and the
// same files written by CheckpointWriter must read back byte for byte.
//
// Input: parts separated by "\n--8<--\n": LATEST's contents, manifest.json's contents, then one
// part per file, "<name>\n<bytes>". A first part starting with '!' (dropped from LATEST) makes the
// manifest's "xxh3" of each file that exists match its bytes, so reads get past the checksum.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "fmt/format.h"
#include "offload/checkpoint/checkpoint_store.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_scratch.h"

namespace zoe::fuzz {
namespace {

namespace fs = std::filesystem;
constexpr std::string_view kSeparator = "\n--8<--\n";
constexpr size_t kMaxFiles = 16;

struct FileSpec {
  std::string name;
  std::string bytes;
};

struct Input {
  bool fix_checksums = false;
  std::string latest;
  std::string manifest;
  std::vector<FileSpec> files;
};

std::vector<std::string_view> Split(std::string_view text) {
  std::vector<std::string_view> parts;
  for (;;) {
    const size_t at = text.find(kSeparator);
    parts.push_back(text.substr(0, at));
    if (at == std::string_view::npos) return parts;
    text.remove_prefix(at + kSeparator.size());
  }
}

Input DecodeInput(std::string_view text) {
  std::vector<std::string_view> parts = Split(text);
  Input input;
  std::string_view latest = parts[0];
  input.fix_checksums = !latest.empty() && latest.front() == '!';
  if (input.fix_checksums) latest.remove_prefix(1);
  input.latest = std::string(latest);
  if (parts.size() > 1) input.manifest = std::string(parts[1]);
  for (size_t i = 2; i < parts.size() && input.files.size() < kMaxFiles; ++i) {
    const size_t newline = parts[i].find('\n');
    const std::string_view name = parts[i].substr(0, newline);
    const std::string_view bytes =
        newline == std::string_view::npos ? std::string_view() : parts[i].substr(newline + 1);
    input.files.push_back(FileSpec{std::string(name), std::string(bytes)});
  }
  return input;
}

std::string FreshDirectory(const std::string& name) {
  const std::string path = ProcessScratchDirectory("checkpoint") + "/" + name;
  fs::remove_all(path);
  fs::create_directory(path);
  return path;
}

void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file name the fuzzer may create inside the version directory: plain and not a store name.
bool Creatable(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name != "manifest.json" &&
         name.size() < 200 && name.find_first_of(std::string_view("/\0", 2)) == name.npos;
}

// The version directory LATEST names when it is a plain name, else "v000001".
std::string VersionDirectory(const std::string& latest) {
  std::string name = latest;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  return Creatable(name) && name != "LATEST" ? name : "v000001";
}

// Sets the "xxh3" of every manifest entry naming a file of the input to that file's checksum.
std::string FixChecksums(const Input& input) {
  nlohmann::json manifest = nlohmann::json::parse(input.manifest, nullptr, false);
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_array()) {
    return input.manifest;
  }
  for (nlohmann::json& entry : manifest["files"]) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string()) continue;
    for (const FileSpec& file : input.files) {
      if (file.name != entry["name"].get<std::string>()) continue;
      entry["xxh3"] = fmt::format("{:016x}", XXH3_64bits(file.bytes.data(), file.bytes.size()));
    }
  }
  return manifest.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Lays the input out as a checkpoint root and returns its path.
std::string MakeCheckpoint(const Input& input) {
  const std::string root = FreshDirectory("read");
  const std::string version = root + "/" + VersionDirectory(input.latest);
  fs::create_directory(version);
  WriteFile(root + "/LATEST", input.latest);
  WriteFile(version + "/manifest.json", input.fix_checksums ? FixChecksums(input) : input.manifest);
  for (const FileSpec& file : input.files) {
    if (Creatable(file.name)) WriteFile(version + "/" + file.name, file.bytes);
  }
  return root;
}

// The file of the input named `name` that is on disk: the last one when a name repeats.
const FileSpec* FindSpec(const Input& input, std::string_view name) {
  for (auto file = input.files.rbegin(); file != input.files.rend(); ++file) {
    if (file->name == name) return &*file;
  }
  return nullptr;
}

// Reads one listed file through in pieces; a file that verifies holds exactly what was written.
void ReadListedFile(offload::CheckpointReader& reader, const Input& input,
                    const std::string& name) {
  Result<uint64_t> size = reader.file_size(name);
  FUZZ_CHECK(size.ok(), size.status().ToString());
  FUZZ_CHECK(reader.file_metadata(name).ok(), name);
  if (!reader.BeginFile(name).ok()) return;
  const FileSpec* spec = FindSpec(input, name);
  // BeginFile compares the manifest's size with the file's: only files the input made get here.
  FUZZ_CHECK(spec != nullptr && spec->bytes.size() == *size, "opened a file of another size");
  std::string bytes(*size, '\0');
  for (size_t done = 0; done < bytes.size();) {
    const size_t piece = std::min<size_t>(bytes.size() - done, 1000);
    if (!reader.Read({reinterpret_cast<std::byte*>(bytes.data() + done), piece}).ok()) return;
    done += piece;
  }
  std::byte past_end{};
  Status past = reader.Read({&past_end, 1});
  FUZZ_CHECK(past.code() == StatusCode::kInvalidArgument, past.ToString());
  Status end = reader.EndFile();
  if (!end.ok()) {
    FUZZ_CHECK(end.code() == StatusCode::kCorruption, end.ToString());
    return;
  }
  FUZZ_CHECK(bytes == spec->bytes, "a verified file read back other bytes");
}

void ReadCheckpoint(const Input& input) {
  const std::string root = MakeCheckpoint(input);
  Result<std::unique_ptr<offload::CheckpointReader>> reader = offload::CheckpointReader::Open(root);
  if (!reader.ok()) {
    FUZZ_CHECK(!reader.status().message().empty(), "a rejected checkpoint has no message");
    return;
  }
  (void)(*reader)->metadata().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  for (const std::string& name : (*reader)->file_names()) ReadListedFile(**reader, input, name);
  Status unknown = (*reader)->BeginFile("not listed in any manifest");
  FUZZ_CHECK(unknown.code() == StatusCode::kNotFound, unknown.ToString());
}

// The input's files saved by the writer read back as written; names the store refuses are
// InvalidArgument and leave the save usable.
void WriteCheckpoint(const Input& input) {
  const std::string root = FreshDirectory("write");
  auto writer = offload::CheckpointWriter::Begin(root, {{"latest", input.latest}});
  if (!writer.ok()) {  // metadata that is not UTF-8
    FUZZ_CHECK(writer.status().code() == StatusCode::kInvalidArgument, writer.status().ToString());
    return;
  }
  std::vector<const FileSpec*> written;
  for (const FileSpec& file : input.files) {
    Status begun = (*writer)->BeginFile(file.name, {{"size", file.bytes.size()}});
    if (!begun.ok()) {
      FUZZ_CHECK(begun.code() == StatusCode::kInvalidArgument, begun.ToString());
      continue;
    }
    const auto* bytes = reinterpret_cast<const std::byte*>(file.bytes.data());
    Status appended = (*writer)->Append({bytes, file.bytes.size()});
    FUZZ_CHECK(appended.ok(), appended.ToString());
    Status ended = (*writer)->EndFile();
    FUZZ_CHECK(ended.ok(), ended.ToString());
    written.push_back(&file);
  }
  Status committed = (*writer)->Commit();
  FUZZ_CHECK(committed.ok(), committed.ToString());
  auto reader = offload::CheckpointReader::Open(root);
  FUZZ_CHECK(reader.ok(), reader.status().ToString());
  FUZZ_CHECK((*reader)->file_names().size() == written.size(), "files lost by the writer");
  for (const FileSpec* file : written) {
    std::string bytes(file->bytes.size(), '\0');
    FUZZ_CHECK((*reader)->BeginFile(file->name).ok(), file->name);
    FUZZ_CHECK((*reader)->Read({reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}).ok(),
               file->name);
    Status end = (*reader)->EndFile();
    FUZZ_CHECK(end.ok() && bytes == file->bytes, file->name + ": " + end.ToString());
  }
}

}  // namespace
}  // namespace zoe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const zoe::fuzz::Input input =
      zoe::fuzz::DecodeInput({reinterpret_cast<const char*>(data), size});
  zoe::fuzz::ReadCheckpoint(input);
  zoe::fuzz::WriteCheckpoint(input);
  return 0;
}
