#include "rolloutcore/formats/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "testing/temp_dir.h"

namespace rc::formats {
namespace {

std::vector<uint8_t> File(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> f(8 + header.size() + data_bytes, 0);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

Result<SafetensorsHeader> Parse(const std::string& header, size_t data_bytes) {
  auto f = File(header, data_bytes);
  return ParseSafetensorsHeader(f, f.size());
}

TEST(SafetensorsTest, ParsesValidHeader) {
  auto h = Parse(R"({"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
                 R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"__metadata__":{"format":"pt"}})",
                 28);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->Find("b")->dtype, DType::kBF16);
  EXPECT_EQ(h->metadata.at("format"), "pt");
}

TEST(SafetensorsTest, RejectsHostileHeaders) {
  struct Case {
    std::string header;
    size_t data;
    std::string expect;
  } cases[] = {
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", 16, "need 16 bytes"},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8, "outside"},
      {R"({"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}})", 16, "unknown safetensors dtype"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,16]}})", 16, "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", 16, "overflow"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 16, "overlap"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 16, "end before they begin"},
      // The tensors must tile the data section, as the reference implementation requires.
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12, "4 bytes after the last tensor"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "4 bytes of the data section before tensor 'a'"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12,
       "before tensor 'b' (offset 4)"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", 16, "data_offsets"},
      {R"([1,2])", 0, "expected a JSON object"},
      {R"({"a":)", 0, "malformed"},
      {R"({"a":{"dtype":"F32","shape":"x","data_offsets":[0,8]}})", 8, "shape"},
  };
  for (const auto& c : cases) {
    auto h = Parse(c.header, c.data);
    ASSERT_FALSE(h.ok()) << c.header;
    EXPECT_NE(h.status().message().find(c.expect), std::string::npos) << h.status().message();
  }
  // Header length beyond the file.
  std::vector<uint8_t> f = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
  EXPECT_FALSE(ParseSafetensorsHeader(f, f.size()).ok());
  std::vector<uint8_t> g = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  EXPECT_FALSE(ParseSafetensorsHeader(g, g.size()).ok());
  EXPECT_FALSE(ParseSafetensorsHeader(std::span<const uint8_t>(g.data(), 3), 3).ok());
}

TEST(SafetensorsTest, WriteThenReadRoundTrips) {
  const rc::testing::TempDir scratch("rc_st_roundtrip_");
  const std::string& dir = scratch.path();
  std::vector<float> a = {1.f, -2.f, 3.5f, 0.25f};
  std::vector<uint16_t> b = {F32ToBF16(1.f), F32ToBF16(-0.5f)};
  ASSERT_TRUE(WriteSafetensors(dir + "/m.safetensors",
                               {{"x.a", DType::kF32, {2, 2}, {reinterpret_cast<uint8_t*>(a.data()), 16}},
                                {"x.b", DType::kBF16, {2}, {reinterpret_cast<uint8_t*>(b.data()), 4}}})
                  .ok());
  auto folder = SafetensorsFolder::Open(dir);
  ASSERT_TRUE(folder.ok()) << folder.status().ToString();
  auto la = (*folder)->Find("x.a");
  ASSERT_TRUE(la.ok());
  std::vector<float> out(4);
  ASSERT_TRUE(ConvertToF32(la->entry->dtype, la->bytes.data(), 4, out.data()).ok());
  EXPECT_EQ(out, a);
  auto lb = (*folder)->Find("x.b");
  ASSERT_TRUE(lb.ok());
  ASSERT_TRUE(ConvertToF32(DType::kBF16, lb->bytes.data(), 2, out.data()).ok());
  EXPECT_EQ(out[1], -0.5f);
  auto missing = (*folder)->Find("x.c");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("x.c"), std::string::npos);
}

TEST(SafetensorsTest, HalfConversions) {
  for (float f : {0.f, 1.f, -2.5f, 65504.f, 6.1035156e-05f, 5.9604645e-08f}) {
    EXPECT_EQ(F16ToF32(F32ToF16(f)), f) << f;
  }
  EXPECT_EQ(BF16ToF32(F32ToBF16(1.00390625f)), 1.0f);  // ties to even
  EXPECT_EQ(BF16ToF32(F32ToBF16(-3.0f)), -3.0f);
}

}  // namespace
}  // namespace rc::formats
