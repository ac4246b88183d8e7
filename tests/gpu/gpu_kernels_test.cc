// GPU kernels against their CPU definitions (label gpu; skipped without a CUDA device, except the
// host-side checks of the shared bit conversions): dtype conversion, content digest of blocks and
// of installed parameters (bit-identical to refit::DigestBlock / DigestInstalled), seeded fill,
// batched device copies.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "cuda/dtype_bits.h"
#include "gpu/gpu_test_util.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/cuda/seeded.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::cuda {
namespace {

using refit::DType;

std::vector<uint32_t> SampleF32Bits() {
  std::vector<uint32_t> v;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 200000; ++i) v.push_back(static_cast<uint32_t>(rng()));
  // Edge cases: zeros, subnormals, the f16 subnormal boundary, infinities, NaNs, rounding ties.
  for (uint32_t u : {0u, 0x80000000u, 1u, 0x007fffffu, 0x00800000u, 0x33800000u, 0x33000000u, 0x387fe000u,
                     0x38800000u, 0x477fe000u, 0x477ff000u, 0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                     0x7f800001u, 0xffc00001u, 0x3f808000u, 0x3f818000u, 0x3f800001u}) {
    v.push_back(u);
  }
  return v;
}

TEST(GpuConversionTest, HostBitFunctionsMatchRefit) {
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(internal::F16ToF32Bits(static_cast<uint16_t>(h)),
              std::bit_cast<uint32_t>(refit::F16BitsToF32(static_cast<uint16_t>(h))))
        << h;
    ASSERT_EQ(internal::Bf16ToF32Bits(static_cast<uint16_t>(h)),
              std::bit_cast<uint32_t>(refit::Bf16BitsToF32(static_cast<uint16_t>(h))))
        << h;
  }
  for (uint32_t u : SampleF32Bits()) {
    ASSERT_EQ(internal::F32BitsToF16(u), refit::F32ToF16Bits(std::bit_cast<float>(u))) << std::hex << u;
    ASSERT_EQ(internal::F32BitsToBf16(u), refit::F32ToBf16Bits(std::bit_cast<float>(u))) << std::hex << u;
  }
}

template <typename S, typename D>
void CheckDeviceConversion(DType from, const std::vector<S>& src, DType to) {
  auto dsrc = DeviceBuffer::Allocate(0, src.size() * sizeof(S)).value();
  auto ddst = DeviceBuffer::Allocate(0, src.size() * sizeof(D)).value();
  ASSERT_TRUE(CopyToDevice(dsrc.data(), src.data(), dsrc.size(), 0).ok());
  ASSERT_TRUE(ConvertOnDevice(from, dsrc.data(), to, ddst.data(), static_cast<int64_t>(src.size()), 0).ok());
  std::vector<D> got(src.size()), want(src.size());
  ASSERT_TRUE(CopyToHost(got.data(), ddst.data(), ddst.size(), 0).ok());
  refit::ConvertElements(from, src.data(), 1, to, want.data(), 1, static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << refit::DTypeName(from) << "->" << refit::DTypeName(to) << " element " << i
                               << " bits " << std::hex << src[i];
  }
}

TEST(GpuConversionTest, DeviceConversionMatchesCpuForEveryHalfAndSampledF32) {
  RC_SKIP_WITHOUT_GPUS(1);
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; ++h) halves[h] = static_cast<uint16_t>(h);
  CheckDeviceConversion<uint16_t, uint32_t>(DType::kBF16, halves, DType::kF32);
  CheckDeviceConversion<uint16_t, uint32_t>(DType::kF16, halves, DType::kF32);
  const std::vector<uint32_t> f32 = SampleF32Bits();
  CheckDeviceConversion<uint32_t, uint16_t>(DType::kF32, f32, DType::kBF16);
  CheckDeviceConversion<uint32_t, uint16_t>(DType::kF32, f32, DType::kF16);
  CheckDeviceConversion<uint16_t, uint16_t>(DType::kBF16, halves, DType::kBF16);
}

