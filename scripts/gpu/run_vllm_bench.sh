#!/usr/bin/env bash
# The vLLM benchmarks on the GPU machine (environment as run_vllm.sh: vllm_env.sh, which selects
# the kit with VLLM_KIT=0.26|0.33, default 0.33):
#   [VLLM_KIT=0.26|0.33] scripts/gpu/run_vllm_bench.sh [SHAPE...]      (default: 8b tiny)
# per shape `rolloutcore bench cycle --engine vllm --shape SHAPE --cycles $CYCLES $BENCH_ARGS`
# (CYCLES default 6, pause calls alternating /pause and /sleep?level=0), output and JSON in
# $OUT/kit-$VLLM_KIT (OUT default ./out-vllm).
set -uo pipefail
source "$(dirname "$0")/vllm_env.sh"
[[ $# -gt 0 ]] || set -- 8b tiny
rc=0
for shape in "$@"; do
  # shellcheck disable=SC2086
  timeout --signal=TERM --kill-after=10 "${SHAPE_TIMEOUT_S:-280}" "$ROLLOUTCORE_BIN" bench cycle --engine vllm \
    --shape "$shape" --cycles "${CYCLES:-6}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_vllm_$shape.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
done
exit $rc
