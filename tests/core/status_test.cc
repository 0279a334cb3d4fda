// Description: Status and Result: codes, errno mapping, context, copies and the helper macros.
#include "core/status.h"

#include <gtest/gtest.h>

#include <cerrno>

#include "core/result.h"

namespace zoe {
namespace {

TEST(Status, DefaultIsOkAndCheap) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(s.message().empty());
}

TEST(Status, FromErrnoMapsCodesAndKeepsErrno) {
  Status s = Status::FromErrno(-ENOSPC, "write /x at offset 4096");
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_EQ(s.message(), "write /x at offset 4096: No space left on device");
  EXPECT_EQ(Status::FromErrno(EIO, "r").code(), StatusCode::kIoError);
  EXPECT_EQ(Status::FromErrno(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_EQ(Status::FromErrno(EROFS, "open").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Status::FromErrno(EFBIG, "w").code(), StatusCode::kNoSpace);
}

TEST(Status, ContextIsPrependedOnErrorsOnly) {
  Status s = Status::IoError("read failed", EIO).WithContext("tensor 'w3'");
  EXPECT_EQ(s.ToString(), "IO error: tensor 'w3': read failed");
  Status ok = Status::Ok().WithContext("ignored");
  EXPECT_TRUE(ok.ok());
}

TEST(Status, CopiesAreIndependent) {
  Status a = Status::Corruption("bad block");
  Status b = a;
  b.WithContext("extent 7");
  EXPECT_EQ(a.message(), "bad block");
  EXPECT_EQ(b.message(), "extent 7: bad block");
}

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  ZOE_ASSIGN_OR_RETURN(int half, Half(x));
  ZOE_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

TEST(Result, PropagatesValueOrStatus) {
  auto ok = Quarter(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 2);
  auto bad = Quarter(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "odd: 3");
}

TEST(Result, OkStatusWithoutValueIsAnInternalError) {
  Result<int> r{Status::Ok()};
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

Status FailsSecond(bool fail) {
  ZOE_RETURN_IF_ERROR(Status::Ok());
  ZOE_RETURN_IF_ERROR(fail ? Status::Busy("all pinned") : Status::Ok());
  return Status::Ok();
}

TEST(Status, ReturnIfErrorStopsAtFirstError) {
  EXPECT_TRUE(FailsSecond(false).ok());
  EXPECT_EQ(FailsSecond(true).code(), StatusCode::kBusy);
}

}  // namespace
}  // namespace zoe
