// ExchangeLayoutIssue (exchange.h): on host memory laid out as the vLLM extension lays out its slabs,
// the check passes exactly when the live weights after the exchange digest as the staged image does,
// and names the first thing wrong otherwise.
#include "receiver/exchange.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "rolloutcore/refit/digest.h"

namespace rc::receiver::internal {
namespace {

using refit::Box;
using refit::Capture;
using refit::CapturedCopy;
using refit::DType;
using refit::Shape;

CapturedCopy Copy(const std::string& source, DType dtype, const Shape& source_shape, const Box& box, uint32_t param,
                  int64_t offset, const Shape& dest_shape, const Shape& dest_strides) {
  CapturedCopy c;
  c.source = source;
  c.source_dtype = dtype;
  c.source_shape = source_shape;
  c.box = box;
  for (size_t k = 0; k < source_shape.size(); ++k) c.view_to_source.push_back(static_cast<int32_t>(k));
  c.param = param;
  c.dest_offset = offset;
  c.dest_shape = dest_shape;
  c.dest_strides = dest_strides;
  return c;
}

// vLLM's shapes in miniature: a fused qkv_proj [6, 4] bf16 tiled by q, k, v (2 rows each), and a
// norm [4] f32.
Capture Live() {
  Capture c;
  c.params = {{"qkv_proj.weight", DType::kBF16, {6, 4}}, {"norm.weight", DType::kF32, {4}}};
  c.copies = {Copy("q", DType::kBF16, {2, 4}, {{0, 0}, {2, 4}}, 0, 0, {2, 4}, {4, 1}),
              Copy("k", DType::kBF16, {2, 4}, {{0, 0}, {2, 4}}, 0, 8, {2, 4}, {4, 1}),
              Copy("v", DType::kBF16, {2, 4}, {{0, 0}, {2, 4}}, 0, 16, {2, 4}, {4, 1}),
              Copy("norm", DType::kF32, {4}, {{0}, {4}}, 1, 0, {4}, {1})};
  return c;
}

struct Slabs {
  std::vector<std::byte> qkv = std::vector<std::byte>(48);
  std::vector<std::byte> norm = std::vector<std::byte>(16);
  refit::DestinationBuffers live_after() {
    return {{"qkv_proj.weight", std::span<std::byte>(qkv)}, {"norm.weight", std::span<std::byte>(norm)}};
  }
  // The extension's layout: copy i's staging buffer at its live offset inside the slab.
  refit::DestinationBuffers staging() {
    return {{"rc.staging.0", std::span<std::byte>(qkv.data(), 16)},
            {"rc.staging.1", std::span<std::byte>(qkv.data() + 16, 16)},
            {"rc.staging.2", std::span<std::byte>(qkv.data() + 32, 16)},
            {"rc.staging.3", std::span<std::byte>(norm)}};
  }
  void Fill(uint32_t seed) {
    std::mt19937 rng(seed);
    for (auto& b : qkv) b = static_cast<std::byte>(rng() & 0x3f);  // finite bf16 / f32 patterns
    for (auto& b : norm) b = static_cast<std::byte>(rng() & 0x3f);
  }
};

refit::TensorDigests Digest(const Capture& c, const refit::DestinationBuffers& b) {
  const Capture* ranks[] = {&c};
  auto d = refit::DigestInstalled(c, b, refit::AssignDigestOwnership(ranks)[0]);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? *d : refit::TensorDigests{};
}

TEST(ExchangeLayoutTest, InPlaceSlabsMakeTheLiveWeightsTheStagedBytes) {
  const Capture live = Live();
  const Capture staging = refit::DenseStagingCapture(live);
  Slabs s;
  s.Fill(7);
  EXPECT_EQ(ExchangeLayoutIssue(staging, live, s.staging(), s.live_after()), "");
  // What the check stands for: the live weights after the exchange digest as the staged image.
  EXPECT_EQ(Digest(live, s.live_after()), Digest(staging, s.staging()));
}

TEST(ExchangeLayoutTest, AStagingBufferOffItsLiveOffsetIsNamedAndWouldInstallOtherBytes) {
  const Capture live = Live();
  const Capture staging = refit::DenseStagingCapture(live);
  Slabs s;
  s.Fill(8);
  refit::DestinationBuffers st = s.staging();
  st["rc.staging.1"] = std::span<std::byte>(s.qkv.data() + 18, 16);  // k staged 2 bytes late
  const std::string issue = ExchangeLayoutIssue(staging, live, st, s.live_after());
  EXPECT_NE(issue.find("copy 1 (k)"), std::string::npos) << issue;
  EXPECT_NE(issue.find("rc.staging.1"), std::string::npos) << issue;
  EXPECT_NE(Digest(live, s.live_after()), Digest(staging, st));
}

TEST(ExchangeLayoutTest, RefusesStridedBoxesUncoveredBytesAndWrongSlabs) {
  Slabs s;
  {
    // A column split (tensor-parallel row-parallel input): the box is strided inside the parameter.
    Capture live;
    live.params = {{"o_proj.weight", DType::kBF16, {2, 4}}};
    live.copies = {Copy("o", DType::kBF16, {2, 4}, {{0, 0}, {2, 2}}, 0, 0, {2, 2}, {4, 1}),
                   Copy("o", DType::kBF16, {2, 4}, {{0, 2}, {2, 2}}, 0, 2, {2, 2}, {4, 1})};
    const refit::DestinationBuffers after{{"o_proj.weight", std::span<std::byte>(s.qkv.data(), 16)}};
    const refit::DestinationBuffers st{{"rc.staging.0", std::span<std::byte>(s.qkv.data(), 8)},
                                       {"rc.staging.1", std::span<std::byte>(s.qkv.data() + 4, 8)}};
    const std::string issue = ExchangeLayoutIssue(refit::DenseStagingCapture(live), live, st, after);
    EXPECT_NE(issue.find("strided box"), std::string::npos) << issue;
  }
  {
    // Padding rows no copy writes (an embedding padded past the vocabulary).
    Capture live = Live();
    live.params[0].shape = {7, 4};
    refit::DestinationBuffers after = s.live_after();
    std::vector<std::byte> big(56);
    after["qkv_proj.weight"] = std::span<std::byte>(big);
    const std::string issue = ExchangeLayoutIssue(refit::DenseStagingCapture(live), live, s.staging(), after);
    EXPECT_NE(issue.find("exactly once"), std::string::npos) << issue;
  }
  const Capture live = Live();
  const Capture staging = refit::DenseStagingCapture(live);
  {
    refit::DestinationBuffers after = s.live_after();
    after["norm.weight"] = std::span<std::byte>(s.norm.data(), 12);
    const std::string issue = ExchangeLayoutIssue(staging, live, s.staging(), after);
    EXPECT_NE(issue.find("norm.weight: its slab holds 12 bytes, the parameter 16"), std::string::npos) << issue;
  }
  {
    refit::DestinationBuffers after = s.live_after();
    after.erase("norm.weight");
    const std::string issue = ExchangeLayoutIssue(staging, live, s.staging(), after);
    EXPECT_NE(issue.find("live parameter norm.weight is not exchanged"), std::string::npos) << issue;
  }
  {
    refit::DestinationBuffers after = s.live_after();
    after["lm_head.weight"] = std::span<std::byte>(s.norm);
    const std::string issue = ExchangeLayoutIssue(staging, live, s.staging(), after);
    EXPECT_NE(issue.find("lm_head.weight is not a live parameter"), std::string::npos) << issue;
  }
  {
    Capture other = staging;
    other.params[3].dtype = DType::kBF16;
    const std::string issue = ExchangeLayoutIssue(other, live, s.staging(), s.live_after());
    EXPECT_NE(issue.find("staging dtype bf16"), std::string::npos) << issue;
  }
  {
    Capture other = staging;
    other.copies[2].box.start = {1, 0};
    const std::string issue = ExchangeLayoutIssue(other, live, s.staging(), s.live_after());
    EXPECT_NE(issue.find("different boxes"), std::string::npos) << issue;
  }
}

}  // namespace
}  // namespace rc::receiver::internal