TEST(GpuDigestTest, BlocksMatchCpuDigestBlock) {
  RC_SKIP_WITHOUT_GPUS(1);
  std::mt19937_64 rng(11);
  struct Case {
    DType dtype;
    refit::Shape shape;
    refit::Box box;
    size_t misalign;  // bytes added to the block's address
  };
  const std::vector<Case> cases = {
      {DType::kBF16, {4096, 1024}, {{0, 0}, {4096, 1024}}, 0},  // big contiguous, several chunks
      {DType::kBF16, {300, 77}, {{10, 0}, {50, 77}}, 0},        // dim-0 shard, odd row length
      {DType::kBF16, {64, 96}, {{8, 16}, {20, 40}}, 2},         // column block, misaligned
      {DType::kF16, {1000}, {{3}, {997}}, 6},
      {DType::kF32, {33, 17, 5}, {{1, 2, 0}, {30, 15, 5}}, 4},
      {DType::kI8, {1 << 20}, {{0}, {(1 << 20) - 3}}, 1},
      {DType::kI64, {129, 3}, {{0, 1}, {129, 2}}, 8},
      {DType::kBF16, {7}, {{0}, {0}}, 0},  // empty block
      // Aligned, so the block path (digest_chunk.h) runs for every element size, with a head that
      // is not a whole block (global start 264 = 4 * 64 + 8) and tails.
      {DType::kF32, {512, 256}, {{0, 0}, {512, 256}}, 0},
      {DType::kI8, {1 << 20}, {{0}, {1 << 20}}, 0},
      {DType::kI64, {64, 130}, {{0, 0}, {64, 130}}, 0},
      {DType::kBF16, {128, 256}, {{1, 8}, {100, 200}}, 0},
      {DType::kF16, {3, 4099}, {{0, 0}, {3, 4099}}, 0},
  };
  std::vector<std::vector<uint8_t>> host;
  std::vector<DeviceBuffer> dev;
  std::vector<DeviceBlock> blocks;
  for (const Case& c : cases) {
    const size_t bytes = static_cast<size_t>(c.box.numel()) * refit::DTypeSize(c.dtype);
    host.emplace_back(bytes);
    for (auto& b : host.back()) b = static_cast<uint8_t>(rng());
    dev.push_back(DeviceBuffer::Allocate(0, bytes + 16).value());
    if (bytes > 0) {
      ASSERT_TRUE(CopyToDevice(dev.back().data() + c.misalign, host.back().data(), bytes, 0).ok());
    }
    blocks.push_back({fmt::format("t{}", blocks.size()), c.dtype, c.shape, c.box, dev.back().data() + c.misalign});
  }
  auto digest = DeviceDigest::ForBlocks(blocks, 0);
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  auto sums = digest->RunSlots();
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ((*sums)[i], refit::DigestBlock(cases[i].dtype, cases[i].shape, cases[i].box, host[i].data()))
        << "case " << i;
  }
  // Repeatable (the accumulators are reset per run).
  auto again = digest->RunSlots();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *sums);
  // One flipped bit changes exactly that block's digest.
  uint8_t byte = 0;
  ASSERT_TRUE(CopyToHost(&byte, dev[1].data() + 1001, 1, 0).ok());
  byte ^= 0x10;
  ASSERT_TRUE(CopyToDevice(dev[1].data() + 1001, &byte, 1, 0).ok());
  auto flipped = digest->RunSlots();
  ASSERT_TRUE(flipped.ok());
  EXPECT_NE((*flipped)[1], (*sums)[1]);
  EXPECT_EQ((*flipped)[0], (*sums)[0]);
}

