// Fuzzes the trace file loader: DecodeTrace and LoadTrace on arbitrary bytes (with the checksum
// and registry fingerprint made to match on some inputs, so the event decoder is reached), and
// the round trip of every trace they accept through EncodeTrace, SaveTrace and LoadTrace.
#include <unistd.h>
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "offload/paging/trace.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_scratch.h"

namespace zoe::fuzz {
namespace {

constexpr size_t kFingerprintOffset = 16;
constexpr size_t kChecksumBytes = 8;
constexpr uint64_t kFingerprint = 0x5a4f45'5a4f45ull;

// The first input byte steers the run; the rest is the file.
struct Plan {
  bool fix_checksum;     // overwrite the last 8 bytes with the XXH3 of the rest
  bool fix_fingerprint;  // expect the fingerprint the file declares
  bool through_file;     // LoadTrace from a file instead of DecodeTrace
};

Plan DecodePlan(uint8_t byte) { return Plan{(byte & 1) != 0, (byte & 2) != 0, (byte & 4) != 0}; }

uint64_t ReadU64(std::string_view bytes, size_t offset) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[offset + i]);
  return v;
}

void FixChecksum(std::string& bytes) {
  if (bytes.size() < kChecksumBytes) return;
  const size_t body = bytes.size() - kChecksumBytes;
  uint64_t sum = XXH3_64bits(bytes.data(), body);
  for (size_t i = 0; i < kChecksumBytes; ++i) bytes[body + i] = static_cast<char>(sum >> (8 * i));
}

void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  FUZZ_CHECK(out.good(), "cannot write " + path);
}

Result<offload::Trace> Load(const std::string& bytes, uint64_t fingerprint, bool through_file) {
  if (!through_file) return offload::DecodeTrace(bytes, fingerprint, "<fuzz input>");
  const std::string path = ProcessScratchDirectory("trace") + "/input.trace";
  WriteFile(path, bytes);
  return offload::LoadTrace(path, fingerprint);
}

// The format has one encoding per trace, so what was accepted re-encodes to the same bytes and
// survives a save and a load.
void CheckAccepted(const offload::Trace& trace, const std::string& bytes, uint64_t fingerprint) {
  FUZZ_CHECK(trace.registry_fingerprint == fingerprint, "fingerprint not checked");
  FUZZ_CHECK(offload::EncodeTrace(trace) == bytes, "an accepted trace re-encodes differently");
  const std::string path = ProcessScratchDirectory("trace") + "/saved.trace";
  Status saved = offload::SaveTrace(trace, path);
  if (trace.name.empty() || trace.name.size() > offload::kMaxTraceNameBytes) {
    FUZZ_CHECK(saved.code() == StatusCode::kInvalidArgument, saved.ToString());
    return;
  }
  FUZZ_CHECK(saved.ok(), saved.ToString());
  Result<offload::Trace> loaded = offload::LoadTrace(path, fingerprint);
  FUZZ_CHECK(loaded.ok(), loaded.status().ToString());
  FUZZ_CHECK(loaded->name == trace.name && loaded->events == trace.events,
             "a saved trace loads back differently");
}

}  // namespace
}  // namespace zoe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zoe::fuzz;
  if (size == 0) return 0;
  const Plan plan = DecodePlan(data[0]);
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (plan.fix_checksum) FixChecksum(bytes);
  const uint64_t fingerprint = plan.fix_fingerprint && bytes.size() >= kFingerprintOffset + 8
                                   ? ReadU64(bytes, kFingerprintOffset)
                                   : kFingerprint;
  zoe::Result<zoe::offload::Trace> trace = Load(bytes, fingerprint, plan.through_file);
  if (!trace.ok()) {
    FUZZ_CHECK(!trace.status().message().empty(), "a rejected trace has no message");
    return 0;
  }
  CheckAccepted(*trace, bytes, fingerprint);
  return 0;
}
