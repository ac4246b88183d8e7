#include "rolloutcore/base/encoding.h"

#include <gtest/gtest.h>

#include <string>

namespace rc {
namespace {

TEST(EncodingTest, HexRoundTripsEveryByteValue) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::string hex = HexEncode(all);
  ASSERT_EQ(hex.size(), 512u);
  EXPECT_EQ(hex.substr(0, 6), "000102");
  EXPECT_EQ(hex.substr(506), "fdfeff");
  auto back = HexDecode(hex);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, all);
  auto upper = HexDecode("ABcd");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(*upper, "\xab\xcd");
}

TEST(EncodingTest, HexDecodeNamesTheBadDigitAndItsOffset) {
  auto bad = HexDecode("00zz");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("0x7a at offset 2"), std::string::npos) << bad.status().message();
  auto odd = HexDecode("abc");
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("odd length 3"), std::string::npos) << odd.status().message();
}

TEST(EncodingTest, HexDecodeIntoWantsExactlyTwoDigitsPerByte) {
  unsigned char out[2] = {0, 0};
  EXPECT_TRUE(HexDecodeInto("a0ff", out, 2));
  EXPECT_EQ(out[0], 0xa0);
  EXPECT_EQ(out[1], 0xff);
  EXPECT_FALSE(HexDecodeInto("a0f", out, 2));
  EXPECT_FALSE(HexDecodeInto("a0ff00", out, 2));
  EXPECT_FALSE(HexDecodeInto("a0fg", out, 2));
}

TEST(EncodingTest, Hex64IsSixteenLowercaseDigitsAndParsesBack) {
  EXPECT_EQ(Hex64(0), "0000000000000000");
  EXPECT_EQ(Hex64(0xDEADBEEFull), "00000000deadbeef");
  EXPECT_EQ(Hex64(~0ull), "ffffffffffffffff");
  auto v = ParseHex64("0123456789abcdef");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 0x0123456789abcdefull);
  EXPECT_FALSE(ParseHex64("123").ok());
  EXPECT_FALSE(ParseHex64("0123456789abcdeg").ok());
  EXPECT_FALSE(ParseHex64("0123456789abcdef0").ok());
}

TEST(EncodingTest, Base64MatchesRfc4648Vectors) {
  // RFC 4648 section 10.
  const std::pair<const char*, const char*> vectors[] = {{"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},
                                                         {"foo", "Zm9v"},  {"foob", "Zm9vYg=="},  {"fooba", "Zm9vYmE="},
                                                         {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, encoded] : vectors) {
    EXPECT_EQ(Base64Encode(plain), encoded) << plain;
    auto back = Base64Decode(encoded);
    ASSERT_TRUE(back.ok()) << encoded;
    EXPECT_EQ(*back, plain);
  }
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(Base64Decode(Base64Encode(all)).value(), all);
  // URL-safe alphabet: 0xfb 0xff -> "+/8=" standard, "-_8=" URL-safe.
  EXPECT_EQ(Base64Encode("\xfb\xff"), "+/8=");
  EXPECT_EQ(Base64Decode("-_8=").value(), "\xfb\xff");
}

TEST(EncodingTest, Base64DecodeNamesTheBadCharacterAndItsOffset) {
  auto bad = Base64Decode("Zm9v!");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("0x21 at offset 4"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace rc
