// Export: writes one version of the synthetic trainer (see synthetic_trainer.h) as a Hugging Face
// model folder, `rolloutcore trainer export`. The folder holds config.json (HF field names:
// architectures, model_type, sizes, rope_theta, tie_word_embeddings, torch_dtype "bfloat16", ...)
// and model.safetensors with every source tensor (refit::ListSourceTensors names) in bf16. The
// bytes of each tensor are exactly the bytes the trainer publishes for that version, so the
// export's per-tensor content digests equal the committed manifest's.
//
// Thread safety: pure functions apart from the files they write.
#pragma once

#include <cstdint>
#include <string>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/trainer/synthetic_trainer.h"

namespace rc::trainer {

// The config as a HF config.json object (torch_dtype "bfloat16"); refit::ParseModelConfigJson
// reads it back to an equal configuration.
Json ModelConfigToJson(const refit::ModelConfig& config);

struct ExportResult {
  std::string config_path;
  std::string weights_path;
  uint64_t bytes = 0;              // tensor bytes written
  refit::TensorDigests digests;   // per tensor, of the bytes written
  uint64_t content_digest = 0;    // refit::CombineTensorDigests(digests)
};

// Writes bf16(W_step) of every tensor to out_dir (created when missing; existing config.json and
// model.safetensors are replaced).
[[nodiscard]] Result<ExportResult> ExportVersion(const refit::ModelConfig& config, const SyntheticWeights& weights,
                                                 int64_t step, const std::string& out_dir);

}  // namespace rc::trainer