// DigestInstalled on arbitrary parameter bytes (valid conversions, poisoned ones, anything).
void CheckInstalledDigest(const std::string& layout_text, int32_t rank) {
  auto config = refit::ModelPreset("tiny").value();
  auto layout = refit::ParseEngineLayout(layout_text).value();
  auto capture = refit::CaptureEngineRank(config, layout, rank);
  ASSERT_TRUE(capture.ok()) << capture.status().ToString();
  std::mt19937_64 rng(rank * 131 + 7);
  std::map<std::string, std::vector<std::byte>> host;
  std::map<std::string, DeviceBuffer> dev;
  refit::DestinationBuffers host_views, dev_views;
  for (const refit::TensorSpec& p : capture->params) {
    auto& h = host[p.name];
    h.resize(p.bytes());
    for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::byte>(rng());
    if (p.dtype == DType::kF32) {
      // Every third element an exact widening of a bf16, so both digest paths are exercised.
      for (size_t i = 0; i + 4 <= h.size(); i += 12) {
        h[i] = std::byte{0};
        h[i + 1] = std::byte{0};
      }
    }
    dev[p.name] = DeviceBuffer::Allocate(0, p.bytes()).value();
    ASSERT_TRUE(CopyToDevice(dev[p.name].data(), h.data(), h.size(), 0).ok());
    host_views.emplace(p.name, std::span<std::byte>(h));
    dev_views.emplace(p.name, std::span<std::byte>(dev[p.name].data(), p.bytes()));
  }
  const refit::Capture* ranks[] = {&*capture};
  const auto regions = refit::AssignDigestOwnership(ranks);
  auto cpu = refit::DigestInstalled(*capture, host_views, regions[0]);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  auto gpu_digest = DeviceDigest::ForInstalled(*capture, dev_views, regions[0], 0);
  ASSERT_TRUE(gpu_digest.ok()) << gpu_digest.status().ToString();
  auto gpu = gpu_digest->Run();
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  EXPECT_EQ(gpu->size(), cpu->size());
  for (const auto& [name, d] : *cpu) EXPECT_EQ(gpu->at(name), d) << layout_text << " rank " << rank << " " << name;
  // A missing buffer is refused like on the CPU.
  refit::DestinationBuffers partial = dev_views;
  partial.erase(partial.begin());
  auto refused = DeviceDigest::ForInstalled(*capture, partial, regions[0], 0);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
}

TEST(GpuDigestTest, InstalledMatchesCpuDigestInstalled) {
  RC_SKIP_WITHOUT_GPUS(1);
  for (const char* layout : {"tp:1@bf16", "tp:2@bf16", "tp:2", "tp:1"}) {
    for (int32_t rank = 0; rank < (layout[3] == '2' ? 2 : 1); ++rank) CheckInstalledDigest(layout, rank);
  }
}

// The fused install kernel on the device (DeviceInstall, what the vLLM extension runs in the pause):
// the live bytes afterwards equal the staged values installed on the host, and the digest the
// kernel returns equals refit::DigestInstalled of those live bytes.
void CheckDeviceInstall(const std::string& model, const std::string& layout_text, int32_t rank) {
  const std::string what = model + " " + layout_text + " rank " + std::to_string(rank);
  auto live = refit::CaptureEngineRank(refit::ModelPreset(model).value(), refit::ParseEngineLayout(layout_text).value(),
                                       rank);
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  const refit::Capture staging = testing::StagingFor(*live);
  const refit::Capture* ranks[] = {&*live};
  const auto regions = refit::AssignDigestOwnership(ranks)[0];
  std::mt19937_64 rng(rank * 17 + 3);
  std::map<std::string, std::vector<std::byte>> host;
  std::map<std::string, DeviceBuffer> dev;
  refit::DestinationBuffers live_dev, staging_dev;
  auto add = [&](const refit::TensorSpec& p, refit::DestinationBuffers& views) {
    auto& h = host[p.name];
    h.resize(p.bytes());
    for (auto& b : h) b = static_cast<std::byte>(rng());
    dev[p.name] = DeviceBuffer::Allocate(0, p.bytes()).value();
    ASSERT_TRUE(CopyToDevice(dev[p.name].data(), h.data(), h.size(), 0).ok());
    views.emplace(p.name, std::span<std::byte>(dev[p.name].data(), p.bytes()));
  };
  for (const refit::TensorSpec& p : live->params) add(p, live_dev);
  for (const refit::TensorSpec& p : staging.params) add(p, staging_dev);
  auto install = DeviceInstall::Prepare(*live, live_dev, staging, staging_dev, regions, 0);
  ASSERT_TRUE(install.ok()) << what << ": " << install.status().ToString();
  auto got = install->Run();
  ASSERT_TRUE(got.ok()) << what << ": " << got.status().ToString();
  // Reference: staged copies written into the host image of live, element by element.
  testing::InstallStagedOnHost(*live, staging, &host);
  refit::DestinationBuffers live_host;
  for (const refit::TensorSpec& p : live->params) {
    std::vector<std::byte> back(p.bytes());
    ASSERT_TRUE(CopyToHost(back.data(), dev[p.name].data(), back.size(), 0).ok());
    ASSERT_EQ(back, host[p.name]) << what << ": live " << p.name << " differs from the staged values installed";
    live_host.emplace(p.name, std::span<std::byte>(host[p.name]));
  }
  auto want = refit::DigestInstalled(*live, live_host, regions);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  EXPECT_EQ(*got, *want) << what;
  EXPECT_GT(install->bytes(), 0u);
}

