// Description: memory for I/O buffers: alignment, huge-page advice on large buffers, and release.
#include "core/io_memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "core/aligned_buffer.h"
#include "core/pinned_memory.h"

namespace zoe {
namespace {

// The VmFlags line of the /proc/self/smaps entry whose range contains `address`, or "" when no
// mapping does.
std::string VmFlagsOf(const void* address) {
  const uintptr_t target = reinterpret_cast<uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = target >= begin && target < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// Kernels built without transparent huge pages refuse the advice; the flag cannot show there.
bool KernelHasTransparentHugePages() {
  return std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good();
}

bool HasFlag(const std::string& vm_flags, const std::string& flag) {
  return vm_flags.find(" " + flag) != std::string::npos;
}

TEST(IoMemoryTest, LargeBuffersAreHugePageAlignedAndAdvised) {
  const size_t bytes = 3 * kHugePageBytes + 4096;
  void* data = AllocateIoMemory(bytes, 4096);
  ASSERT_NE(data, nullptr);
  EXPECT_TRUE(IsAligned(data, kHugePageBytes));
  std::memset(data, 0x5a, bytes);  // the whole length is mapped and writable
  EXPECT_EQ(static_cast<unsigned char*>(data)[bytes - 1], 0x5a);
  const std::string flags = VmFlagsOf(data);
  ASSERT_FALSE(flags.empty());
  if (KernelHasTransparentHugePages()) {
    EXPECT_TRUE(HasFlag(flags, "hg")) << flags;
  }
  FreeIoMemory(data, bytes);
  EXPECT_EQ(VmFlagsOf(data), "");  // unmapped, head and tail included
}

TEST(IoMemoryTest, LargerAlignmentsThanAHugePageAreHonoured) {
  const size_t alignment = 4 * kHugePageBytes;
  void* data = AllocateIoMemory(kHugePageBytes, alignment);
  ASSERT_NE(data, nullptr);
  EXPECT_TRUE(IsAligned(data, alignment));
  FreeIoMemory(data, kHugePageBytes);
}

TEST(IoMemoryTest, SizesThatOverflowTheReservationAreRefused) {
  EXPECT_EQ(AllocateIoMemory(std::numeric_limits<size_t>::max() - 4096, 4096), nullptr);
  EXPECT_EQ(AllocateIoMemory(std::numeric_limits<size_t>::max() - kHugePageBytes, kHugePageBytes),
            nullptr);
}

TEST(IoMemoryTest, SmallBuffersUseTheRequestedAlignment) {
  void* data = AllocateIoMemory(100, 64);
  ASSERT_NE(data, nullptr);
  EXPECT_TRUE(IsAligned(data, 64));
  std::memset(data, 1, 100);
  FreeIoMemory(data, 100);
  FreeIoMemory(nullptr, 100);  // ignored
}

TEST(IoMemoryTest, AlignedAndPinnedBuffersOfHugePageSizeUseHugePageMemory) {
  Result<AlignedBuffer> aligned = AlignedBuffer::Allocate(kHugePageBytes, 4096);
  ASSERT_TRUE(aligned.ok()) << aligned.status().ToString();
  EXPECT_TRUE(IsAligned(aligned->data(), kHugePageBytes));
  const bool thp = KernelHasTransparentHugePages();
  if (thp) {
    EXPECT_TRUE(HasFlag(VmFlagsOf(aligned->data()), "hg"));
  }

  PinnedPoolOptions options;
  options.name = "io-memory-test";
  options.budget_bytes = 4 * kHugePageBytes;
  Result<PinnedMemoryPool> pool = PinnedMemoryPool::Create(std::move(options));
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  Result<PinnedBuffer> pinned = pool->Allocate(2 * kHugePageBytes);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  EXPECT_TRUE(IsAligned(pinned->data(), kHugePageBytes));
  if (thp) {
    EXPECT_TRUE(HasFlag(VmFlagsOf(pinned->data()), "hg"));
  }
  std::memset(pinned->data(), 7, pinned->size());
}

}  // namespace
}  // namespace zoe
