#include "rolloutcore/base/json.h"

#include <gtest/gtest.h>

namespace rc {
namespace {

TEST(JsonTest, ParseErrorsNameTheInput) {
  auto r = ParseJson("{\"a\": ", "scenario.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("scenario.json is malformed"), std::string::npos);
}

TEST(JsonTest, NumberOverflowIsAnErrorNotAnException) {
  // Found by the scenario fuzzer: nlohmann throws out_of_range even with allow_exceptions=false.
  auto r = ParseJson("333e3333333333333", "body");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("body is malformed"), std::string::npos);
  EXPECT_FALSE(ParseJson("[1, 2e999]").ok());
}

TEST(JsonTest, TypedAccessorsNameTheField) {
  Json j = ParseJson(R"({"n": 3, "neg": -2, "s": "x", "b": true, "d": 1.5, "o": {}})").value();
  EXPECT_EQ(GetInt(j, "n", "root").value(), 3);
  EXPECT_EQ(GetString(j, "s", "root").value(), "x");
  EXPECT_TRUE(GetBool(j, "b", "root").value());
  EXPECT_DOUBLE_EQ(GetDouble(j, "d", "root").value(), 1.5);
  EXPECT_DOUBLE_EQ(GetDouble(j, "n", "root").value(), 3.0);
  EXPECT_TRUE(GetObject(j, "o", "root").ok());

  auto wrong = GetInt(j, "s", "root");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().message(), "root.s: expected an integer, got string");
  auto neg = GetNonNegativeInt(j, "neg", "events[2]");
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().message(), "events[2].neg: expected a non-negative integer, got -2");
  auto missing = GetString(j, "nope", "");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "nope: required field is missing");
  EXPECT_EQ(GetString(j, "nope", "", std::string("dflt")).value(), "dflt");
}

TEST(JsonTest, UnknownKeysAreRejected) {
  Json j = ParseJson(R"({"at_ms": 1, "admitt": "r1"})").value();
  Status s = CheckKnownKeys(j, {"at_ms", "admit"}, "events[0]");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "events[0].admitt: unknown field");
  EXPECT_TRUE(CheckKnownKeys(j, {"at_ms", "admitt"}, "events[0]").ok());
}

TEST(JsonTest, MissingFileIsNotFound) {
  EXPECT_EQ(ReadJsonFile("/nonexistent/x.json").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rc
