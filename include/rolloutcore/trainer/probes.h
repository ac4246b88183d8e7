// Replay probes of the synthetic trainer (docs/trainer.md "Replay probes"): the trainer's own
// greedy continuation of a few deterministic prompts, computed with its reference forward on the
// exact weights it publishes for a version, attached to that version by rank 0 (Publisher::
// AttachProbes) and replayed by the controller in VALIDATING (docs/lifecycle.md).
//
// Reference forward: a private single-rank (tp 1) embedded engine whose parameters are loaded by
// the Hugging Face loader from the full bf16(W_step) tensors (synthetic_trainer.h) — the same
// bytes the ranks publish, gathered by name, never through a refit plan. An engine whose install
// mapping is wrong (heads swapped, a shard transposed) therefore computes other numbers than
// these, while its digest, computed through that same mapping, still agrees.
//
// Prompts: probe i has `prompt_tokens` ids drawn from a counter-based hash of (seed, i, k) into
// [0, min(vocab, 256)), so they are fixed for a trainer configuration and differ per probe.
//
// Thread safety: pure functions (each call builds its own engine).
#pragma once

#include <cstdint>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/probes.h"
#include "rolloutcore/trainer/synthetic_trainer.h"

namespace rc::trainer {

// ProbeOptions is declared in synthetic_trainer.h (SyntheticTrainerOptions holds one).
// InvalidArgument naming the field (count 0..kMaxProbes, tokens, top_k, prompt_tokens in bounds).
[[nodiscard]] Status ValidateProbeOptions(const ProbeOptions& options);

std::vector<std::vector<int32_t>> ProbePrompts(const refit::ModelConfig& config, uint64_t seed,
                                               const ProbeOptions& options);

// The probes of version v<step> ("p0", "p1", ...), from the reference forward described above.
[[nodiscard]] Result<std::vector<refit::Probe>> ComputeSyntheticProbes(const refit::ModelConfig& config,
                                                                       const SyntheticWeights& weights, int64_t step,
                                                                       const ProbeOptions& options);

}  // namespace rc::trainer
