#!/usr/bin/env bash
# Runs TRL's GRPOTrainer on the GPU machine (docs/trl.md): examples/trl_grpo.py on a tiny Qwen3
# (rolloutcore.vllm_models --shape tiny) and the digit-reversal task, three ways:
#   1. rolloutcore: generation through the controller (vLLM with rolloutcore's worker extension),
#      sync through rolloutcore.Publisher over cuda_ipc (the trainer's bf16 parameters in place);
#   2. trl: TRL's own vllm_mode="server" against a stock `vllm serve --weight-transfer-config nccl`
#      (TRL broadcasts every parameter over NCCL; needs vLLM on another GPU than the trainer,
#      NCCL refuses two ranks on one device, so it is skipped with one GPU);
#   3. stale: the rolloutcore run with the sync after step 5 skipped on purpose (--on-mismatch warn),
#      which must be caught (step 6 bound to step-4 while the trainer expects step-5).
#
#   [STEPS=50] [STALE_STEPS=10] [TRL_KIT=/tmp/trl] [VLLM_KIT=0.33] scripts/gpu/run_trl.sh
# Needs what run_vllm.sh needs (the vLLM kit at $VB, the CUDA build of the package in
# build/cuda-py-bundle: scripts/gpu/vllm_env.sh) plus the TRL kit (scripts/gpu/make_trl_kit.sh)
# as pieces or unpacked site/ in $TRL_KIT. Results in $OUT/kit-$VLLM_KIT/trl (OUT default ./out-vllm):
# one folder per run with trl_grpo.json, the logs, and summary.txt with the per-run summaries.
# Exit 77 when there is no GPU or a kit is missing.
set -uo pipefail
source "$(dirname "$0")/vllm_env.sh"
TRL_KIT=${TRL_KIT:-/tmp/trl}
STEPS=${STEPS:-50}
STALE_STEPS=${STALE_STEPS:-10}
if [[ ! -d "$TRL_KIT/site" ]]; then
  if ls "$TRL_KIT"/trl_kit.tar.xz.part-* >/dev/null 2>&1; then
    (cd "$TRL_KIT" && sha256sum -c SHA256SUMS >/dev/null) || { echo "TRL kit pieces in $TRL_KIT: checksum mismatch" >&2; exit 3; }
    cat "$TRL_KIT"/trl_kit.tar.xz.part-* | xz -dc | tar -x -C "$TRL_KIT"
  else
    echo "skipped: no TRL kit at $TRL_KIT (scripts/gpu/make_trl_kit.sh)" >&2; exit 77
  fi
fi
R=$OUT/trl
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$R/gpu.txt"
NGPU=$(nvidia-smi -L | wc -l)
# rolloutcore/trl.py from this checkout (a bundle built before it was listed in src/python/CMakeLists.txt
# lacks it; a newer one holds the same file).
cp "$ROOT/python/rolloutcore/trl.py" "$RC_PYTHONPATH/rolloutcore/trl.py"
# The trainer: rolloutcore's CUDA build + the TRL kit (vLLM only where TRL's server mode needs it).
BASE_PP="$RC_PYTHONPATH:$TRL_KIT/site"
export VLLM_SITE RC_PYTHONPATH
python3 -c "import sys; sys.path[:0] = '$BASE_PP'.split(':'); import trl, datasets, rolloutcore.trl; print('trl', trl.__version__, 'datasets', datasets.__version__)" \
  | tee "$R/versions.txt" || { echo "the TRL kit does not import here; see docs/trl.md" >&2; exit 4; }
PYTHONPATH="$BASE_PP" python3 -m rolloutcore.vllm_models "$R/model" --shape tiny --seed 0 > "$R/model.log" 2>&1 \
  || { cat "$R/model.log"; exit 5; }

run() {  # name, then examples/trl_grpo.py arguments
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  timeout 420 python3 "$ROOT/examples/trl_grpo.py" --model-dir "$R/model" --out "$R/$name" "$@" \
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
PYTHONPATH="$BASE_PP" run rolloutcore --backend rolloutcore --engine vllm --steps "$STEPS" || status=1
if (( NGPU >= 2 )); then
  PYTHONPATH="$BASE_PP:$VLLM_SITE" run trl --backend trl --engine vllm --steps "$STEPS" || status=1
else
  echo "trl: skipped, TRL's server mode needs vLLM on a second GPU (NCCL: one rank per device)" | tee -a "$R/summary.txt"
fi
PYTHONPATH="$BASE_PP" run stale --backend rolloutcore --engine vllm --steps "$STALE_STEPS" --skip-sync-at 5 \
  --on-mismatch warn || status=1
echo; cat "$R/summary.txt"
exit $status
