#!/usr/bin/env bash
# Runs TRL's GRPOTrainer on the GPU machine (docs/trl.md): examples/trl_grpo.py on a tiny Qwen3
# (rolloutcore.vllm_models --shape tiny) and the digit-reversal task, three ways:
#   1. rolloutcore: generation through the controller (vLLM with rolloutcore's worker extension),
#      sync through rolloutcore.Publisher over cuda_ipc (the trainer's bf16 parameters in place);
#   2. TRL's own weight sync, same model, task and hyper-parameters:
#      - one GPU: trl-colocate, TRL's vllm_mode="colocate": vLLM inside the trainer process on the
#        same GPU (vLLM's share: COLOCATE_GPU_UTIL), TRL copies every parameter into it before each
#        generation (VLLMGeneration.sync_weights: model.load_weights + reset_prefix_cache);
#      - two GPUs or more: trl, TRL's vllm_mode="server" against a stock
#        `vllm serve --weight-transfer-config nccl` on the second GPU (TRL broadcasts every parameter
#        over NCCL; NCCL refuses two ranks on one device, so this one needs two GPUs);
#   3. stale: the rolloutcore run with the sync after step 5 skipped on purpose (--on-mismatch warn),
#      which must be caught (step 6 bound to step-4 while the trainer expects step-5).
# Typical wall time on one H200: ~5-6 min for the three; each run has its own timeout (below), the
# three together at most ~9 min.
#
#   [STEPS=50] [STALE_STEPS=10, 0 skips the stale run] [COLOCATE_GPU_UTIL=0.15] [TRL_KIT=/tmp/trl] [VLLM_KIT=0.33] scripts/gpu/run_trl.sh
# Needs what run_vllm.sh needs (the vLLM kit at $VB, the CUDA build of the package in
# build/cuda-py-bundle: scripts/gpu/vllm_env.sh) plus the TRL kit (scripts/gpu/make_trl_kit.sh)
# as pieces or unpacked site/ in $TRL_KIT. Results in $OUT/kit-$VLLM_KIT/trl (OUT default ./out-vllm):
# one folder per run with trl_grpo.json, the logs, summary.txt with the per-run summaries and
# side_by_side.txt (one line per run: reward, step, sync, pause, gap, and what the backend proves).
# Exit 77 when there is no GPU or a kit is missing.
set -uo pipefail
source "$(dirname "$0")/vllm_env.sh"
TRL_KIT=${TRL_KIT:-/tmp/trl}
STEPS=${STEPS:-50}
STALE_STEPS=${STALE_STEPS:-10}
COLOCATE_GPU_UTIL=${COLOCATE_GPU_UTIL:-0.15}
unpack_kit "$TRL_KIT" trl_kit.tar.xz "TRL kit" "scripts/gpu/make_trl_kit.sh"
R=$OUT/trl
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$R/gpu.txt"
NGPU=$(nvidia-smi -L | wc -l)
# rolloutcore/trl.py from this checkout (a bundle built before it was listed in src/python/CMakeLists.txt
# lacks it; a newer one holds the same file).
cp "$ROOT/python/rolloutcore/trl.py" "$RC_PYTHONPATH/rolloutcore/trl.py"
# The trainer: rolloutcore's CUDA build + the TRL kit (+ the vLLM kit's site/ where TRL's own modes
# import vLLM in the trainer: colocate runs the engine in-process, server mode joins its NCCL group).
BASE_PP="$RC_PYTHONPATH:$TRL_KIT/site"
export VLLM_SITE RC_PYTHONPATH
python3 -c "import sys; sys.path[:0] = '$BASE_PP'.split(':'); import trl, datasets, rolloutcore.trl; print('trl', trl.__version__, 'datasets', datasets.__version__)" \
  | tee "$R/versions.txt" || { echo "the TRL kit does not import here; see docs/trl.md" >&2; exit 4; }
