// The GPU digest's segment table, evaluated on the CPU exactly as the kernel evaluates it, against
// refit::DigestBlock / DigestInstalled. Needs no GPU (label unit): it proves the table (walk
// order, merged dims, chunk cuts, global indices, dtype modes) and the kernels' per-thread work
// (ChunkPart, digest_chunk.h: head / whole blocks / tail, lanes, keys, terms), which the host
// evaluation runs for every thread, so the GPU runs only have to prove the device loads and
// shuffles (gpu_kernels_test).
#include "cuda/digest_table.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "cuda/digest_chunk.h"
#include "gpu/gpu_test_util.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"

namespace rc::cuda::internal {
namespace {

using refit::DType;

TEST(DigestTableTest, BlocksMatchDigestBlock) {
  std::mt19937_64 rng(17);
  struct Case {
    DType dtype;
    refit::Shape shape;
    refit::Box box;
  };
  const std::vector<Case> cases = {
      {DType::kBF16, {1024, 512}, {{0, 0}, {1024, 512}}},  // 1 MiB: cut into 8 chunks
      {DType::kBF16, {300, 77}, {{10, 0}, {50, 77}}},
      {DType::kBF16, {64, 96}, {{8, 16}, {20, 40}}},
      {DType::kF16, {1000}, {{3}, {997}}},
      {DType::kF32, {33, 17, 5}, {{1, 2, 0}, {30, 15, 5}}},
      {DType::kI8, {300000}, {{0}, {299997}}},
      {DType::kF8E4M3, {200, 333}, {{0, 0}, {200, 333}}},  // an FP8 image (fp8_image_digest_device)
      {DType::kI64, {129, 3}, {{0, 1}, {129, 2}}},
      {DType::kBF16, {7}, {{0}, {0}}},
      {DType::kF32, {}, {{}, {}}},  // 0-d
  };
  std::vector<std::vector<uint8_t>> data;
  std::vector<DeviceBlock> blocks;
  for (const Case& c : cases) {
    data.emplace_back(static_cast<size_t>(c.box.numel()) * refit::DTypeSize(c.dtype) + 1);
    for (auto& b : data.back()) b = static_cast<uint8_t>(rng());
    blocks.push_back({"t", c.dtype, c.shape, c.box, data.back().data() + 1});  // misaligned on purpose
  }
  auto table = BuildBlockDigestTable(blocks);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_GT(table->chunks.size(), cases.size());
  const std::vector<uint64_t> sums = EvaluateDigestTableOnHost(*table);
  ASSERT_EQ(sums.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(sums[i], refit::DigestBlock(cases[i].dtype, cases[i].shape, cases[i].box, data[i].data() + 1))
        << "case " << i;
  }
  // A block outside its tensor is refused, naming the tensor.
  DeviceBlock bad = blocks[1];
  bad.box.start[0] = 290;
  auto refused = BuildBlockDigestTable(std::span<const DeviceBlock>(&bad, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("not inside shape"), std::string::npos);
}

void CheckInstalled(const std::string& model, const std::string& layout_text) {
  auto config = refit::ModelPreset(model).value();
  auto layout = refit::ParseEngineLayout(layout_text).value();
  std::vector<refit::Capture> captures;
  for (int32_t r = 0; r < layout.world_size(); ++r) captures.push_back(refit::CaptureEngineRank(config, layout, r).value());
  std::vector<const refit::Capture*> ptrs;
  for (auto& c : captures) ptrs.push_back(&c);
  const auto regions = refit::AssignDigestOwnership(ptrs);
  std::mt19937_64 rng(5);
  for (size_t r = 0; r < captures.size(); ++r) {
    std::map<std::string, std::vector<std::byte>> bytes;
    refit::DestinationBuffers views;
    for (const refit::TensorSpec& p : captures[r].params) {
      auto& b = bytes[p.name];
      b.resize(p.bytes());
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(rng());
      if (p.dtype == DType::kF32) {
        for (size_t i = 0; i + 4 <= b.size(); i += 8) b[i] = b[i + 1] = std::byte{0};  // exact bf16 widenings
      }
      views.emplace(p.name, std::span<std::byte>(b));
    }
    auto table = BuildInstalledDigestTable(captures[r], views, regions[r]);
    ASSERT_TRUE(table.ok()) << table.status().ToString();
    const std::vector<uint64_t> sums = EvaluateDigestTableOnHost(*table);
    refit::TensorDigests got;
    for (size_t i = 0; i < sums.size(); ++i) got[table->slot_tensors[i]] += sums[i];
    auto want = refit::DigestInstalled(captures[r], views, regions[r]);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    EXPECT_EQ(got, *want) << model << " " << layout_text << " rank " << r;
  }
}

TEST(DigestTableTest, InstalledMatchesDigestInstalled) {
  for (const char* layout : {"tp:1", "tp:2", "tp:1@bf16", "tp:2@bf16"}) CheckInstalled("tiny", layout);
  CheckInstalled("tiny-qwen2", "tp:2");
  CheckInstalled("tiny-moe", "tp:2+ep:2");
  CheckInstalled("tiny-llama", "tp:2@bf16");
}

// Staging captures are refit::DenseStagingCapture's: what the vLLM extension builds (copy i lands
// densely in its own staging parameter "rc.staging.i" of the live parameter's dtype).
using Bytes = std::map<std::string, std::vector<std::byte>>;

refit::DestinationBuffers ViewsOf(const refit::Capture& cap, Bytes& bytes, std::mt19937_64& rng) {
  refit::DestinationBuffers views;
  for (const refit::TensorSpec& p : cap.params) {
    auto& b = bytes[p.name];
    b.resize(p.bytes());
    for (auto& x : b) x = static_cast<std::byte>(rng());
    views.emplace(p.name, std::span<std::byte>(b));
  }
  return views;
}

void CheckFused(const refit::Capture& live, const std::string& what) {
  const refit::Capture staging = refit::DenseStagingCapture(live);
  const refit::Capture* ranks[] = {&live};
  const auto regions = refit::AssignDigestOwnership(ranks)[0];
  std::mt19937_64 rng(11);
  Bytes live_bytes, staging_bytes;
  refit::DestinationBuffers live_views = ViewsOf(live, live_bytes, rng);
  refit::DestinationBuffers staging_views = ViewsOf(staging, staging_bytes, rng);
  // The reference of the fused copy: torch's dst.copy_(staging_view), element by element.
  Bytes want_live = live_bytes;
  want_live.insert(staging_bytes.begin(), staging_bytes.end());
  testing::InstallStagedOnHost(live, staging, &want_live);
  for (const auto& [name, bytes] : staging_bytes) want_live.erase(name);
  auto table = BuildFusedInstallTable(live, live_views, staging, staging_views, regions);
  ASSERT_TRUE(table.ok()) << what << ": " << table.status().ToString();
  const std::vector<uint64_t> sums = EvaluateFusedInstallOnHost(*table);
  EXPECT_EQ(live_bytes, want_live) << what << ": the fused copies differ from copy_ element by element";
  refit::TensorDigests got;
  for (size_t i = 0; i < sums.size(); ++i) got[table->slot_tensors[i]] += sums[i];
  // The digest of what was written equals the digest read back from live memory afterwards.
  auto want = refit::DigestInstalled(live, live_views, regions);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  EXPECT_EQ(got, *want) << what;
  EXPECT_GT(table->bytes, 0u);
}

TEST(DigestTableTest, FusedInstallCopiesAndDigestsLikeCopyThenDigestInstalled) {
  for (const char* layout_text : {"tp:1", "tp:2", "tp:1@bf16", "tp:2@bf16"}) {
    auto config = refit::ModelPreset("tiny").value();
    auto layout = refit::ParseEngineLayout(layout_text).value();
    for (int32_t r = 0; r < layout.world_size(); ++r) {
      CheckFused(refit::CaptureEngineRank(config, layout, r).value(), std::string("tiny ") + layout_text);
    }
  }
  auto llama = refit::CaptureEngineRank(refit::ModelPreset("tiny-llama").value(),
                                        refit::ParseEngineLayout("tp:2@bf16").value(), 1);
  CheckFused(llama.value(), "tiny-llama tp:2@bf16 rank 1");
}

TEST(DigestTableTest, FusedInstallDigestsATwiceInstalledSourceOnce) {
  // A source installed into two parameters (a tied embedding both loaded): the second copy is not
  // owned, so it is copied but not digested; the digest still equals DigestInstalled.
  auto live = refit::CaptureEngineRank(refit::ModelPreset("tiny").value(), refit::ParseEngineLayout("tp:1@bf16").value(), 0)
                  .value();
  const refit::CapturedCopy first = live.copies[0];
  refit::TensorSpec twin = live.params[first.param];
  twin.name += ".twin";
  live.params.push_back(twin);
  refit::CapturedCopy again = first;
  again.param = static_cast<uint32_t>(live.params.size() - 1);
  live.copies.push_back(again);
  CheckFused(live, "twin");
  const refit::Capture staging = refit::DenseStagingCapture(live);
  const refit::Capture* ranks[] = {&live};
  const auto regions = refit::AssignDigestOwnership(ranks)[0];
  std::mt19937_64 rng(3);
  Bytes lb, sb;
  auto lv = ViewsOf(live, lb, rng);
  auto sv = ViewsOf(staging, sb, rng);
  auto table = BuildFusedInstallTable(live, lv, staging, sv, regions);
  ASSERT_TRUE(table.ok());
  EXPECT_EQ(table->chunks.back().digest, 0) << "the twin copy is copied, not digested";
}

TEST(DigestTableTest, FusedInstallRefusesOverlappingCopies) {
  auto live = refit::CaptureEngineRank(refit::ModelPreset("tiny").value(), refit::ParseEngineLayout("tp:1@bf16").value(), 0)
                  .value();
  live.copies.push_back(live.copies[0]);  // the same live elements written twice
  const refit::Capture staging = refit::DenseStagingCapture(live);
  const refit::Capture* ranks[] = {&live};
  const auto regions = refit::AssignDigestOwnership(ranks)[0];
  std::mt19937_64 rng(4);
  Bytes lb, sb;
  auto lv = ViewsOf(live, lb, rng);
  auto sv = ViewsOf(staging, sb, rng);
  auto table = BuildFusedInstallTable(live, lv, staging, sv, regions);
  ASSERT_FALSE(table.ok());
  EXPECT_EQ(table.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(table.status().message().find("overlapping"), std::string::npos) << table.status().ToString();
}

// Every (element size, bits mode) pair the kernels dispatch, every start index modulo 64, lengths
// around block and unit (32 blocks) boundaries, aligned and misaligned memory: the sum of
// ChunkThreadSum over a block's threads equals the element-by-element definition, for the digest
// chunk and for the fused chunk (which must also copy exactly, and copy only when digest == 0).
uint32_t BlocksOf(const DigestChunk& d) {
  switch (d.elem_size) {
    case 1:
      return SplitChunk<1, false>(ViewOf(d)).blocks;
    case 2:
      return SplitChunk<2, false>(ViewOf(d)).blocks;
    case 4:
      return SplitChunk<4, false>(ViewOf(d)).blocks;
    default:
      return SplitChunk<8, false>(ViewOf(d)).blocks;
  }
}

TEST(DigestTableTest, ChunkPartOverAllThreadsEqualsTheDefinition) {
  struct Kind {
    int es;
    uint8_t mode;
  };
  const Kind kinds[] = {{1, kBitsRaw},         {2, kBitsRaw},        {4, kBitsRaw},         {8, kBitsRaw},
                        {4, kBitsF32FromBf16}, {4, kBitsF32FromF16}, {2, kBitsBf16FromF32}, {2, kBitsF16FromF32},
                        {1, kBitsMismatch},    {2, kBitsMismatch},   {4, kBitsMismatch},    {8, kBitsMismatch}};
  std::mt19937_64 rng(23);
  alignas(64) static unsigned char src[8 * 5200 + 64];
  alignas(64) static unsigned char dst[8 * 5200 + 64];
  int block_path = 0;
  for (const Kind& k : kinds) {
    for (size_t i = 0; i < sizeof src; ++i) src[i] = static_cast<unsigned char>(rng());
    if (k.mode == kBitsF32FromBf16) {
      for (size_t i = 0; i + 4 <= sizeof src; i += 4) {
        if (rng() % 8 != 0) src[i] = src[i + 1] = 0;  // mostly exact widenings, some poisoned
      }
    }
    // The last two wrap around 2^64 inside the chunk (block numbers wrap modulo 2^58).
    for (uint64_t gindex :
         {uint64_t{0}, uint64_t{5}, uint64_t{64}, uint64_t{100}, ~uint64_t{0} - 69, ~uint64_t{0} - 63}) {
      for (uint32_t count : {0u, 1u, 63u, 64u, 65u, 200u, 64u * 33u + 7u, 5000u}) {
        for (uint32_t off : {0u, static_cast<uint32_t>(k.es), 16u}) {
          uint64_t want = 0;
          for (uint32_t e = 0; e < count; ++e) {
            uint64_t raw = 0;
            std::memcpy(&raw, src + off + static_cast<size_t>(e) * k.es, static_cast<size_t>(k.es));
            want += refit::DigestTerm(gindex + e, SourceBitsFromInstalled(k.mode, raw));
          }
          const std::string what = "es " + std::to_string(k.es) + " mode " + std::to_string(k.mode) + " gindex " +
                                   std::to_string(gindex) + " count " + std::to_string(count) + " offset " +
                                   std::to_string(off);
          DigestChunk d;
          d.addr = reinterpret_cast<uint64_t>(src + off);
          d.gindex = gindex;
          d.count = count;
          d.elem_size = static_cast<uint8_t>(k.es);
          d.mode = k.mode;
          uint64_t got = 0;
          for (uint32_t t = 0; t < static_cast<uint32_t>(kDigestThreads); ++t) {
            got += ChunkThreadSum(d, t, kDigestThreads);
          }
          ASSERT_EQ(got, want) << "digest chunk, " << what;
          const uint32_t blocks = BlocksOf(d);
          if (count > 128 && off == 0 && gindex % 64 == 0) {
            ASSERT_GT(blocks, 0u) << "the block path should run: " << what;
          }
          block_path += blocks > 0 ? 1 : 0;
          for (uint8_t digest : {uint8_t{1}, uint8_t{0}}) {
            std::memset(dst, 0xAB, sizeof dst);
            FusedChunk f;
            f.src = d.addr;
            f.dst = reinterpret_cast<uint64_t>(dst + (off == 16 ? 8 : off));  // 16: src aligned, dst not
            f.gindex = gindex;
            f.count = count;
            f.elem_size = d.elem_size;
            f.mode = k.mode;
            f.digest = digest;
            uint64_t fused = 0;
            for (uint32_t t = 0; t < static_cast<uint32_t>(kDigestThreads); ++t) {
              fused += ChunkThreadSum(f, t, kDigestThreads);
            }
            ASSERT_EQ(fused, digest ? want : 0) << "fused chunk (digest " << int{digest} << "), " << what;
            const size_t bytes = static_cast<size_t>(count) * k.es;
            unsigned char* out = reinterpret_cast<unsigned char*>(f.dst);
            ASSERT_EQ(std::memcmp(out, src + off, bytes), 0) << "fused copy, " << what;
            ASSERT_EQ(out[bytes], 0xAB) << "wrote past the run, " << what;
          }
        }
      }
    }
  }
  EXPECT_GT(block_path, 50);
}

// The kernels' lane geometry covers each 64-element block exactly once per 32-block unit.
TEST(DigestTableTest, BlockLanesTileAUnit) {
  EXPECT_EQ(BlockLanes<2>::kPer, 8);
  EXPECT_EQ(BlockLanes<2>::kLanesPerBlock * BlockLanes<2>::kPer, 64);
  EXPECT_EQ(BlockLanes<1>::kBlocksPerStep * BlockLanes<1>::kSteps, 32);
  EXPECT_EQ(BlockLanes<4>::kBlocksPerStep * BlockLanes<4>::kSteps, 32);
  EXPECT_EQ(BlockLanes<8>::kBlocksPerStep * BlockLanes<8>::kSteps, 32);
  EXPECT_EQ(BlockLanes<8>::kLanesPerBlock, 32);
}

TEST(DigestTableTest, ContiguousTensorsBecomeFewChunks) {
  // A whole bf16 tensor installed as is: one merged walk, cut only at the chunk size.
  std::vector<std::byte> data(2 * 4096 * 1024);
  DeviceBlock b{"w", DType::kBF16, {4096, 1024}, {{0, 0}, {4096, 1024}}, data.data()};
  auto table = BuildBlockDigestTable(std::span<const DeviceBlock>(&b, 1));
  ASSERT_TRUE(table.ok());
  EXPECT_EQ(table->chunks.size(), data.size() / kDigestChunkBytes);
  EXPECT_EQ(table->elements, 4096u * 1024u);
}

}  // namespace
}  // namespace rc::cuda::internal
