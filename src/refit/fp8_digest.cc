#include "rolloutcore/refit/fp8_digest.h"

#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/digest.h"

namespace rc::refit {

ContentDigest Fp8ImageDigest::Combined() const {
  static constexpr char kTag[] = "rc-fp8-image-1";
  std::array<unsigned char, sizeof(kTag) - 1 + 16> buf{};
  std::memcpy(buf.data(), kTag, sizeof(kTag) - 1);
  std::memcpy(buf.data() + sizeof(kTag) - 1, &bytes, 8);
  std::memcpy(buf.data() + sizeof(kTag) - 1 + 8, &scales, 8);
  return ContentDigest(Hash64(buf.data(), buf.size()));
}

Fp8ImageDigest Fp8ImagePart(const Shape& param, const Box& q_box, const uint8_t* q, const Shape& grid,
                            const Box& s_box, const float* s) {
  Fp8ImageDigest d;
  if (q_box.numel() > 0) d.bytes = DigestBlock(DType::kF8E4M3, param, q_box, q);
  if (s_box.numel() > 0) d.scales = DigestBlock(DType::kF32, grid, s_box, s);
  return d;
}

ContentDigest Fp8ImageCombined(const Fp8Image& image) {
  TensorDigests combined;
  for (const auto& [name, d] : image) combined[name] = d.Combined().value();
  return ContentDigest(CombineTensorDigests(combined));
}

bool IsFp8Quantization(std::string_view quantization) {
  return std::find(std::begin(kFp8Quantizations), std::end(kFp8Quantizations), quantization) !=
         std::end(kFp8Quantizations);
}

namespace {

// The parts a fused parameter must have, by its projection name.
std::vector<std::string_view> PartsOf(std::string_view fused) {
  if (fused == "qkv") return {"q", "k", "v"};
  if (fused == "gate_up") return {"gate", "up"};
  return {fused};
}

}  // namespace

std::optional<Fp8PartOf> Fp8ParameterOf(std::string_view tensor) {
  // PREFIX.(self_attn|mlp).(q|k|v|o|gate|up|down)_proj.weight, matched by hand: std::regex recurses
  // once per character, and a long tensor name (a publish body, 30000 characters) overflowed the
  // stack of whichever process read it.
  constexpr std::string_view kSuffix = "_proj.weight";
  if (tensor.size() <= kSuffix.size() || tensor.substr(tensor.size() - kSuffix.size()) != kSuffix) return std::nullopt;
  const std::string_view head = tensor.substr(0, tensor.size() - kSuffix.size());  // PREFIX.BLOCK.P
  const size_t dot_p = head.rfind('.');
  if (dot_p == std::string_view::npos) return std::nullopt;
  const std::string_view p = head.substr(dot_p + 1);
  const bool attn = p == "q" || p == "k" || p == "v" || p == "o";
  const bool mlp = p == "gate" || p == "up" || p == "down";
  if (!attn && !mlp) return std::nullopt;
  const std::string_view rest = head.substr(0, dot_p);  // PREFIX.BLOCK
  const size_t dot_block = rest.rfind('.');
  if (dot_block == std::string_view::npos) return std::nullopt;
  const std::string_view block = rest.substr(dot_block + 1);
  if (block != "self_attn" && block != "mlp") return std::nullopt;
  const std::string_view prefix = rest.substr(0, dot_block);  // may be empty, as (.*) allowed
  std::string fused(p);
  if (p == "q" || p == "k" || p == "v") fused = "qkv";
  if (p == "gate" || p == "up") fused = "gate_up";
  return Fp8PartOf{fmt::format("{}.{}.{}_proj.weight", prefix, block, fused), std::string(p)};
}

const Fp8Param::Part* Fp8Param::Find(std::string_view tensor) const {
  for (const Part& p : parts) {
    if (p.tensor == tensor) return &p;
  }
  return nullptr;
}

Result<std::map<std::string, Fp8Param, std::less<>>> Fp8Parameters(const std::vector<TensorSpec>& tensors) {
  std::map<std::string, std::map<std::string, const TensorSpec*>> by_param;  // param -> part -> tensor
  for (const TensorSpec& t : tensors) {
    auto of = Fp8ParameterOf(t.name);
    if (!of) continue;
    if (t.dtype != DType::kBF16 || t.shape.size() != 2) {
      return InvalidArgument(fmt::format("tensor {} is {} {}: FP8 parameters are quantized from 2-D BF16 weights",
                                         t.name, DTypeName(t.dtype), ShapeToString(t.shape)));
    }
    by_param[of->param][of->part] = &t;
  }
  std::map<std::string, Fp8Param, std::less<>> out;
  for (const auto& [name, parts] : by_param) {
    Fp8Param p;
    p.name = name;
    const std::string fused = name.substr(0, name.size() - std::string_view("_proj.weight").size());
    const std::string kind = fused.substr(fused.rfind('.') + 1);
    for (std::string_view need : PartsOf(kind)) {
      if (!parts.count(std::string(need))) {
        return InvalidArgument(fmt::format("FP8 parameter {}: its {}_proj is missing beside {}", name, need,
                                           parts.begin()->second->name));
      }
    }
    int64_t rows = 0;
    for (std::string_view k : kFp8PartOrder) {
      auto it = parts.find(std::string(k));
      if (it == parts.end()) continue;
      const TensorSpec& t = *it->second;
      if (!p.parts.empty() && t.shape[1] != p.parts.front().shape[1]) {
        return InvalidArgument(fmt::format("FP8 parameter {}: {} has {} columns, {} has {}", name, t.name, t.shape[1],
                                           p.parts.front().tensor, p.parts.front().shape[1]));
      }
      p.parts.push_back({t.name, rows, t.shape});
      rows += t.shape[0];
    }
    p.shape = {rows, p.parts.front().shape[1]};
    out.emplace(name, std::move(p));
  }
  return out;
}

}  // namespace rc::refit
