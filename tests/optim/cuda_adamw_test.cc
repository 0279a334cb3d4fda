// Description: the CUDA AdamW kernel gives the CPU kernels' exact bytes in every dtype layout
// (runs only where a GPU exists), and a build or machine without one reports NotSupported.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "optim/chunk.h"
#include "optim/cuda/adamw.h"
#include "optim_test_util.h"
#if defined(ZOE_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace zoe::optim {
namespace {

TEST(CudaAdamW, ChecksArgumentsBeforeTouchingTheDevice) {
  const ChunkLayout layout;
  EXPECT_EQ(cuda::LaunchAdamW({.kind = Kind::kAdam}, 1, layout, {}, {}, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::LaunchAdamW({.lr = -1}, 1, layout, {}, {}, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::LaunchAdamW({}, 0, layout, {}, {}, nullptr).code(), StatusCode::kInvalidArgument);
  // No int8 block kernel on the device, and no dtype the kernels do not take.
  const Status int8_state =
      cuda::LaunchAdamW({}, 1, {DType::kFloat32, DType::kInt8, std::nullopt}, {}, {}, nullptr);
  EXPECT_EQ(int8_state.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(int8_state.message().find("CUDA AdamW state dtype = int8 is not an element type the "
                                      "optimizer takes; allowed: fp32, bf16"),
            std::string_view::npos)
      << int8_state.ToString();
  const Status fp64_grad =
      cuda::LaunchAdamW({}, 1, {DType::kFloat64, DType::kFloat32, std::nullopt}, {}, {}, nullptr);
  EXPECT_NE(fp64_grad.message().find("gradient dtype = fp64"), std::string_view::npos)
      << fp64_grad.ToString();
#if !defined(ZOE_HAVE_CUDA)
  EXPECT_EQ(cuda::LaunchAdamW({}, 1, layout, {}, {}, nullptr).code(), StatusCode::kNotSupported);
  EXPECT_FALSE(cuda::DeviceAvailable());
#endif
}

#if defined(ZOE_HAVE_CUDA)
// Device copies of a TestChunk's buffers.
struct DeviceChunk {
  explicit DeviceChunk(testing::TestChunk& host) : host_(host) {
    const size_t n = host.count;
    sizes_ = {4 * n, DTypeSize(host.layout.grad) * n, DTypeSize(host.layout.state) * n,
              DTypeSize(host.layout.state) * n, host.CopyBytes() * n};
    std::byte* sources[] = {host.master.data(), host.grad.data(), host.exp_avg.data(),
                            host.exp_avg_sq.data(), host.copy.data()};
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(cudaMalloc(&device_[i], sizes_[i] + 1), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(device_[i], sources[i], sizes_[i], cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceChunk() {
    for (void* p : device_) cudaFree(p);
  }
  ChunkBuffers buffers() const {
    return {static_cast<float*>(device_[0]),
            device_[1],
            device_[2],
            device_[3],
            host_.layout.param_copy ? device_[4] : nullptr,
            host_.count};
  }
  void CopyBack() {
    std::byte* targets[] = {host_.master.data(), host_.grad.data(), host_.exp_avg.data(),
                            host_.exp_avg_sq.data(), host_.copy.data()};
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(cudaMemcpy(targets[i], device_[i], sizes_[i], cudaMemcpyDeviceToHost), cudaSuccess);
    }
  }

  testing::TestChunk& host_;
  std::vector<size_t> sizes_;
  void* device_[5] = {};
};
#endif

TEST(CudaAdamW, MatchesTheCpuKernelsBitForBit) {
  if (!cuda::DeviceAvailable()) GTEST_SKIP() << "no CUDA device (or built without CUDA)";
#if defined(ZOE_HAVE_CUDA)
  for (const ChunkLayout& layout : testing::AllLayouts()) {
    const size_t n = 100003;
    testing::TestChunk cpu(layout, n, 21);
    testing::TestChunk gpu(layout, n, 21);
    DeviceChunk device(gpu);
    HyperParams hyper = testing::DefaultHyper(Kind::kAdamW);
    for (int step = 1; step <= 3; ++step) {
      hyper.lr *= 0.5;
      ASSERT_TRUE(UpdateChunk(hyper, step, layout, cpu.buffers(), {0.5, 0.9}).ok());
      ASSERT_TRUE(
          cuda::LaunchAdamW(hyper, step, layout, device.buffers(), {0.5, 0.9}, nullptr).ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    device.CopyBack();
    EXPECT_TRUE(gpu.StateBytes() == cpu.StateBytes())
        << DTypeName(layout.grad) << "/" << DTypeName(layout.state);
  }
#endif
}

}  // namespace
}  // namespace zoe::optim
