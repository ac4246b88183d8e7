// FP8 serving in the embedded engine (docs/fp8.md, "The embedded engine"): parity against a
// reference model that holds the dequantized weights in f32, the FP8 image's digests, and the faults
// the proof must catch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "engine/fp8_weights.h"
#include "engine/model.h"
#include "engine/thread_pool.h"
#include "rolloutcore/engine/engine.h"
#include "rolloutcore/engine/loader.h"
#include "rolloutcore/formats/fp8.h"

namespace rc::engine {
namespace {

// HF tensors as f32: the reference model's weights.
class F32Source : public TensorSource {
 public:
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> tensors;
  Result<SourceTensor> Get(std::string_view name) override {
    auto it = tensors.find(std::string(name));
    if (it == tensors.end()) return NotFound(std::string(name));
    SourceTensor t;
    t.dtype = DType::kF32;
    t.shape = it->second.first;
    t.bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(it->second.second.data()),
                                       it->second.second.size() * sizeof(float));
    return t;
  }
};

std::vector<uint16_t> Bf16Of(TensorSource* src, const std::string& name) {
  auto t = src->Get(name);
  EXPECT_TRUE(t.ok()) << name;
  EXPECT_EQ(t->dtype, DType::kBF16) << name;
  std::vector<uint16_t> v(t->bytes.size() / 2);
  std::memcpy(v.data(), t->bytes.data(), t->bytes.size());
  return v;
}

// The reference: every projection vLLM quantizes, fused as vLLM fuses it, quantized as one whole
// matrix by formats::QuantizeBf16ToFp8 and dequantized back to f32 (formats::DequantizeFp8ToF32),
// then split into the HF tensors again; every other tensor widened from bf16. Nothing of the
// engine's sharded quantization is used.
F32Source DequantizedReference(const ModelSpec& spec, TensorSource* bf16, formats::Fp8Scheme scheme) {
  F32Source out;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& d : HfTensorDecls(spec)) shapes[d.name] = d.shape;
  std::map<std::string, bool> done;
  auto quantize_group = [&](const std::vector<std::string>& parts) {
    std::vector<uint16_t> fused;
    int64_t rows = 0;
    const int64_t cols = shapes[parts[0]][1];
    for (const auto& n : parts) {
      auto v = Bf16Of(bf16, n);
      fused.insert(fused.end(), v.begin(), v.end());
      rows += shapes[n][0];
    }
    formats::Fp8Layout l{scheme, rows, cols};
    std::vector<uint8_t> q(fused.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales()));
    ASSERT_TRUE(formats::QuantizeBf16ToFp8(fused, l, q, s, parts[0]).ok());
    std::vector<float> deq(fused.size());
    ASSERT_TRUE(formats::DequantizeFp8ToF32(q, s, l, deq).ok());
    size_t at = 0;
    for (const auto& n : parts) {
      const size_t len = static_cast<size_t>(shapes[n][0] * cols);
      out.tensors[n] = {shapes[n], std::vector<float>(deq.begin() + static_cast<std::ptrdiff_t>(at),
                                                      deq.begin() + static_cast<std::ptrdiff_t>(at + len))};
      at += len;
      done[n] = true;
    }
  };
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    quantize_group({p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"});
    quantize_group({p + "self_attn.o_proj.weight"});
    quantize_group({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"});
    quantize_group({p + "mlp.down_proj.weight"});
  }
  for (const auto& [name, shape] : shapes) {
    if (done[name]) continue;
    auto v = Bf16Of(bf16, name);
    std::vector<float> f(v.size());
    for (size_t k = 0; k < v.size(); ++k) {
      const uint32_t u = static_cast<uint32_t>(v[k]) << 16;
      std::memcpy(&f[k], &u, 4);
    }
    out.tensors[name] = {shape, std::move(f)};
  }
  return out;
}

struct ParityCase {
  const char* quantization;
  int tp;
};

class Fp8ParityTest : public ::testing::TestWithParam<ParityCase> {};

// The FP8 engine computes, bit for bit, what an f32 engine computes over the dequantized weights:
// every logits row of a prefill and of the decode steps after it.
TEST_P(Fp8ParityTest, FP8ModelEqualsTheF32ModelOverTheDequantizedWeights) {
  const ParityCase c = GetParam();
  auto spec = ResolveModel("tiny");
  ASSERT_TRUE(spec.ok());
  auto scheme = formats::Fp8SchemeFromVllmQuantization(c.quantization);
  ASSERT_TRUE(scheme.ok());
  ThreadPool pool(2);
  auto fp8 = Model::Create(*spec, c.tp, 8, 16, &pool, DType::kBF16, *scheme);
  ASSERT_TRUE(fp8.ok()) << fp8.status().ToString();
  auto ref = Model::Create(*spec, c.tp, 8, 16, &pool, DType::kF32);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  auto bf16 = MakeDummySource(*spec, 21);
  F32Source deq = DequantizedReference(*spec, bf16.get(), *scheme);
  for (int r = 0; r < c.tp; ++r) {
    ASSERT_TRUE(LoadRank(*spec, (*fp8)->layout(r), bf16.get(), &(*fp8)->params(r)).ok());
    ASSERT_TRUE(LoadRank(*spec, (*ref)->layout(r), &deq, &(*ref)->params(r)).ok());
  }
  ASSERT_TRUE((*fp8)->Quantize().ok());
  ASSERT_TRUE((*ref)->Bind().ok());

  std::vector<int32_t> tokens = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46};
  std::vector<int32_t> blocks = {0};
  std::vector<float> a, b;
  ForwardSeq s{tokens.data(), static_cast<int64_t>(tokens.size()), 0, &blocks, true,
               static_cast<int64_t>(tokens.size())};
  ASSERT_TRUE((*fp8)->Forward({s}, &a).ok());
  ASSERT_TRUE((*ref)->Forward({s}, &b).ok());
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "prefill logits differ";
  // Greedy decode steps on each model's own KV.
  int32_t next = tokens.back();
  for (int step = 0; step < 4; ++step) {
    const auto V = static_cast<size_t>(spec->vocab_size);
    next = static_cast<int32_t>(std::max_element(a.end() - static_cast<std::ptrdiff_t>(V), a.end()) -
                                (a.end() - static_cast<std::ptrdiff_t>(V)));
    a.clear();
    b.clear();
    ForwardSeq d{&next, 1, static_cast<int64_t>(tokens.size()) + step, &blocks, true, 1};
    ASSERT_TRUE((*fp8)->Forward({d}, &a).ok());
    ASSERT_TRUE((*ref)->Forward({d}, &b).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "decode step " << step;
  }
  // And not what the bf16 weights compute: the FP8 image is really used.
  auto plain = Model::Create(*spec, c.tp, 8, 16, &pool, DType::kBF16);
  ASSERT_TRUE(plain.ok());
  auto bf16b = MakeDummySource(*spec, 21);
  for (int r = 0; r < c.tp; ++r) ASSERT_TRUE(LoadRank(*spec, (*plain)->layout(r), bf16b.get(), &(*plain)->params(r)).ok());
  ASSERT_TRUE((*plain)->Bind().ok());
  std::vector<float> p, q;
  ASSERT_TRUE((*plain)->Forward({s}, &p).ok());
  ASSERT_TRUE((*fp8)->Forward({s}, &q).ok());
  EXPECT_NE(std::memcmp(p.data(), q.data(), p.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Schemes, Fp8ParityTest,
                         ::testing::Values(ParityCase{"fp8_per_tensor", 1}, ParityCase{"fp8_per_channel", 1},
                                           ParityCase{"fp8_per_block", 1}, ParityCase{"fp8_per_tensor", 2},
                                           ParityCase{"fp8_per_channel", 2}, ParityCase{"fp8_per_tensor", 4}),
                         [](const ::testing::TestParamInfo<ParityCase>& p) {
                           return std::string(p.param.quantization) + "_tp" + std::to_string(p.param.tp);
                         });

std::unique_ptr<Engine> MakeEngine(const std::string& quantization, int tp, uint64_t seed = 5) {
  EngineOptions o;
  o.tensor_parallel_size = tp;
  o.num_threads = 2;
  o.max_model_len = 64;
  o.quantization = quantization;
  auto e = CreateEngine({"tiny", "dummy", seed}, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// Live == expected, for every scheme and a tp with replicated kv heads (tp 4 > 2 kv heads), and the
// same digests as the whole-matrix quantization the reference uses.
TEST(Fp8EngineTest, LiveImageDigestEqualsTheExpectedOne) {
  for (auto [q, tp] : {std::pair{"fp8_per_tensor", 1}, {"fp8_per_channel", 2}, {"fp8_per_block", 1}, {"fp8_per_tensor", 4},
                       {"fp8_per_channel", 4}}) {
    auto e = MakeEngine(q, tp);
    ASSERT_NE(e, nullptr);
    auto r = e->Fp8Digests();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->Match()) << q << " tp " << tp << ": " << r->FirstMismatch();
    EXPECT_EQ(r->live.size(), 2u * 4u) << "tiny: 2 layers x 4 projections";
    EXPECT_EQ(r->live_digest, r->expected_digest);
    // The same image at another tp has the same digest: the digest is in the whole parameter's coordinates.
    auto one = MakeEngine(q, 1);
    auto r1 = one->Fp8Digests();
    ASSERT_TRUE(r1.ok());
    EXPECT_EQ(r1->live_digest, r->live_digest) << q << " tp " << tp << " vs tp 1";
  }
}

TEST(Fp8EngineTest, RefusesWhatItCannotServe) {
  EngineOptions o;
  o.quantization = "fp8";
  auto bad = CreateEngine({"tiny", "dummy", 1}, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fp8_per_tensor"), std::string::npos) << bad.status().ToString();
  // Block scales with tp 2: rank 1's columns of o_proj start at column 32, inside a 128-column block.
  o.quantization = "fp8_per_block";
  o.tensor_parallel_size = 2;
  auto block = CreateEngine({"tiny", "dummy", 1}, o);
  ASSERT_FALSE(block.ok());
  EXPECT_NE(block.status().message().find("o_proj"), std::string::npos) << block.status().ToString();
  // F32 weights are not quantized.
  o.tensor_parallel_size = 1;
  o.quantization = "fp8_per_channel";
  auto f32 = CreateEngine({"tiny", "dummy", 1, "f32"}, o);
  ASSERT_FALSE(f32.ok());
  EXPECT_NE(f32.status().message().find("BF16"), std::string::npos) << f32.status().ToString();
}

// A copy that disagrees with the copy digested is caught by the replica check: kv-head rows held
// by two ranks (tp 4 > 2 kv heads), and a per-tensor scale every row holds. A consistent change (an
// owner's byte) is caught by the digest.
TEST(Fp8EngineTest, DisagreeingReplicasAndChangedBytesAreCaught) {
  auto spec = ResolveModel("tiny");
  ASSERT_TRUE(spec.ok());
  ThreadPool pool(1);
  auto m = Model::Create(*spec, 4, 8, 16, &pool, DType::kBF16, formats::Fp8Scheme::kPerTensor);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto src = MakeDummySource(*spec, 3);
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(LoadRank(*spec, (*m)->layout(r), src.get(), &(*m)->params(r)).ok());
  ASSERT_TRUE((*m)->Quantize().ok());
  Fp8Weights* fp8 = (*m)->mutable_fp8();
  auto expected = fp8->Expected((*m)->AllParams(), 1);
  ASSERT_TRUE(expected.ok());
  ASSERT_EQ(*fp8->Live(), *expected);
  const std::string qkv = "model.layers.1.self_attn.qkv_proj.weight";
  const int64_t k_row = (*m)->layout(1).q_heads * spec->head_dim;  // rank 1's first k row: a copy of rank 0's
  {
    Fp8Weights::Buffer* b = fp8->MutableForTesting(1, qkv);
    ASSERT_NE(b, nullptr);
    b->q[static_cast<size_t>(k_row * b->cols)] ^= 0x01;
    auto live = fp8->Live();
    ASSERT_FALSE(live.ok());
    EXPECT_EQ(live.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(live.status().message().find("rank 1"), std::string::npos) << live.status().ToString();
    b->q[static_cast<size_t>(k_row * b->cols)] ^= 0x01;
  }
  {
    Fp8Weights::Buffer* b = fp8->MutableForTesting(2, qkv);
    b->row_scales[5] *= 2.0f;  // one row's copy of the per-tensor scale
    auto live = fp8->Live();
    ASSERT_FALSE(live.ok());
    EXPECT_NE(live.status().message().find("copies of one scale must agree"), std::string::npos)
        << live.status().ToString();
    b->row_scales[5] /= 2.0f;
  }
  ASSERT_EQ(*fp8->Live(), *expected);
  {
    Fp8Weights::Buffer* b = fp8->MutableForTesting(0, qkv);  // rank 0 owns its q rows and its kv head's rows
    b->q[0] ^= 0x01;
    auto live = fp8->Live();
    ASSERT_TRUE(live.ok()) << live.status().ToString();
    EXPECT_NE((*live)[qkv].bytes, (*expected)[qkv].bytes);
    EXPECT_EQ((*live)[qkv].scales, (*expected)[qkv].scales);
    b->q[0] ^= 0x01;
  }
}

// Each negative control of docs/fp8.md, armed before an install, leaves an image whose digest is not
// the expected one; the next install without a fault is clean again.
TEST(Fp8EngineTest, EveryFaultOfTheImageFailsTheProof) {
  for (auto [q, tp] : {std::pair{"fp8_per_channel", 2}, {"fp8_per_block", 1}, {"fp8_per_tensor", 1}}) {
    auto e = MakeEngine(q, tp, 5);
    ASSERT_NE(e, nullptr);
    // Two versions' bf16 weights, installed in turn, so that "the previous version" always differs.
    auto va = MakeEngine("", tp, 6);
    auto vb = MakeEngine("", tp, 7);
    ASSERT_NE(va, nullptr);
    ASSERT_NE(vb, nullptr);
    int64_t gen = 1;
    auto install_next = [&]() -> Status {
      const int64_t g = gen++;
      const Engine* from = g % 2 == 1 ? va.get() : vb.get();
      return e->InstallLive(
          [&](int rank, ParameterStore* ps) -> Status {
            for (const auto& [name, dst] : ps->all()) {
              const Parameter* src = from->Parameters(rank).Find(name);
              if (src == nullptr || !dst.alias_of.empty()) continue;
              std::memcpy(dst.bytes(), src->bytes(), dst.nbytes());
              // Dummy weights have the same magnitude everywhere, so every group of a version would
              // get the same scale, and so would every version: no scale fault could show. Scale
              // the rows of the projections by powers of two (exact in bf16) that vary by row, by
              // 128-row block and by version.
              if (name.find("_proj.weight") == std::string::npos || dst.shape.size() != 2) continue;
              uint16_t* w = dst.bf16();
              for (int64_t r = 0; r < dst.shape[0]; ++r) {
                const auto bump = static_cast<uint16_t>((r % 3) + (r / 128) + g % 3);
                for (int64_t c = 0; c < dst.shape[1]; ++c) {
                  uint16_t& b = w[r * dst.shape[1] + c];
                  if ((b & 0x7F80) != 0) b = static_cast<uint16_t>(b + (bump << 7));
                }
              }
            }
            return OkStatus();
          },
          "v" + std::to_string(g), g, true, receiver::InstallWrites::kInPlace);
    };
    ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
    for (Fp8Fault f : {Fp8Fault::kWrongScale, Fp8Fault::kStaleScales, Fp8Fault::kSwizzledScales, Fp8Fault::kStaleImage}) {
      if (f == Fp8Fault::kSwizzledScales && std::string(q) == "fp8_per_tensor") {
        EXPECT_EQ(e->SetFp8FaultForTesting(f).code(), StatusCode::kInvalidArgument);
        continue;
      }
      ASSERT_TRUE(e->SetFp8FaultForTesting(f).ok());
      ASSERT_TRUE(install_next().ok());
      auto r = e->Fp8Digests();
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_FALSE(r->Match()) << q << " " << Fp8FaultName(f) << ": the proof missed it";
      ASSERT_TRUE(install_next().ok());
      auto clean = e->Fp8Digests();
      ASSERT_TRUE(clean.ok());
      EXPECT_TRUE(clean->Match()) << q << " after " << Fp8FaultName(f) << ": " << clean->FirstMismatch();
    }
    e->Resume();
  }
}

}  // namespace
}  // namespace rc::engine

namespace rc::engine {
namespace {

// How far an FP8 engine's replay is from the bf16 reference (the trainer's probes), and how far a
// wrong model is (replay validation's negative control: two query heads of layer 0 exchanged, which
// the content digest cannot see), over the same probes: per greedy step, |logprob difference| of
// the reference's token, and the steps where the greedy token differs. docs/fp8.md "Replay
// validation" records the figures and why no bound is chosen from them yet;
// ROLLOUTCORE_FP8_REPLAY_MODEL=qwen3-0.6b-like measures that shape.
struct ReplayGap {
  double worst = 0;     // largest |logprob diff| over the compared steps
  int64_t steps = 0;    // steps compared (up to the first different token of each probe)
  int64_t diverged = 0; // probes whose greedy continuation differs somewhere
};

ReplayGap Gap(Engine* ref, Engine* other, const std::vector<std::vector<int32_t>>& prompts, int64_t steps) {
  ReplayGap g;
  for (const auto& p : prompts) {
    auto a = ref->Replay(p, steps, 5, false);
    auto b = other->Replay(p, steps, 5, false);
    EXPECT_TRUE(a.ok() && b.ok());
    if (!a.ok() || !b.ok()) return g;
    for (size_t i = 0; i < a->steps.size() && i < b->steps.size(); ++i) {
      g.worst = std::max(g.worst, std::abs(static_cast<double>(a->steps[i].logprob) - b->steps[i].logprob));
      ++g.steps;
      if (a->steps[i].token != b->steps[i].token) {
        ++g.diverged;
        break;
      }
    }
  }
  return g;
}

TEST(Fp8ReplayTest, QuantizationNoiseAgainstAWrongModel) {
  const char* env = std::getenv("ROLLOUTCORE_FP8_REPLAY_MODEL");
  const std::string model = env != nullptr ? env : "tiny";
  auto make = [&](const std::string& q) {
    EngineOptions o;
    o.num_threads = 2;
    o.max_model_len = 128;
    o.quantization = q;
    auto e = CreateEngine({model, "dummy", 17}, o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(e).value() : nullptr;
  };
  auto ref = make("");
  ASSERT_NE(ref, nullptr);
  const int64_t vocab = ref->spec().vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) {
    std::vector<int32_t> p;
    p.reserve(12);
    for (int k = 0; k < 12; ++k) p.push_back(static_cast<int32_t>((i * 7919 + k * 104729 + 13) % vocab));
    prompts.push_back(p);
  }
  constexpr int64_t kSteps = 16;
  // The wrong model: query heads 0 and 1 of layer 0 exchanged in the bf16 weights.
  auto wrong = make("");
  ASSERT_NE(wrong, nullptr);
  const int64_t d = wrong->spec().head_dim, h = wrong->spec().hidden_size;
  ASSERT_TRUE(wrong->WriteLiveForTesting(0, [&](ParameterStore* ps) -> Status {
                const Parameter* p = ps->Find("model.layers.0.self_attn.qkv_proj.weight");
                if (p == nullptr) return NotFound("qkv_proj");
                std::byte* b = p->bytes();
                const size_t row = static_cast<size_t>(h) * DTypeSize(p->dtype), head = row * static_cast<size_t>(d);
                std::vector<std::byte> tmp(b, b + head);
                std::memcpy(b, b + head, head);
                std::memcpy(b + head, tmp.data(), head);
                return OkStatus();
              }).ok());
  for (Engine* e : {ref.get(), wrong.get()}) ASSERT_TRUE(e->Pause(PauseMode::kWait).ok());
  const ReplayGap signal = Gap(ref.get(), wrong.get(), prompts, kSteps);
  if (env == nullptr) {
    // tiny: the wrong model's greedy tokens differ on every probe (on larger random-weight models
    // some probes stay on their path: the figures are printed only).
    EXPECT_EQ(signal.diverged, static_cast<int64_t>(prompts.size()));
  }
  std::printf("fp8 replay %s: wrong model (q heads 0,1 of layer 0 exchanged): worst |dlogprob| %.3g over %lld steps, "
              "%lld of %zu probes diverge\n",
              model.c_str(), signal.worst, static_cast<long long>(signal.steps),
              static_cast<long long>(signal.diverged), prompts.size());
  for (const char* q : {"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"}) {
    auto fp8 = make(q);
    ASSERT_NE(fp8, nullptr);
    ASSERT_TRUE(fp8->Pause(PauseMode::kWait).ok());
    const ReplayGap noise = Gap(ref.get(), fp8.get(), prompts, kSteps);
    std::printf("fp8 replay %s: %s against bf16: worst |dlogprob| %.3g over %lld steps, %lld of %zu probes diverge\n",
                model.c_str(), q, noise.worst, static_cast<long long>(noise.steps),
                static_cast<long long>(noise.diverged), prompts.size());
    EXPECT_GT(noise.worst, 0.0) << q << ": the FP8 engine computes what the bf16 one does";
    fp8->Resume();
  }
  for (Engine* e : {ref.get(), wrong.get()}) e->Resume();
}

}  // namespace
}  // namespace rc::engine
