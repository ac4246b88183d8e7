#include "rolloutcore/base/hash.h"

#include <gtest/gtest.h>

#include <set>

namespace rc {
namespace {

TEST(HashTest, IncrementalEqualsOneShot) {
  std::string s = "model.layers.0.self_attn.q_proj.weight";
  Hasher h;
  h.Update(s.substr(0, 10)).Update(s.substr(10));
  EXPECT_EQ(h.Digest(), Hash64(s));
  EXPECT_NE(Hash64(s), Hash64(s, 1));
}

TEST(HashTest, Mix64IsInjectiveOnASample) {
  std::set<uint64_t> seen;
  for (uint64_t i = 0; i < 100000; ++i) seen.insert(Mix64(i));
  EXPECT_EQ(seen.size(), 100000u);
  EXPECT_EQ(Hex64(0xabcULL), "0000000000000abc");
}

}  // namespace
}  // namespace rc
