// The fp8 quantizer's CUDA kernels against the CPU quantizer (formats/fp8.h): the same E4M3 bytes
// and f32 scales, bit for bit, for every scheme, over edge values (every finite bf16 value, bf16
// subnormals, ±bf16 max, zeros, values that land on E4M3 ties), and the same refusals. Label gpu;
// skipped without a CUDA device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "rolloutcore/cuda/fp8.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/formats/safetensors.h"

namespace rc::cuda {
namespace {

using formats::Fp8Layout;
using formats::Fp8Scheme;

std::vector<uint16_t> Weights(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<uint16_t> w(static_cast<size_t>(n));
  for (size_t i = 0; i < w.size(); ++i) {
    switch (rng() % 16) {
      case 0: w[i] = static_cast<uint16_t>(i & 0xFFFF); break;  // walks the bf16 codes
      case 1: w[i] = static_cast<uint16_t>((rng() % 0x7F + 1) | (rng() & 0x8000)); break;  // subnormal
      case 2: w[i] = 0; break;
      default: w[i] = formats::F32ToBF16(normal(rng));
    }
    if ((w[i] & 0x7F80) == 0x7F80) w[i] = 0x3F80;  // the walk's infinities and NaNs: 1.0
  }
  return w;
}

struct Result2 {
  std::vector<uint8_t> q;
  std::vector<float> s;
};

Result2 OnDevice(const std::vector<uint16_t>& w, const Fp8Layout& l, Status* st) {
  auto dw = DeviceBuffer::Allocate(0, w.size() * 2 + 2).value();
  auto dq = DeviceBuffer::Allocate(0, w.size() + 1).value();
  auto ds = DeviceBuffer::Allocate(0, static_cast<uint64_t>(l.NumScales()) * 4 + 4).value();
  EXPECT_TRUE(CopyToDevice(dw.data(), w.data(), w.size() * 2, 0).ok());
  Result2 r{std::vector<uint8_t>(w.size(), 0xAB), std::vector<float>(static_cast<size_t>(l.NumScales()), -2.0f)};
  EXPECT_TRUE(CopyToDevice(dq.data(), r.q.data(), r.q.size(), 0).ok());
  EXPECT_TRUE(CopyToDevice(ds.data(), r.s.data(), r.s.size() * 4, 0).ok());
  *st = QuantizeBf16ToFp8OnDevice(0, dw.data(), l, dq.data(), reinterpret_cast<float*>(ds.data()), "w");
  EXPECT_TRUE(CopyToHost(r.q.data(), dq.data(), r.q.size(), 0).ok());
  EXPECT_TRUE(CopyToHost(r.s.data(), ds.data(), r.s.size() * 4, 0).ok());
  return r;
}

TEST(GpuFp8Test, DeviceQuantizerGivesTheCpuBits) {
  RC_SKIP_WITHOUT_GPUS(1);
  const Fp8Layout layouts[] = {{Fp8Scheme::kPerTensor, 1024, 1000},   {Fp8Scheme::kPerTensor, 3, 7},
                               {Fp8Scheme::kPerChannel, 300, 513},    {Fp8Scheme::kBlock, 512, 768, 128, 128},
                               {Fp8Scheme::kBlock, 200, 333, 128, 128}, {Fp8Scheme::kBlock, 65, 70, 16, 32}};
  for (const Fp8Layout& l : layouts) {
    const auto w = Weights(l.NumElements(), static_cast<uint32_t>(l.rows * 31 + l.cols));
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales()));
    ASSERT_TRUE(formats::QuantizeBf16ToFp8Scalar(w, l, q, s, "w").ok());
    Status st;
    const Result2 d = OnDevice(w, l, &st);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_EQ(d.s.size(), s.size());
    for (size_t g = 0; g < s.size(); ++g) {
      uint32_t a, b;
      std::memcpy(&a, &d.s[g], 4);
      std::memcpy(&b, &s[g], 4);
      ASSERT_EQ(a, b) << formats::Fp8SchemeName(l.scheme) << " scale " << g;
    }
    size_t differ = 0;
    for (size_t i = 0; i < q.size(); ++i) {
      if (d.q[i] != q[i] && ++differ <= 5) {
        ADD_FAILURE() << formats::Fp8SchemeName(l.scheme) << " element " << i << " bf16 0x" << std::hex << w[i]
                      << ": gpu 0x" << int{d.q[i]} << " cpu 0x" << int{q[i]};
      }
    }
    EXPECT_EQ(differ, 0u) << l.rows << "x" << l.cols;
  }
}

TEST(GpuFp8Test, DeviceQuantizerRefusesWhatTheCpuRefuses) {
  RC_SKIP_WITHOUT_GPUS(1);
  const Fp8Layout l{Fp8Scheme::kBlock, 64, 300, 16, 128};
  auto w = Weights(l.NumElements(), 9);
  w[static_cast<size_t>(37 * 300 + 259)] = 0xFF80;
  Status st;
  const Result2 d = OnDevice(w, l, &st);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("w[37, 259] is -inf"), std::string::npos) << st.ToString();
  EXPECT_EQ(d.q, std::vector<uint8_t>(w.size(), 0xAB));
  EXPECT_EQ(d.s, std::vector<float>(d.s.size(), -2.0f));
}

// Zero and tiny groups: vLLM's arithmetic (a zero per-tensor scale, NaN clamped to 448, the block
// and channel floors) on the device as on the CPU.
TEST(GpuFp8Test, DegenerateGroupsMatchTheCpu) {
  RC_SKIP_WITHOUT_GPUS(1);
  std::vector<uint16_t> w(4 * 300, 0);
  w[5] = 0x0001;   // smallest bf16 subnormal in row 0
  w[6] = 0x8001;
  w[310] = 0x8000;  // -0 in row 1; rows 2 and 3 all zero
  for (const Fp8Layout& l : {Fp8Layout{Fp8Scheme::kPerTensor, 4, 300}, Fp8Layout{Fp8Scheme::kPerTensor, 1, 300},
                             Fp8Layout{Fp8Scheme::kPerChannel, 4, 300}, Fp8Layout{Fp8Scheme::kBlock, 4, 300, 2, 128}}) {
    const std::vector<uint16_t> part(w.begin(), w.begin() + l.NumElements());
    std::vector<uint8_t> q(part.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales()));
    ASSERT_TRUE(formats::QuantizeBf16ToFp8Scalar(part, l, q, s, "w").ok());
    Status st;
    const Result2 d = OnDevice(part, l, &st);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(d.q, q) << formats::Fp8SchemeName(l.scheme) << " " << l.rows;
    EXPECT_EQ(std::memcmp(d.s.data(), s.data(), s.size() * 4), 0) << formats::Fp8SchemeName(l.scheme);
  }
}

}  // namespace
}  // namespace rc::cuda