TEST(GpuDigestTest, FusedInstallOnTheDeviceEqualsCopyThenDigestInstalled) {
  RC_SKIP_WITHOUT_GPUS(1);
  for (const char* layout : {"tp:1@bf16", "tp:2@bf16", "tp:2", "tp:1"}) {
    for (int32_t rank = 0; rank < (layout[3] == '2' ? 2 : 1); ++rank) CheckDeviceInstall("tiny", layout, rank);
  }
  CheckDeviceInstall("tiny-llama", "tp:2@bf16", 1);
  // Large enough that whole 32-block units (the batched loads of digest_chunk.h) dominate.
  CheckDeviceInstall("qwen3-0.6b", "tp:2@bf16", 0);
}

TEST(GpuKernelsTest, SeededFillMatchesHost) {
  RC_SKIP_WITHOUT_GPUS(1);
  const refit::Shape shape = {40, 24};
  const refit::Box box = {{5, 8}, {30, 12}};
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32, DType::kI64, DType::kU8}) {
    const size_t es = refit::DTypeSize(dtype);
    auto buf = DeviceBuffer::Allocate(0, static_cast<uint64_t>(box.numel()) * es).value();
    const uint64_t key = SeededTensorKey(3, "w");
    ASSERT_TRUE(FillSeeded(0, buf.data(), dtype, key, shape, box).ok());
    std::vector<std::byte> got(buf.size());
    ASSERT_TRUE(CopyToHost(got.data(), buf.data(), got.size(), 0).ok());
    for (int64_t r = 0; r < box.extent[0]; ++r) {
      for (int64_t c = 0; c < box.extent[1]; ++c) {
        const uint64_t gi = static_cast<uint64_t>((box.start[0] + r) * shape[1] + box.start[1] + c);
        const uint64_t want = SeededElementBits(static_cast<uint8_t>(dtype), key, gi);
        uint64_t have = 0;
        std::memcpy(&have, got.data() + static_cast<size_t>(r * box.extent[1] + c) * es, es);
        ASSERT_EQ(have, want) << refit::DTypeName(dtype) << " at " << r << "," << c;
      }
    }
  }
}

TEST(GpuKernelsTest, BatchedCopiesAreExact) {
  RC_SKIP_WITHOUT_GPUS(1);
  const uint64_t n = (3 << 20) + 123;
  std::vector<uint8_t> src(n);
  std::mt19937_64 rng(3);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  auto a = DeviceBuffer::Allocate(0, n).value();
  auto b = DeviceBuffer::Allocate(0, n + 64).value();
  ASSERT_TRUE(CopyToDevice(a.data(), src.data(), n, 0).ok());
  ASSERT_TRUE(FillBytes(b.data(), 0xee, n + 64, 0).ok());
  // An aligned big copy, a misaligned one, an empty one.
  std::vector<DeviceCopy> copies = {{a.data(), b.data(), 2 << 20},
                                    {a.data() + (2 << 20) + 1, b.data() + (2 << 20) + 3, n - (2 << 20) - 1},
                                    {a.data(), b.data() + n + 10, 0}};
  ASSERT_TRUE(CopyOnDevice(copies, 0).ok());
  std::vector<uint8_t> got(n + 64);
  ASSERT_TRUE(CopyToHost(got.data(), b.data(), got.size(), 0).ok());
  for (uint64_t i = 0; i < (2 << 20); ++i) ASSERT_EQ(got[i], src[i]) << i;
  EXPECT_EQ(got[(2 << 20) + 0], 0xee);
  EXPECT_EQ(got[(2 << 20) + 2], 0xee);
  for (uint64_t i = (2 << 20) + 1; i < n; ++i) ASSERT_EQ(got[i + 2], src[i]) << i;
  for (uint64_t i = n + 2; i < n + 64; ++i) ASSERT_EQ(got[i], 0xee) << i;
}

}  // namespace
}  // namespace rc::cuda
