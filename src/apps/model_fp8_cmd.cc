// `rolloutcore model fp8-digest FOLDER`: the FP8 image that vLLM 0.33 serves from a bf16 checkpoint
// (--quantization fp8_per_tensor / fp8_per_channel / fp8_per_block), computed from the checkpoint alone,
// and its digest per vLLM parameter (docs/fp8.md). The projections of each layer are fused as vLLM
// fuses them (q, k, v -> qkv_proj; gate, up -> gate_up_proj), since vLLM's per-tensor scale spans
// the fused parameter; embeddings, lm_head and norms stay bf16, as vLLM's online methods leave them.
#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "apps/commands.h"
#include "rolloutcore/base/json.h"
#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/formats/safetensors.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/fp8_digest.h"

namespace rc::apps {
namespace {

struct Flags {
  std::string folder;
  std::string scheme = "per_tensor";
  int threads = 0;
  bool json = false;
};

// vLLM's parameter name and its parts in order, for each quantized projection of the checkpoint.
std::map<std::string, std::vector<std::string>> FusedParameters(const std::vector<std::string>& names,
                                                                std::vector<std::string>* untouched) {
  std::map<std::string, std::map<std::string, std::string>> parts;  // parameter -> part -> tensor
  for (const std::string& n : names) {
    auto of = refit::Fp8ParameterOf(n);
    if (!of) {
      untouched->push_back(n);
      continue;
    }
    parts[of->param][of->part] = n;
  }
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [param, by_part] : parts) {
    for (std::string_view p : refit::kFp8PartOrder) {
      auto it = by_part.find(std::string(p));
      if (it != by_part.end()) out[param].push_back(it->second);
    }
  }
  return out;
}

Status Run(const Flags& f, std::ostream& out) {
  RC_ASSIGN_OR_RETURN(const formats::Fp8Scheme scheme, formats::Fp8SchemeFromName(f.scheme));
  RC_ASSIGN_OR_RETURN(auto folder, formats::SafetensorsFolder::Open(f.folder));
  const int threads = f.threads > 0 ? f.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::string> untouched;
  const auto params = FusedParameters(folder->Names(), &untouched);
  if (params.empty()) {
    return InvalidArgument(fmt::format("{}: no q/k/v/o/gate/up/down_proj weights to quantize", f.folder));
  }
  const auto t0 = std::chrono::steady_clock::now();
  Json report{{"folder", f.folder},
              {"scheme", f.scheme},
              {"vllm_quantization", std::string(formats::Fp8VllmQuantization(scheme))}};
  Json per = Json::object();
  refit::TensorDigests combined;
  size_t done = 0;
  for (const auto& [param, parts] : params) {
    // The fused bf16 matrix: the parts' rows one after the other.
    std::vector<uint16_t> w;
    int64_t rows = 0, cols = -1;
    for (const std::string& name : parts) {
      RC_ASSIGN_OR_RETURN(auto t, folder->Find(name));
      if (t.entry->dtype != formats::DType::kBF16 || t.entry->shape.size() != 2) {
        return InvalidArgument(fmt::format("{}: {} is {} {}-D; the fp8 quantizer takes 2-D BF16 weights", f.folder, name,
                                           formats::DTypeName(t.entry->dtype), t.entry->shape.size()));
      }
      if (cols >= 0 && t.entry->shape[1] != cols) {
        return InvalidArgument(fmt::format("{}: {} has {} columns, the other parts of {} have {}", f.folder, name,
                                           t.entry->shape[1], param, cols));
      }
      cols = t.entry->shape[1];
      rows += t.entry->shape[0];
      const size_t at = w.size();
      w.resize(at + t.bytes.size() / 2);
      std::memcpy(w.data() + at, t.bytes.data(), t.bytes.size());
    }
    formats::Fp8Layout l{scheme, rows, cols};
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(static_cast<size_t>(l.NumScales()));
    RC_RETURN_IF_ERROR(formats::QuantizeBf16ToFp8(w, l, q, s, param, threads));
    const refit::Shape shape{rows, cols};
    const auto g = l.ScaleGrid();
    const refit::Shape grid{g[0], g[1]};
    const refit::Fp8ImageDigest d =
        refit::Fp8ImagePart(shape, refit::FullBox(shape), q.data(), grid, refit::FullBox(grid), s.data());
    combined[param] = d.Combined().value();
    per[param] = Json{{"shape", {rows, cols}},
                      {"from", parts},
                      {"scales_shape", grid},
                      {"digest", d.Combined().ToHex()},
                      {"bytes_digest", ContentDigest(d.bytes).ToHex()},
                      {"scales_digest", ContentDigest(d.scales).ToHex()}};
    if (!f.json) out << fmt::format("{:<48} {:>6} x {:<6} scales {:>5} x {:<5} {}\n", param, rows, cols, grid[0], grid[1],
                                    d.Combined().ToHex());
    if (++done % 16 == 0) std::cerr << fmt::format("fp8-digest: {} of {} parameters\n", done, params.size());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report["parameters"] = per;
  report["not_quantized"] = untouched;
  report["combined"] = ContentDigest(refit::CombineTensorDigests(combined)).ToHex();
  report["seconds"] = secs;
  if (f.json) {
    out << report.dump(1) << "\n";
  } else {
    out << fmt::format("{} parameters quantized {} ({}), {} tensors left bf16; combined digest {} ({:.2f} s)\n",
                       params.size(), f.scheme, report["vllm_quantization"].get<std::string>(), untouched.size(),
                       report["combined"].get<std::string>(), secs);
  }
  return OkStatus();
}

}  // namespace

void RegisterModelFp8Command(CLI::App* model, int* exit_code) {
  auto f = std::make_shared<Flags>();
  auto* cmd = model->add_subcommand(
      "fp8-digest",
      "The FP8 image vLLM 0.33 serves from this bf16 folder (docs/fp8.md): per vLLM parameter (q/k/v and "
      "gate/up fused as vLLM fuses them), its E4M3 bytes and scales by vLLM's rule, and their digest.");
  cmd->add_option("folder", f->folder, "A Hugging Face folder of BF16 safetensors")->required();
  cmd->add_option("--scheme", f->scheme,
                  "per_tensor (vLLM fp8_per_tensor), per_channel (fp8_per_channel) or block (fp8_per_block, 128 x 128)")
      ->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (0: all cores)")->capture_default_str();
  cmd->add_flag("--json", f->json, "One JSON object: per parameter shape, parts, scale grid and digests");
  cmd->callback([f, exit_code] {
    const Status st = Run(*f, std::cout);
    if (!st.ok()) {
      std::cerr << "model fp8-digest: " << st.ToString() << "\n";
      *exit_code = st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kNotFound ? 2 : 1;
      return;
    }
    *exit_code = 0;
  });
}

}  // namespace rc::apps
