#!/usr/bin/env bash
# Runs the vLLM tests (tests/vllm, labels gpu + vllm) on the GPU machine against a real vLLM 0.26 or
# 0.33 from the stripped bundles of ../shared/vllm/ (VLLM_KIT=0.26|0.33, default 0.33; the kit
# unpacked at $VB/site, default /tmp/vb for 0.26 and /tmp/v33 for 0.33: vllm_env.sh), with the CUDA
# build of rolloutcore's Python package carried in build/cuda-py-bundle (PYTHON=1
# scripts/gpu/make_bundle.sh build/cuda-py build/cuda-py-bundle; docs/vllm.md).
#
#   [VLLM_KIT=0.26|0.33] scripts/gpu/run_vllm.sh [PYTEST_ARGS...]
# Logs and figures in $OUT/kit-$VLLM_KIT (OUT default ./out-vllm), so both kits can run in one call:
#   VLLM_KIT=0.33 scripts/gpu/run_vllm.sh; VLLM_KIT=0.26 scripts/gpu/run_vllm.sh
# Exit 77 (CTest's skip code for the test vllm_gpu_tests, labels gpu + vllm) when there is no GPU,
# no vLLM bundle or no CUDA build of the package: nothing to run here.
set -uo pipefail
source "$(dirname "$0")/vllm_env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -x -q -s -p no:cacheprovider "$ROOT/tests/vllm" "$@" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
# vLLM's engine-core children (plain python3 processes) can outlive a test that failed or timed out
# and keep tens of GiB of GPU memory, so a later call on the same warm machine runs out of memory
# (seen in session 6: two leftover processes held 113 GiB). The GPU machine runs nothing else:
# after the tests, any process still holding the GPU is one of ours and is killed.
leftover=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
if [[ -n "$leftover" ]]; then
  echo "run_vllm.sh: killing processes still on the GPU after the tests: $(echo $leftover)" | tee -a "$OUT/pytest.log"
  kill -9 $leftover 2>/dev/null || true
fi
exit "$rc"
