// The GPU digest's segment table, evaluated on the CPU exactly as the kernel evaluates it, against
// refit::DigestBlock / DigestInstalled. Needs no GPU (label unit): it proves the table (walk
// order, merged dims, chunk cuts, global indices, dtype modes) so the GPU runs only have to prove
// the kernel's arithmetic (gpu_kernels_test).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "cuda/digest_table.h"
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
