#include "io/file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "core/log.h"

namespace zoe::io {
namespace {

int OpenRaw(const std::string& path, const OpenOptions& options, bool direct) {
  if (direct && options.refuse_direct_for_testing) return -EINVAL;
  int flags = O_RDWR | O_CLOEXEC;
  if (options.create) flags |= O_CREAT;
  if (options.truncate) flags |= O_TRUNC;
  if (options.exclusive) flags |= O_EXCL;
  if (direct) flags |= O_DIRECT;
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0600);
  } while (fd < 0 && errno == EINTR);
  return fd < 0 ? -errno : fd;
}

}  // namespace

File::File(int fd, std::string path, bool direct)
    : fd_(fd), path_(std::move(path)), direct_(direct) {
  if (direct_) LoadDirectAlignment();
}

File::~File() { ::close(fd_); }

Result<std::unique_ptr<File>> File::Open(const std::string& path, const OpenOptions& options) {
  int fd = OpenRaw(path, options, options.direct);
  bool direct = options.direct;
  // EINVAL from open with O_DIRECT means the filesystem does not support it.
  if (fd == -EINVAL && options.direct) {
    ZOE_LOG_WARN("io: {} refuses O_DIRECT; using buffered I/O (page cache) for it", path);
    direct = false;
    fd = OpenRaw(path, options, false);
  }
  if (fd < 0) return Status::FromErrno(fd, "open " + path);
  return std::unique_ptr<File>(new File(fd, path, direct));
}

// statx reports the direct-I/O alignment on kernels and filesystems that know it (6.1+); where
// it does not, 4096 is safe on every common device.
void File::LoadDirectAlignment() {
  struct statx stx {};
  mem_align_ = offset_align_ = kDefaultDirectAlignment;
  if (::statx(fd_, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0) return;
  if ((stx.stx_mask & STATX_DIOALIGN) == 0 || stx.stx_dio_offset_align == 0) return;
  mem_align_ = stx.stx_dio_mem_align;
  offset_align_ = stx.stx_dio_offset_align;
}

Status File::Allocate(uint64_t bytes) {
  if (bytes == 0) return Status::Ok();
  int ret;
  do {
    ret = ::fallocate(fd_, 0, 0, static_cast<off_t>(bytes));
  } while (ret != 0 && errno == EINTR);
  if (ret != 0)
    return Status::FromErrno(errno, fmt::format("fallocate {} bytes for {}", bytes, path_));
  return Status::Ok();
}

Result<uint64_t> File::Size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Status::FromErrno(errno, "fstat " + path_);
  return static_cast<uint64_t>(st.st_size);
}

Status File::Remove() {
  if (::unlink(path_.c_str()) != 0 && errno != ENOENT)
    return Status::FromErrno(errno, "unlink " + path_);
  return Status::Ok();
}

FileSet::FileSet(std::vector<std::unique_ptr<File>> files, uint64_t stripe_unit,
                 uint64_t checksum_block)
    : files_(std::move(files)), stripe_unit_(stripe_unit) {
  if (checksum_block != 0) checksums_ = std::make_unique<ChecksumTable>(checksum_block);
}

Result<std::unique_ptr<FileSet>> FileSet::Open(const std::vector<std::string>& paths,
                                               const FileSetOptions& options) {
  std::vector<std::unique_ptr<File>> files;
  for (const std::string& path : paths) {
    ZOE_ASSIGN_OR_RETURN(auto file, File::Open(path, options.open));
    files.push_back(std::move(file));
  }
  return FromFiles(std::move(files), options);
}

Result<std::unique_ptr<FileSet>> FileSet::FromFiles(std::vector<std::unique_ptr<File>> files,
                                                    const FileSetOptions& options) {
  if (files.empty()) return Status::InvalidArgument("a file set needs at least one path");
  if (options.stripe_unit == 0) return Status::InvalidArgument("stripe unit must be > 0 bytes");
  for (const auto& file : files) {
    if (files.size() > 1 && options.stripe_unit % file->offset_align() != 0) {
      return Status::InvalidArgument(
          fmt::format("stripe unit {} B is not a multiple of the direct-I/O alignment {} B of {}",
                      options.stripe_unit, file->offset_align(), file->path()));
    }
  }
  return std::unique_ptr<FileSet>(
      new FileSet(std::move(files), options.stripe_unit, options.checksum_block));
}

bool FileSet::direct() const {
  for (const auto& file : files_) {
    if (!file->direct()) return false;
  }
  return true;
}

void FileSet::Map(uint64_t offset, uint64_t length, std::vector<Piece>* out) const {
  const uint64_t n = files_.size();
  if (n == 1) {
    out->push_back(Piece{files_[0].get(), offset, offset, length});
    return;
  }
  while (length > 0) {
    const uint64_t stripe = offset / stripe_unit_;
    const uint64_t within = offset % stripe_unit_;
    const uint64_t take = std::min(length, stripe_unit_ - within);
    const uint64_t file_offset = (stripe / n) * stripe_unit_ + within;
    out->push_back(Piece{files_[stripe % n].get(), file_offset, offset, take});
    offset += take;
    length -= take;
  }
}

uint64_t FileSet::PerFileBytes(uint64_t logical_bytes) const {
  const uint64_t n = files_.size();
  if (n == 1) return logical_bytes;
  const uint64_t stripes = (logical_bytes + stripe_unit_ - 1) / stripe_unit_;
  return ((stripes + n - 1) / n) * stripe_unit_;
}

std::string FileSet::Describe() const {
  if (files_.size() == 1) return files_[0]->path();
  std::string out;
  for (const auto& file : files_) {
    if (!out.empty()) out += "+";
    out += file->path();
  }
  return fmt::format("{} (stripe {} B)", out, stripe_unit_);
}

}  // namespace zoe::io
