#include "rolloutcore/base/content_digest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace rc {
namespace {

using ::testing::HasSubstr;

TEST(ContentDigestTest, OneTextFormRoundTrips) {
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{0x914e882bf19596c1}, ~uint64_t{0}}) {
    const ContentDigest d(v);
    const std::string hex = d.ToHex();
    EXPECT_EQ(hex.size(), 16u);
    auto back = ContentDigest::FromHex(hex, "digest");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, d);
    EXPECT_EQ(back->value(), v);
  }
  EXPECT_EQ(ContentDigest(0x914e882bf19596c1).ToHex(), "914e882bf19596c1");
  EXPECT_EQ(ContentDigest().ToHex(), kZeroDigestHex);
  EXPECT_EQ(DigestHex(0xab), "00000000000000ab");
}

TEST(ContentDigestTest, UppercaseIsReadAndWrittenLowercase) {
  auto d = ContentDigest::FromHex("914E882BF19596C1", "digest");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ToHex(), "914e882bf19596c1");
}

TEST(ContentDigestTest, AnythingButSixteenHexDigitsIsRefusedNamingTheField) {
  for (std::string_view bad : {"", "0", "914e882bf19596c", "914e882bf19596c10", "914e882bf19596cg", " 914e882bf19596c",
                               "-14e882bf19596c1", "0x4e882bf19596c1"}) {
    auto d = ContentDigest::FromHex(bad, "manifest.content_digest");
    ASSERT_FALSE(d.ok()) << "'" << bad << "' was accepted";
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr("manifest.content_digest: '"));
    EXPECT_THAT(d.status().message(), HasSubstr("is not 16 hex digits"));
  }
  const std::string long_text(200, 'a');
  auto d = ContentDigest::ParseHex(long_text, "x");
  ASSERT_FALSE(d.ok());
  EXPECT_LT(d.status().message().size(), 120u) << "a long input is abbreviated in the error";
}

}  // namespace
}  // namespace rc
