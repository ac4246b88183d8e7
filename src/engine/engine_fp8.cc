// The embedded engine's FP8 serving (docs/fp8.md, "The embedded engine"): quantizing the FP8 image
// at every install, its digests, and the test-only faults of the image (the negative controls).
#include <algorithm>
#include <chrono>
#include <utility>

#include <fmt/format.h>

#include "engine/fp8_weights.h"
#include "engine/model.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/engine/engine.h"

namespace rc::engine {

Result<Fp8Fault> Fp8FaultFromName(std::string_view name) {
  for (Fp8Fault f : {Fp8Fault::kNone, Fp8Fault::kWrongScale, Fp8Fault::kStaleScales, Fp8Fault::kSwizzledScales,
                     Fp8Fault::kStaleImage, Fp8Fault::kSelfConsistentWrongScale}) {
    if (name == Fp8FaultName(f)) return f;
  }
  return InvalidArgument(fmt::format("fp8 fault '{}': expected one of none, wrong_scale, stale_scales, swizzled_scales, "
                                     "stale_image, self_consistent_wrong_scale",
                                     name));
}

std::string_view Fp8FaultName(Fp8Fault fault) {
  switch (fault) {
    case Fp8Fault::kNone: return "none";
    case Fp8Fault::kWrongScale: return "wrong_scale";
    case Fp8Fault::kStaleScales: return "stale_scales";
    case Fp8Fault::kSwizzledScales: return "swizzled_scales";
    case Fp8Fault::kStaleImage: return "stale_image";
    case Fp8Fault::kSelfConsistentWrongScale: return "self_consistent_wrong_scale";
  }
  return "?";
}

std::string Fp8ImageReport::FirstMismatch() const {
  if (!live_error.empty()) return live_error;
  for (const auto& [name, want] : expected) {
    auto it = live.find(name);
    if (it == live.end()) return name + ": no live FP8 image";
    if (it->second != want) {
      return fmt::format("{}: live bytes {} scales {}, expected bytes {} scales {}", name,
                         ContentDigest(it->second.bytes).ToHex(), ContentDigest(it->second.scales).ToHex(),
                         ContentDigest(want.bytes).ToHex(), ContentDigest(want.scales).ToHex());
    }
  }
  for (const auto& [name, got] : live) {
    if (!expected.contains(name)) return name + ": live FP8 image with no expected digest";
  }
  return "";
}

Json Fp8ImageReport::ToJson() const {
  Json params = Json::object();
  for (const auto& [name, want] : expected) {
    Json p{{"expected", want.Combined().ToHex()}};
    auto it = live.find(name);
    if (it != live.end()) {
      p["live"] = it->second.Combined().ToHex();
      p["bytes_match"] = it->second.bytes == want.bytes;
      p["scales_match"] = it->second.scales == want.scales;
    }
    params[name] = std::move(p);
  }
  Json j{{"quantization", quantization},
         {"expected_digest", expected_digest.ToHex()},
         {"match", Match()},
         {"ms", ms},
         {"parameters", std::move(params)}};
  if (live_error.empty()) {
    j["live_digest"] = live_digest.ToHex();
  } else {
    j["live_digest"] = nullptr;
    j["live_error"] = live_error;
  }
  if (!Match()) j["mismatch"] = FirstMismatch();
  return j;
}

Result<Fp8ImageReport> Engine::Fp8Digests() {
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  const Fp8Weights* fp8 = model_->fp8();
  if (fp8 == nullptr) return FailedPrecondition("the engine does not serve FP8 (no --quantization)");
  const auto t0 = std::chrono::steady_clock::now();
  Fp8ImageReport out;
  out.quantization = options_.quantization;
  RC_ASSIGN_OR_RETURN(out.expected, fp8->Expected(model_->AllParams(), pool_->num_threads()));
  out.expected_digest = refit::Fp8ImageCombined(out.expected);
  auto live = fp8->Live();
  if (live.ok()) {
    out.live = std::move(live).value();
    out.live_digest = refit::Fp8ImageCombined(out.live);
    if (fp8_expected_from_live_) {  // the fault kSelfConsistentWrongScale: a self-check that reads the image
      out.expected = out.live;
      out.expected_digest = out.live_digest;
    }
  } else {
    out.live_error = live.status().message();
  }
  out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

Status Engine::SetFp8FaultForTesting(Fp8Fault fault) {
  rc::PriorityLock sl(step_mu_, step_turnstile_);
  if (model_->fp8() == nullptr && fault != Fp8Fault::kNone) {
    return FailedPrecondition("fp8 fault " + std::string(Fp8FaultName(fault)) +
                              ": the engine does not serve FP8 (no --quantization)");
  }
  if (fault == Fp8Fault::kSwizzledScales && model_->fp8()->scheme() == formats::Fp8Scheme::kPerTensor) {
    return InvalidArgument("fp8 fault swizzled_scales: fp8_per_tensor has one scale per parameter, nothing to re-lay out");
  }
  fp8_fault_ = fault;
  return OkStatus();
}

Status Engine::QuantizeAfterInstall() {
  Fp8Weights* fp8 = model_->mutable_fp8();
  if (fp8 == nullptr) return OkStatus();
  const Fp8Fault fault = std::exchange(fp8_fault_, Fp8Fault::kNone);
  fp8_expected_from_live_ = fault == Fp8Fault::kSelfConsistentWrongScale;
  std::vector<Fp8Weights::Buffer> before;
  if (fault == Fp8Fault::kStaleScales || fault == Fp8Fault::kStaleImage) {
    for (Fp8Weights::Buffer* b : fp8->BuffersForTesting()) before.push_back(*b);
  }
  if (fault != Fp8Fault::kStaleImage) RC_RETURN_IF_ERROR(model_->Quantize().WithContext("fp8 quantization"));
  if (fault == Fp8Fault::kNone) return OkStatus();
  std::vector<Fp8Weights::Buffer*> bufs = fp8->BuffersForTesting();
  for (size_t i = 0; i < bufs.size(); ++i) {
    Fp8Weights::Buffer& b = *bufs[i];
    switch (fault) {
      case Fp8Fault::kWrongScale:
      case Fp8Fault::kSelfConsistentWrongScale:
        for (float& s : b.row_scales) s *= 2.0f;
        break;
      case Fp8Fault::kStaleScales: b.row_scales = before[i].row_scales; break;
      case Fp8Fault::kStaleImage: b = before[i]; break;
      case Fp8Fault::kSwizzledScales: {
        const std::ptrdiff_t sc = b.scale_cols;
        auto row = [&](int64_t r) { return b.row_scales.begin() + r * sc; };
        if (fp8->scheme() == formats::Fp8Scheme::kPerChannel) {
          // Rows exchanged pairwise: a layout with another row order.
          for (int64_t r = 0; r + 1 < b.rows; r += 2) std::swap_ranges(row(r), row(r) + sc, row(r + 1));
        } else {
          // Block: 128-row block rows exchanged pairwise, each row's column groups reversed.
          for (int64_t r = 0; r < b.rows; ++r) {
            const int64_t partner = r ^ 128;
            if (partner > r && partner < b.rows) std::swap_ranges(row(r), row(r) + sc, row(partner));
            std::reverse(row(r), row(r) + sc);
          }
        }
        break;
      }
      case Fp8Fault::kNone: break;
    }
  }
  RC_LOG_WARN("engine: fault injection: FP8 image after the install: {}", Fp8FaultName(fault));
  return model_->Bind();
}

}  // namespace rc::engine
