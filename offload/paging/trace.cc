#include "offload/paging/trace.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>

namespace zoe::offload {
namespace {

constexpr size_t kHeaderBytes = 32;
constexpr size_t kEventBytes = 18;
constexpr size_t kChecksumBytes = 8;
constexpr uint64_t kMaxTraceFileBytes = uint64_t{1} << 34;  // 16 GiB, far above any real trace

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t GetLE(std::string_view bytes, size_t offset, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<unsigned char>(bytes[offset + static_cast<size_t>(i)]);
  }
  return v;
}

// Syscall layer: each returns 0 or a byte count, or -errno.
int64_t WriteAll(int fd, std::string_view bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    done += static_cast<size_t>(n);
  }
  return static_cast<int64_t>(done);
}

int64_t ReadAll(int fd, std::string& out) {
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    if (n == 0) return static_cast<int64_t>(out.size());
    if (out.size() + static_cast<size_t>(n) > kMaxTraceFileBytes) return -EFBIG;
    out.append(buffer, static_cast<size_t>(n));
  }
}

int WriteFileSynced(const std::string& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -errno;
  int64_t rc = WriteAll(fd, bytes);
  if (rc >= 0 && ::fsync(fd) != 0) rc = -errno;
  if (::close(fd) != 0 && rc >= 0) rc = -errno;
  return rc < 0 ? static_cast<int>(rc) : 0;
}

Status CheckHeader(std::string_view bytes, std::string_view source) {
  const size_t minimum = kHeaderBytes + kChecksumBytes;
  if (bytes.size() >= sizeof kTraceMagic &&
      std::memcmp(bytes.data(), kTraceMagic, sizeof kTraceMagic) != 0) {
    return Status::Corruption(
        fmt::format("{} is not a zoe trace file: it does not start with \"ZOETRACE\"", source));
  }
  if (bytes.size() < minimum) {
    return Status::Corruption(fmt::format("{} is truncated: {} bytes, a trace file has at least {}",
                                          source, bytes.size(), minimum));
  }
  const uint64_t version = GetLE(bytes, 8, 4);
  if (version != kTraceFormatVersion) {
    return Status::NotSupported(
        fmt::format("{} has trace format version {}; this build reads version {}", source, version,
                    kTraceFormatVersion));
  }
  return Status::Ok();
}

// The total size the header declares, or an error when it cannot be a valid trace.
Result<uint64_t> DeclaredSize(std::string_view bytes, std::string_view source) {
  const uint64_t name_bytes = GetLE(bytes, 12, 4);
  const uint64_t events = GetLE(bytes, 24, 8);
  if (name_bytes > kMaxTraceNameBytes) {
    return Status::Corruption(fmt::format("{}: trace name length {} exceeds the limit of {}",
                                          source, name_bytes, kMaxTraceNameBytes));
  }
  if (events > kMaxTraceFileBytes / kEventBytes) {
    return Status::Corruption(fmt::format("{} is truncated: it declares {} events in {} bytes",
                                          source, events, bytes.size()));
  }
  return kHeaderBytes + name_bytes + events * kEventBytes + kChecksumBytes;
}

Status CheckSizeAndChecksum(std::string_view bytes, std::string_view source) {
  ZOE_ASSIGN_OR_RETURN(const uint64_t declared, DeclaredSize(bytes, source));
  if (bytes.size() < declared) {
    return Status::Corruption(fmt::format("{} is truncated: {} bytes, its header declares {}",
                                          source, bytes.size(), declared));
  }
  if (bytes.size() > declared) {
    return Status::Corruption(
        fmt::format("{} has {} unexpected bytes after the {} its header declares", source,
                    bytes.size() - declared, declared));
  }
  const size_t body = bytes.size() - kChecksumBytes;
  const uint64_t stored = GetLE(bytes, body, 8);
  const uint64_t computed = XXH3_64bits(bytes.data(), body);
  if (stored != computed) {
    return Status::Corruption(fmt::format(
        "{}: checksum mismatch (stored {:#018x}, computed {:#018x}); the file is corrupt", source,
        stored, computed));
  }
  return Status::Ok();
}

Result<TraceEvent> DecodeEvent(std::string_view bytes, size_t offset, size_t index,
                               std::string_view source) {
  TraceEvent event;
  event.tensor = TensorId(static_cast<uint32_t>(GetLE(bytes, offset, 4)));
  event.chunk = ChunkId(static_cast<uint32_t>(GetLE(bytes, offset + 4, 4)));
  event.access = static_cast<Access>(GetLE(bytes, offset + 8, 1));
  event.tier = static_cast<Tier>(GetLE(bytes, offset + 9, 1));
  event.bytes = GetLE(bytes, offset + 10, 8);
  const bool addressable = event.tier == Tier::kDevice || event.tier == Tier::kHost;
  if (!IsValidAccess(event.access) || !addressable || !event.tensor.valid() ||
      !event.chunk.valid()) {
    return Status::Corruption(
        fmt::format("{}: event {} is malformed (tensor {}, chunk {}, access {}, tier {})", source,
                    index, event.tensor.value, event.chunk.value, static_cast<int>(event.access),
                    static_cast<int>(event.tier)));
  }
  return event;
}

}  // namespace

Result<std::vector<TraceEvent>> EventsForAcquire(const ChunkLayout& layout, TensorId tensor,
                                                 Access access, Tier tier) {
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, layout.tensor(tensor));
  std::vector<TraceEvent> events;
  events.reserve(entry->pieces.size());
  for (const TensorPiece& piece : entry->pieces) {
    events.push_back(TraceEvent{tensor, piece.chunk, access, piece.bytes, tier});
  }
  return events;
}

