# Sourced by run_vllm.sh and run_vllm_bench.sh (GPU machine): unpacks the vLLM bundle of
# ../shared/vllm/ at $VB/site (default /tmp/vb) if needed, checks the carried CUDA build of the
# package (build/cuda-py-bundle) and exports the environment the tests and benches use. Exits 77
# (CTest's skip code) when there is no GPU, no bundle or no CUDA build.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no NVIDIA GPU on this machine (the vLLM tests run on the GPU machine)"; exit 77
fi
VB=${VB:-/tmp/vb}
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
export MAKE_TINY=${MAKE_TINY:-$B/python/rolloutcore/vllm_models.py}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
