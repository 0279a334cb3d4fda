// Description: a whole engine gives back what it took from the process: after zoe_engine_destroy
// of an engine with tensors and optimizer state on NVMe that stepped, wrote and read tensors, and
// saved and loaded traces and checkpoints, /proc/self/fd is as it was before zoe_engine_create, no
// descriptor is left on a swap file (removed or not), and the swap directory is empty.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <vector>

#include "capi/capi_trainer.h"
#include "io/process_fds.h"
#include "offload/temp_dir.h"

namespace zoe::capi_testing {
namespace {

using zoe::testing::FdChanges;
using zoe::testing::LinksIntoOrDeleted;
using zoe::testing::OpenFds;

// A traced iteration over the tensors, saved to `path` and loaded back.
std::string TraceRoundTrip(Trainer& trainer, const std::string& path) {
  std::string out = Failed(zoe_trace_begin(trainer.engine(), "it"), "trace begin");
  out += trainer.CheckTensors(0);
  out += Failed(zoe_trace_end(trainer.engine()), "trace end");
  out += Failed(zoe_trace_save(trainer.engine(), "it", path.c_str()), "trace save");
  return out + Failed(zoe_trace_load(trainer.engine(), path.c_str(), nullptr), "trace load");
}

// Steps, tensor traffic, a trace saved and loaded, two checkpoint saves and a load in between:
// every path that opens files.
std::string Train(Trainer& trainer, const std::string& dir) {
  const std::string checkpoint = dir + "/checkpoint";
  // One call per statement: the operands of + run in no set order.
  std::string out = trainer.Step(0);
  out += trainer.WriteTensors(0);
  out += trainer.CheckTensors(0);
  out += TraceRoundTrip(trainer, dir + "/it.trace");
  out += Failed(zoe_checkpoint_save(trainer.engine(), checkpoint.c_str()), "checkpoint save");
  out += trainer.Step(1);
  out += Failed(zoe_checkpoint_load(trainer.engine(), checkpoint.c_str()), "checkpoint load");
  out += Failed(zoe_checkpoint_save(trainer.engine(), checkpoint.c_str()), "second save");
  out += trainer.Step(2);
  out += trainer.WriteTensors(1);
  return out + trainer.CheckTensors(1);
}

bool IsEmptyDirectory(const std::string& dir) {
  std::error_code ignored;
  return std::filesystem::is_empty(dir, ignored);
}

TEST(CapiDescriptorsTest, EngineOnNvmeGivesBackEveryDescriptor) {
  ASSERT_EQ(zoe::testing::EnsureStdinOpen(), "");
  offload::testing::TempDir dir;
  const std::string nvme = dir.File("nvme");
  const zoe::testing::FdTable before = OpenFds();
  for (int round = 0; round < 2; ++round) {
    Trainer trainer(nvme);
    ASSERT_EQ(trainer.error(), "");
    ASSERT_EQ(Train(trainer, std::filesystem::path(nvme).parent_path()), "");
    // While the engine lives its swap files are open: the check below can see them.
    EXPECT_FALSE(LinksIntoOrDeleted(OpenFds(), nvme).empty());
  }
  const zoe::testing::FdTable after = OpenFds();
  EXPECT_EQ(FdChanges(before, after), "");
  EXPECT_EQ(LinksIntoOrDeleted(after, nvme), std::vector<std::string>{});
  EXPECT_TRUE(IsEmptyDirectory(nvme));
  struct stat st {};
  EXPECT_EQ(::fstat(0, &st), 0);
}

// The engine of an empty configuration swaps into a private directory it removes: nothing of it,
// deleted or not, stays open.
TEST(CapiDescriptorsTest, DefaultEngineHoldsNoDeletedFileAfterDestroy) {
  const zoe::testing::FdTable before = OpenFds();
  zoe_engine* engine = nullptr;
  ASSERT_EQ(zoe_engine_create(
                R"({"zoe": {"device": "host", "chunk_size": "64K", "tensor_swap_bytes": "4M"}})",
                &engine),
            ZOE_OK)
      << zoe_last_error();
  zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
  desc.name = "w";
  desc.bytes = kTensorBytes;
  zoe_tensor_id id = ZOE_TENSOR_ID_INVALID;
  void* ptr = nullptr;
  EXPECT_EQ(zoe_tensor_register(engine, &desc, &id), ZOE_OK) << zoe_last_error();
  EXPECT_EQ(zoe_tensor_acquire(engine, id, ZOE_TIER_HOST, ZOE_ACCESS_WRITE, &ptr), ZOE_OK);
  EXPECT_EQ(zoe_tensor_release(engine, id), ZOE_OK);
  EXPECT_EQ(zoe_tensor_evict(engine, id), ZOE_OK) << zoe_last_error();
  zoe_engine_destroy(engine);
  const zoe::testing::FdTable after = OpenFds();
  EXPECT_EQ(FdChanges(before, after), "");
  EXPECT_EQ(LinksIntoOrDeleted(after, "/nonexistent"), LinksIntoOrDeleted(before, "/nonexistent"));
}

}  // namespace
}  // namespace zoe::capi_testing