std::string EncodeTrace(const Trace& trace) {
  std::string out;
  out.reserve(kHeaderBytes + trace.name.size() + trace.events.size() * kEventBytes +
              kChecksumBytes);
  out.append(kTraceMagic, sizeof kTraceMagic);
  PutU32(out, kTraceFormatVersion);
  PutU32(out, static_cast<uint32_t>(trace.name.size()));
  PutU64(out, trace.registry_fingerprint);
  PutU64(out, trace.events.size());
  out.append(trace.name);
  for (const TraceEvent& e : trace.events) {
    PutU32(out, e.tensor.value);
    PutU32(out, e.chunk.value);
    out.push_back(static_cast<char>(e.access));
    out.push_back(static_cast<char>(e.tier));
    PutU64(out, e.bytes);
  }
  PutU64(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

Result<Trace> DecodeTrace(std::string_view bytes, uint64_t expected_fingerprint,
                          std::string_view source) {
  ZOE_RETURN_IF_ERROR(CheckHeader(bytes, source));
  ZOE_RETURN_IF_ERROR(CheckSizeAndChecksum(bytes, source));
  Trace trace;
  const size_t name_bytes = GetLE(bytes, 12, 4);
  trace.registry_fingerprint = GetLE(bytes, 16, 8);
  trace.name.assign(bytes.substr(kHeaderBytes, name_bytes));
  if (trace.registry_fingerprint != expected_fingerprint) {
    return Status::FailedPrecondition(fmt::format(
        "{}: trace '{}' was recorded against another tensor registry (fingerprint {:#018x}, "
        "this registry has {:#018x}); register the same tensors in the same order or record "
        "the trace again",
        source, trace.name, trace.registry_fingerprint, expected_fingerprint));
  }
  const size_t count = GetLE(bytes, 24, 8);
  trace.events.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const size_t offset = kHeaderBytes + name_bytes + i * kEventBytes;
    ZOE_ASSIGN_OR_RETURN(TraceEvent event, DecodeEvent(bytes, offset, i, source));
    trace.events.push_back(event);
  }
  return trace;
}

Status SaveTrace(const Trace& trace, const std::string& path) {
  if (trace.name.empty() || trace.name.size() > kMaxTraceNameBytes) {
    return Status::InvalidArgument(fmt::format("save trace to {}: the name must have 1 to {} bytes",
                                               path, kMaxTraceNameBytes));
  }
  const std::string temporary = path + ".tmp";
  if (int rc = WriteFileSynced(temporary, EncodeTrace(trace)); rc < 0) {
    ::unlink(temporary.c_str());
    return Status::FromErrno(rc, fmt::format("save trace '{}': write {}", trace.name, temporary));
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temporary.c_str());
    return Status::FromErrno(
        err, fmt::format("save trace '{}': rename {} to {}", trace.name, temporary, path));
  }
  return Status::Ok();
}

Result<Trace> LoadTrace(const std::string& path, uint64_t expected_fingerprint) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, fmt::format("load trace: open {}", path));
  std::string bytes;
  const int64_t rc = ReadAll(fd, bytes);
  ::close(fd);
  if (rc < 0)
    return Status::FromErrno(static_cast<int>(rc), fmt::format("load trace: read {}", path));
  return DecodeTrace(bytes, expected_fingerprint, path);
}

Status TraceSet::Begin(std::string_view name, uint64_t registry_fingerprint) {
  if (recording_) {
    return Status::FailedPrecondition(
        fmt::format("cannot begin trace '{}': trace '{}' is still being recorded; end it first",
                    name, current_.name));
  }
  if (name.empty() || name.size() > kMaxTraceNameBytes) {
    return Status::InvalidArgument(
        fmt::format("a trace name must have 1 to {} bytes", kMaxTraceNameBytes));
  }
  current_ = Trace{std::string(name), registry_fingerprint, {}};
  recording_ = true;
  return Status::Ok();
}

Status TraceSet::Record(const TraceEvent& event) {
  if (!recording_) return Status::FailedPrecondition("no trace is being recorded");
  if (current_.events.size() >= max_events_) {
    return Status::OutOfMemory(
        fmt::format("trace '{}' reached its limit of {} events; end the trace once per iteration",
                    current_.name, max_events_));
  }
  current_.events.push_back(event);
  return Status::Ok();
}

Result<const Trace*> TraceSet::End() {
  if (!recording_) return Status::FailedPrecondition("trace end without a trace begin");
  recording_ = false;
  std::string name = current_.name;
  auto [it, inserted] = traces_.insert_or_assign(std::move(name), std::move(current_));
  current_ = Trace{};
  return &it->second;
}

void TraceSet::Abandon() {
  recording_ = false;
  current_ = Trace{};
}

Status TraceSet::Insert(Trace trace) {
  if (trace.name.empty() || trace.name.size() > kMaxTraceNameBytes) {
    return Status::InvalidArgument(
        fmt::format("a trace name must have 1 to {} bytes", kMaxTraceNameBytes));
  }
  std::string name = trace.name;
  traces_.insert_or_assign(std::move(name), std::move(trace));
  return Status::Ok();
}

Result<const Trace*> TraceSet::Find(std::string_view name) const {
  auto it = traces_.find(name);
  if (it == traces_.end()) {
    return Status::NotFound(
        fmt::format("no trace named '{}'; known: [{}]", name, fmt::join(Names(), ", ")));
  }
  return &it->second;
}

std::vector<std::string> TraceSet::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, trace] : traces_) names.push_back(name);
  return names;
}

}  // namespace zoe::offload
