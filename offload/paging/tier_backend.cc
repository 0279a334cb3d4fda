#include "offload/paging/tier_backend.h"

#include <utility>

namespace zoe::offload {

std::byte* TierMemory::data() {
  if (auto* host = std::get_if<PinnedBuffer>(&memory_)) return host->data();
  if (auto* device = std::get_if<DeviceAllocation>(&memory_))
    return static_cast<std::byte*>(device->data());
  return nullptr;
}

bool TierMemory::empty() const {
  if (auto* host = std::get_if<PinnedBuffer>(&memory_)) return host->empty();
  if (auto* device = std::get_if<DeviceAllocation>(&memory_)) return device->empty();
  return true;
}

std::span<std::byte> TierMemory::host_span(uint64_t bytes) {
  auto* host = std::get_if<PinnedBuffer>(&memory_);
  return host ? host->span().first(bytes) : std::span<std::byte>();
}

Result<TierMemory> TierBackend::Allocate(uint64_t bytes) {
  for (auto it = spares_.begin(); it != spares_.end(); ++it) {
    if (it->first != bytes) continue;
    TierMemory memory = std::move(it->second);
    spares_.erase(it);
    return memory;
  }
  Result<TierMemory> memory = AllocateNew(bytes);
  if (memory.ok() || spares_.empty()) return memory;
  spares_.clear();  // spares of other sizes hold the pool's budget or the device's capacity
  return AllocateNew(bytes);
}

void TierBackend::Free(uint64_t bytes, TierMemory memory) {
  if (!memory.empty()) spares_.emplace_back(bytes, std::move(memory));
}

namespace {

class HostTier final : public TierBackend {
 public:
  HostTier(PinnedMemoryPool pool, io::IoQueue& io, const io::FileSet& files)
      : pool_(std::move(pool)), io_(io), files_(files) {}

  Tier tier() const override { return Tier::kHost; }

  Result<Transfer> CopyIn(const LowerCopy& from, TierMemory& memory, uint64_t bytes) override {
    return Submit(io::Op::kRead, from.nvme_offset, memory.host_span(bytes));
  }
  Result<Transfer> CopyOut(TierMemory& memory, const LowerCopy& to, uint64_t bytes) override {
    return Submit(io::Op::kWrite, to.nvme_offset, memory.host_span(bytes));
  }
  std::optional<Status> Poll(const Transfer& transfer) override {
    return io_.Poll(std::get<io::Ticket>(transfer));
  }
  Status Wait(const Transfer& transfer) override {
    return io_.Wait(std::get<io::Ticket>(transfer));
  }

 protected:
  Result<TierMemory> AllocateNew(uint64_t bytes) override {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, pool_.Allocate(bytes));
    return TierMemory(std::move(buffer));
  }

 private:
  Result<Transfer> Submit(io::Op op, uint64_t offset, std::span<std::byte> bytes) {
    ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, io_.Submit(io::IoRequest{op, &files_, offset, bytes}));
    return Transfer(ticket);
  }

  PinnedMemoryPool pool_;
  io::IoQueue& io_;
  const io::FileSet& files_;
};

class DeviceTier final : public TierBackend {
 public:
  DeviceTier(DeviceBackend& device, DeviceQueue& queue, uint8_t skipped_waits)
      : device_(device), queue_(queue), skipped_waits_(skipped_waits) {}

  Tier tier() const override { return Tier::kDevice; }

  Result<Transfer> CopyIn(const LowerCopy& from, TierMemory& memory, uint64_t bytes) override {
    ZOE_ASSIGN_OR_RETURN(DeviceEvent event, queue_.CopyToDevice(from.host.first(bytes),
                                                                DeviceRange{memory.device(), 0}));
    return Transfer(std::move(event));
  }
  Result<Transfer> CopyOut(TierMemory& memory, const LowerCopy& to, uint64_t bytes) override {
    ZOE_ASSIGN_OR_RETURN(DeviceEvent event,
                         queue_.CopyToHost(DeviceRange{memory.device(), 0}, to.host.first(bytes)));
    return Transfer(std::move(event));
  }
  // A prefetch's copy is applied once found finished (or at once when that wait is left out).
  std::optional<Status> Poll(const Transfer& transfer) override {
    if (Skips(DeviceWait::kPrefetchCopy)) return Status::Ok();
    const DeviceEvent& event = std::get<DeviceEvent>(transfer);
    if (!event.Ready()) return std::nullopt;
    return event.Wait();
  }
  Status Wait(const Transfer& transfer) override {
    if (Skips(DeviceWait::kDemandCopy)) return Status::Ok();
    return std::get<DeviceEvent>(transfer).Wait();
  }

 protected:
  Result<TierMemory> AllocateNew(uint64_t bytes) override {
    ZOE_ASSIGN_OR_RETURN(DeviceAllocation allocation, device_.Allocate(bytes));
    return TierMemory(std::move(allocation));
  }

 private:
  bool Skips(DeviceWait wait) const { return (skipped_waits_ & static_cast<uint8_t>(wait)) != 0; }

  DeviceBackend& device_;
  DeviceQueue& queue_;
  const uint8_t skipped_waits_;
};

}  // namespace

std::unique_ptr<TierBackend> MakeHostTier(PinnedMemoryPool pool, io::IoQueue& io,
                                          const io::FileSet& swap_files) {
  return std::make_unique<HostTier>(std::move(pool), io, swap_files);
}

std::unique_ptr<TierBackend> MakeDeviceTier(DeviceBackend& device, DeviceQueue& queue,
                                            uint8_t skipped_waits) {
  return std::make_unique<DeviceTier>(device, queue, skipped_waits);
}

}  // namespace zoe::offload
