// Description: the NCCL collectives' refusals on a machine without a usable NCCL: a NULL
// communicator, and (built with nccl.h) a libnccl.so.2 that cannot be loaded, named with the
// setting that points zoe at it. The collectives themselves run on a GPU
// (integrations/python/tests/test_nccl_cuda.py through scripts/gpu-check.sh).
#include "offload/distributed/nccl_collectives.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace zoe::offload {
namespace {

TEST(NcclCollectives, ANullCommunicatorIsRefused) {
  auto made = MakeNcclCollectives(nullptr, nullptr);
  ASSERT_FALSE(made.ok());
#if defined(ZOE_HAVE_NCCL) && defined(ZOE_HAVE_CUDA)
  EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
#else
  EXPECT_EQ(made.status().code(), StatusCode::kNotSupported);
#endif
}

// NCCL is loaded once per process, on first use: this test is the first in its process (ctest
// runs each test alone), so the setting it makes is the one the loader reads.
TEST(NcclCollectives, ALibraryThatCannotBeLoadedIsNamedWithTheSettingToChange) {
  ASSERT_EQ(setenv("ZOE_NCCL_LIBRARY", "/nonexistent/zoe-test/libnccl.so.2", 1), 0);
  int not_a_communicator = 0;
  auto made = MakeNcclCollectives(&not_a_communicator, nullptr);
  unsetenv("ZOE_NCCL_LIBRARY");
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::kNotSupported);
#if defined(ZOE_HAVE_NCCL) && defined(ZOE_HAVE_CUDA)
  const std::string message = made.status().ToString();
  EXPECT_NE(message.find("/nonexistent/zoe-test/libnccl.so.2"), std::string::npos) << message;
  EXPECT_NE(message.find("ZOE_NCCL_LIBRARY"), std::string::npos) << message;
#endif
}

}  // namespace
}  // namespace zoe::offload
