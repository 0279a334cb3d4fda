// The cached tiers (HOST and DEVICE) behind one interface, so that the tier manager moves a copy
// of a run the same way whichever tier holds it. Modelled on ggml-backend's buffer interface.
//
// Contract:
//  - A tier backend allocates and frees the memory of copies, and moves bytes between a copy and
//    the tier below it: HOST reads and writes the run's extent of NVMe swap through the I/O
//    queue; DEVICE copies to and from the run's HOST copy on its device queue.
//  - CopyIn and CopyOut return at once with a Transfer. Exactly one caller collects a Transfer,
//    by Wait (blocks) or by a Poll that returns its status (Poll returns nullopt while it runs).
//  - Memory freed with Free is kept for the next Allocate of the same size (page-locking host
//    memory or allocating device memory costs far more than an acquire's bookkeeping); the spares
//    are given up when the pool or the device refuses a new allocation.
//  - Not thread-safe: the tier manager calls it under its mutex, except Wait (any thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <variant>
#include <vector>

#include "core/device.h"
#include "core/pinned_memory.h"
#include "core/result.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "offload/types.h"

namespace zoe::offload {

// The tier manager's waits for device copies, named so that a test can leave each out
// (TierManagerOptions::skipped_device_waits_for_testing) and show a test failing without it.
enum class DeviceWait : uint8_t {
  kDemandCopy = 1,    // a copy an acquire (or eviction) needs, to or from the device
  kPrefetchCopy = 2,  // a prefetch's copy to the device, applied when found finished
};

// The memory of one copy: pinned host memory or device memory. Move-only.
class TierMemory {
 public:
  TierMemory() = default;
  explicit TierMemory(PinnedBuffer host) : memory_(std::move(host)) {}
  explicit TierMemory(DeviceAllocation device) : memory_(std::move(device)) {}

  std::byte* data();  // a device address for device memory
  bool empty() const;
  // The first `bytes` of host memory (empty for device memory).
  std::span<std::byte> host_span(uint64_t bytes);
  const DeviceAllocation* device() const { return std::get_if<DeviceAllocation>(&memory_); }

 private:
  std::variant<std::monostate, PinnedBuffer, DeviceAllocation> memory_;
};

// A transfer in flight: an I/O ticket or a device copy's event.
using Transfer = std::variant<std::monostate, io::Ticket, DeviceEvent>;

// Where the bytes below a copy are: the run's swap offset (below HOST) and its HOST copy (below
// DEVICE).
struct LowerCopy {
  uint64_t nvme_offset = 0;
  std::span<std::byte> host;
};

class TierBackend {
 public:
  virtual ~TierBackend() = default;
  virtual Tier tier() const = 0;

  Result<TierMemory> Allocate(uint64_t bytes);
  void Free(uint64_t bytes, TierMemory memory);
  // Copies the run's `bytes` from the tier below into `memory`, or from `memory` down.
  virtual Result<Transfer> CopyIn(const LowerCopy& from, TierMemory& memory, uint64_t bytes) = 0;
  virtual Result<Transfer> CopyOut(TierMemory& memory, const LowerCopy& to, uint64_t bytes) = 0;
  virtual std::optional<Status> Poll(const Transfer& transfer) = 0;
  virtual Status Wait(const Transfer& transfer) = 0;

 protected:
  virtual Result<TierMemory> AllocateNew(uint64_t bytes) = 0;

 private:
  std::vector<std::pair<uint64_t, TierMemory>> spares_;
};

// HOST: pinned memory from the pool; transfers read and write the swap space.
std::unique_ptr<TierBackend> MakeHostTier(PinnedMemoryPool pool, io::IoQueue& io,
                                          const io::FileSet& swap_files);
// DEVICE: device memory; transfers are copies on `queue`. `skipped_waits`: DeviceWait bits whose
// waits are left out (tests only).
std::unique_ptr<TierBackend> MakeDeviceTier(DeviceBackend& device, DeviceQueue& queue,
                                            uint8_t skipped_waits);

}  // namespace zoe::offload
