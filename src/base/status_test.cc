#include "rolloutcore/base/status.h"

#include <gtest/gtest.h>

namespace rc {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("x=" + std::to_string(x) + " is odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  RC_ASSIGN_OR_RETURN(int h, Half(x));
  RC_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckPositive(int x) {
  if (x <= 0) return FailedPrecondition("not positive");
  return OkStatus();
}

Status Chain(int x) {
  RC_RETURN_IF_ERROR(CheckPositive(x));
  RC_RETURN_IF_ERROR(Half(x));
  return OkStatus();
}

TEST(StatusTest, OkAndErrors) {
  EXPECT_TRUE(OkStatus().ok());
  EXPECT_EQ(OkStatus().ToString(), "OK");
  Status s = DeadlineExceeded("install took 1200 ms");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.ToString(), "DeadlineExceeded: install took 1200 ms");
  EXPECT_EQ(s.WithContext("update 3").message(), "update 3: install took 1200 ms");
}

TEST(StatusTest, CodeNamesRoundTrip) {
  for (int i = 0; i <= static_cast<int>(StatusCode::kPermissionDenied); ++i) {
    auto code = static_cast<StatusCode>(i);
    auto back = StatusCodeFromName(StatusCodeName(code));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, code);
  }
  EXPECT_FALSE(StatusCodeFromName("Bogus").has_value());
}

TEST(ResultTest, ValueAndPropagation) {
  EXPECT_EQ(Quarter(8).value(), 2);
  auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "x=3 is odd");
  EXPECT_EQ(Chain(-1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Chain(3).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Chain(4).ok());
}

TEST(ResultTest, OkStatusWithoutValueIsInternal) {
  Result<int> r{OkStatus()};
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace rc
