#!/usr/bin/env bash
# Runs the vLLM tests (tests/vllm, labels gpu + vllm) on the GPU machine against a real vLLM 0.26
# from the stripped bundle of ../shared/vllm/ (unpacked at $VB/site, default /tmp/vb), with the
# CUDA build of rolloutcore's Python package carried in build/cuda-py-bundle (PYTHON=1
# scripts/gpu/make_bundle.sh build/cuda-py build/cuda-py-bundle; docs/vllm.md).
#
#   scripts/gpu/run_vllm.sh [PYTEST_ARGS...]     logs and figures in $OUT (default ./out-vllm)
# Exit 77 (CTest's skip code for the test vllm_gpu_tests, labels gpu + vllm) when there is no GPU,
# no vLLM bundle or no CUDA build of the package: nothing to run here.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no NVIDIA GPU on this machine (the vLLM tests run on the GPU machine)"; exit 77
fi
VB=${VB:-/tmp/vb}
export OUT=${OUT:-$ROOT/out-vllm}
mkdir -p "$OUT"
if [[ ! -d "$VB/site" ]]; then
  if ls "$VB"/vllm_bundle.tar.xz.part-* >/dev/null 2>&1; then
    (cd "$VB" && sha256sum -c SHA256SUMS >/dev/null) || { echo "vLLM bundle pieces missing or checksum mismatch" >&2; exit 3; }
    cat "$VB"/vllm_bundle.tar.xz.part-* | xz -dc | tar -x -C "$VB"
  else
    echo "skipped: no vLLM bundle at $VB (see ../shared/vllm/README.md)" >&2; exit 77
  fi
fi
B="$ROOT/build/cuda-py-bundle"
[[ -f "$B/bin/rolloutcore" ]] || { echo "skipped: no $B: build it with PYTHON=1 scripts/gpu/make_bundle.sh" >&2; exit 77; }
chmod +x "$B/bin/rolloutcore"
export VLLM_SITE="$VB/site" RC_PYTHONPATH="$B/python" ROLLOUTCORE_BIN="$B/bin/rolloutcore"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$B/python:$ROOT/tests/vllm"
export MAKE_TINY=${MAKE_TINY:-$ROOT/tests/vllm/make_tiny_qwen3.py}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -x -q -s -p no:cacheprovider "$ROOT/tests/vllm" "$@" 2>&1 | tee "$OUT/pytest.log"
exit "${PIPESTATUS[0]}"