PYTHONPATH="$BASE_PP" python3 -m rolloutcore.vllm_models "$R/model" --shape tiny --seed 0 > "$R/model.log" 2>&1 \
  || { cat "$R/model.log"; exit 5; }

run() {  # name, timeout in seconds, then examples/trl_grpo.py arguments
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (at most ${limit} s): $*"
  rm -f "$R/$name/trl_grpo.json"
  timeout -k 10 "$limit" python3 "$ROOT/examples/trl_grpo.py" --model-dir "$R/model" --out "$R/$name" "$@" \
    > "$R/$name.log" 2>&1
  local rc=$?
  grep -E '^\{"step"|^\{"summary"|^\{"error"|^negative control' "$R/$name.log" > "$R/$name.jsonl"
  echo "$name: rc=$rc wall=$((SECONDS - t0)) s $(grep '^{"summary"' "$R/$name.log")" | tee -a "$R/summary.txt"
  [[ $rc == 0 ]] || tail -40 "$R/$name.log"
  # vLLM's engine-core children can outlive a failed run and hold the GPU (run_vllm.sh says why).
  leftover=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [[ -z "$leftover" ]] || { echo "killing leftover GPU processes: $(echo $leftover)"; kill -9 $leftover 2>/dev/null; sleep 2; }
  return $rc
}

: > "$R/summary.txt"
status=0
PYTHONPATH="$BASE_PP" run rolloutcore 240 --backend rolloutcore --engine vllm --steps "$STEPS" || status=1
if (( NGPU >= 2 )); then
  PYTHONPATH="$BASE_PP:$VLLM_SITE" run trl 240 --backend trl --engine vllm --steps "$STEPS" || status=1
else
  echo "trl (server mode): not run, it needs vLLM on a second GPU (NCCL: one rank per device); TRL's colocate mode instead" \
    | tee -a "$R/summary.txt"
  # TRL imports vLLM in this process (trl/generation/vllm_generation.py decides at import), so the
  # vLLM kit's site/ is on PYTHONPATH from the start.
  PYTHONPATH="$BASE_PP:$VLLM_SITE" run trl-colocate 180 --backend trl-colocate --device cuda:0 --steps "$STEPS" \
    --gpu-util "$COLOCATE_GPU_UTIL" || status=1
fi
if (( STALE_STEPS > 0 )); then
  PYTHONPATH="$BASE_PP" run stale 120 --backend rolloutcore --engine vllm --steps "$STALE_STEPS" --skip-sync-at 5 \
    --on-mismatch warn || status=1
else
  echo "stale: not run (STALE_STEPS=0)" | tee -a "$R/summary.txt"
fi
echo; cat "$R/summary.txt"
# Side by side, from each run's trl_grpo.json (runs that wrote none are named as missing).
python3 - "$R" rolloutcore trl trl-colocate stale <<'PY' | tee "$R/side_by_side.txt"
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
def f(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))
print("run | backend | steps | reward first10 -> last10 | step ms (median) | sync ms (median) | pause ms (median) "
      "| logprob gap, max of step means | wall s | binding / outcome / digest / stale caught")
for name in sys.argv[2:]:
    p = r / name / "trl_grpo.json"
    if not p.exists():
        if (r / f"{name}.log").exists():
            print(f"{name} | (no trl_grpo.json: see {name}.log)")
        continue
    d = json.loads(p.read_text())
    s = d["summary"]
    pr = s.get("proves", {})
    proves = " / ".join("yes" if pr.get(k) else "no" for k in ("completion_bound_to_synced_version",
                        "sync_outcome_checked", "live_digest_equals_published", "stale_generation_caught"))
    print(f"{name} | {d['args']['backend']} | {s['steps']} | {f(s['reward_first10'])} -> {f(s['reward_last10'])} | "
          f"{f(s['step_ms_median'], 0)} | {f(s['sync_ms_median'], 1)} | {f(s['pause_ms_median'], 1)} | "
          f"{f(s['logprob_gap_max'], 4)} | {f(d['wall_s'], 0)} | {proves}")
PY
exit $status
