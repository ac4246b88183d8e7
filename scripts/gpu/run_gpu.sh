#!/usr/bin/env bash
# Runs the GPU tests and the GPU refit benchmarks of issue #7 on a machine with NVIDIA GPUs
# (written for 2 x H200 with NVLink, no network), leaving logs and JSON in $OUT.
#
#   [BUNDLE=build/cuda-bundle] scripts/gpu/run_gpu.sh [all|tests|bench|delta] [OUT_DIR]
#                                                         (default: all, $OUT or ./out-gpu)
# delta: the GPU delta (docs/refit.md "Delta on the GPU"): gpu_device_receiver_test, then
#   `bench refit --delta --gpu` (qwen3-8b, a trainer process over shm, 1 % changed; MODEL and
#   FRACTIONS override), JSON in $OUT_DIR/bench_gpu_delta.json. BUNDLE may be the Python bundle
#   (build/cuda-py-bundle, with gpu-tests/ beside bin/).
#
# Binaries. The GPU machine may lack the build dependencies (fmt, spdlog, xxhash, sqlite,
# cpp-httplib, CLI11, nlohmann-json, gtest) and has no network, so the primary path is a bundle
# built on the development machine:
#     cmake --preset cuda && scripts/gpu/make_bundle.sh      # -> build/cuda-bundle/{bin,lib}
# carried to the GPU machine (device tool: carry ["build/cuda-bundle"]). The bundle holds the
# binaries plus every shared library they load except glibc, libstdc++, the CUDA driver and NCCL
# (too large to carry; found here, next to PyTorch or CUDA). The CUDA runtime is linked statically.
# Without a bundle the script tries to build here (cmake; ninja if present, else Unix Makefiles),
# which works only where those dependencies are installed.
#
# NVLink multicast stays off: NCCL_NVLS_ENABLE=0 (the nccl transport also forces it).
set -uo pipefail
MODE=${1:-all}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${2:-${OUT:-$ROOT/out-gpu}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_run.log"
SUMMARY="$OUT_DIR/summary.txt"
: >"$LOG"
: >"$SUMMARY"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

say() { echo "$*" | tee -a "$SUMMARY" | tee -a "$LOG" >&2; }
step() {  # step NAME TIMEOUT_S CMD...: runs CMD with a time limit, output into the log
  local name=$1 limit=$2
  shift 2
  echo "===== $name: $*" >>"$LOG"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "$(printf '%-40s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")"
  return $rc
}

say "rolloutcore GPU run: mode $MODE, $(date -u +%FT%TZ), host $(hostname)"
{ nvidia-smi; nvidia-smi topo -m; } >>"$LOG" 2>&1 || say "nvidia-smi failed"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
say "GPUs: $NGPU"

# ---- binaries ---------------------------------------------------------------------------------------
BIN=""
BUNDLE=${BUNDLE:-$ROOT/build/cuda-bundle}
if [[ -x "$BUNDLE/bin/rolloutcore" ]]; then
  BIN="$BUNDLE/bin"
  export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "binaries: carried bundle $BIN"
else
  say "no build/cuda-bundle: building here"
  GEN="Unix Makefiles"
  command -v ninja >/dev/null && GEN=Ninja
  B="$ROOT/build/cuda-gpu"
  step configure 600 cmake -S "$ROOT" -B "$B" -G "$GEN" -DCMAKE_BUILD_TYPE=Release -DROLLOUTCORE_WITH_CUDA=ON \
    -DROLLOUTCORE_WITH_NCCL=ON -DROLLOUTCORE_WITH_UCX=OFF -DROLLOUTCORE_BUILD_BENCHMARKS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 || { say "configure failed (missing build dependencies? see gpu_run.log)"; exit 1; }
  step build 1800 cmake --build "$B" -j"$(nproc)" --target rolloutcore gpu_kernels_test gpu_fp8_test gpu_transport_test \
    rc_gpu_owner transport_cuda_ipc_test transport_nccl_test gpu_transport_conformance_test || { say "build failed (see gpu_run.log)"; exit 1; }
  mkdir -p "$B/run-bin"
  for f in src/apps/rolloutcore tests/gpu/gpu_kernels_test tests/gpu/gpu_fp8_test tests/gpu/gpu_transport_test tests/gpu/rc_gpu_owner \
           src/transport/cuda_ipc/transport_cuda_ipc_test src/transport/nccl/transport_nccl_test \
           tests/gpu/gpu_transport_conformance_test; do
    cp "$B/$f" "$B/run-bin/"
  done
  BIN="$B/run-bin"
fi

# ---- NCCL -------------------------------------------------------------------------------------------
find_nccl() {
  [[ -n "${NCCL_LIB_DIR:-}" && -e "$NCCL_LIB_DIR/libnccl.so.2" ]] && { echo "$NCCL_LIB_DIR"; return; }
  local p
  p=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 / {print $NF; exit}')
  [[ -n "$p" ]] && { dirname "$p"; return; }
  for py in python3 /opt/torch/.venv/bin/python3; do
    p=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
    [[ -n "$p" && -e "$p/libnccl.so.2" ]] && { echo "$p"; return; }
  done
  p=$(find /usr/local/cuda*/lib* /usr/lib /opt -name 'libnccl.so.2' 2>/dev/null | head -1)
  [[ -n "$p" ]] && dirname "$p"
}
NCCL_DIR=$(find_nccl)
if [[ -n "$NCCL_DIR" ]]; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$NCCL_DIR"
  say "NCCL: $NCCL_DIR"
else
  say "NCCL: libnccl.so.2 not found (set NCCL_LIB_DIR); binaries will not start"
fi
{ for b in "$BIN"/*; do echo "--- ldd $b"; ldd "$b"; done; } >>"$LOG" 2>&1
if ldd "$BIN/rolloutcore" | grep -q "not found"; then
  say "ERROR: unresolved libraries: $(ldd "$BIN/rolloutcore" | grep 'not found' | tr -s ' \t' ' ')"
  exit 1
fi
export RC_GPU_OWNER_BIN="$BIN/rc_gpu_owner"

# ---- tests ------------------------------------------------------------------------------------------
FAILED=0
if [[ "$MODE" == all || "$MODE" == tests ]]; then
  step transport_cuda_ipc_test 120 "$BIN/transport_cuda_ipc_test" || FAILED=1
  step transport_nccl_test 120 "$BIN/transport_nccl_test" || FAILED=1
  step gpu_kernels_test 300 "$BIN/gpu_kernels_test" --gtest_output="xml:$OUT_DIR/gtest_gpu_kernels.xml" || FAILED=1
  if [[ -x "$BIN/gpu_fp8_test" ]]; then
    step gpu_fp8_test 120 "$BIN/gpu_fp8_test" --gtest_output="xml:$OUT_DIR/gtest_gpu_fp8.xml" || FAILED=1
  fi
  step gpu_transport_test 400 "$BIN/gpu_transport_test" --gtest_output="xml:$OUT_DIR/gtest_gpu_transport.xml" || FAILED=1
  if [[ -x "$BIN/gpu_transport_conformance_test" ]]; then
    step gpu_transport_conformance_test 300 "$BIN/gpu_transport_conformance_test" \
      --gtest_output="xml:$OUT_DIR/gtest_gpu_transport_conformance.xml" || FAILED=1
  fi
  grep -hE "^\[  (PASSED|FAILED)  \]|^\[  SKIPPED \] [0-9]+ test|detected after" "$LOG" | tee -a "$SUMMARY" >&2
fi

# ---- the GPU delta ----------------------------------------------------------------------------------
if [[ "$MODE" == delta ]]; then
  for t in "$BIN/gpu_device_receiver_test" "$BUNDLE/gpu-tests/gpu_device_receiver_test"; do
    [[ -x "$t" ]] || continue
    step gpu_device_receiver_test 300 "$t" --gtest_output="xml:$OUT_DIR/gtest_gpu_device_receiver.xml" || FAILED=1
    break
  done
  step "bench refit --delta --gpu" 560 "$BIN/rolloutcore" bench refit --delta --gpu --transport shm \
    --model "${MODEL:-qwen3-8b}" --change-fractions "${FRACTIONS:-0.01}" --repeats 3 --device 0 \
    --json-out "$OUT_DIR/bench_gpu_delta.json" || FAILED=1
  grep -hE "^\[  (PASSED|FAILED)  \]|^F=" "$LOG" | tee -a "$SUMMARY" >&2
fi

# ---- benchmarks -------------------------------------------------------------------------------------
if [[ "$MODE" == all || "$MODE" == bench ]]; then
  DEV=1
  [[ "$NGPU" -lt 2 ]] && DEV=0
  for T in cuda_ipc nccl; do
    if [[ "$T" == nccl && "$NGPU" -lt 2 ]]; then say "bench nccl: skipped (needs 2 GPUs)"; continue; fi
    step "bench refit $T" 420 "$BIN/rolloutcore" bench refit --transport "$T" --model qwen3-8b --source fsdp:1 \
      --target tp:1 --owner-device 0 --device "$DEV" --repeats 5 --kill-owner-mid-transfer \
      --json-out "$OUT_DIR/bench_$T.json" || FAILED=1
    [[ -f "$OUT_DIR/bench_$T.json" ]] && python3 - "$OUT_DIR/bench_$T.json" >>"$SUMMARY" 2>&1 <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
k = r.get("kill_owner_mid_transfer") or {}
print(f"  {r['transport']}: wire {r['wire_gbps']:.1f} GB/s vs peer copy {r['peer_copy_gbps']:.1f} GB/s "
      f"(ratio {r['wire_to_peer_ratio']:.2f}, target >= 0.9); install {r['install_gbps']:.1f} GB/s vs d2d "
      f"{r['d2d_memcpy_gbps']:.1f} GB/s (ratio {r['install_to_d2d_ratio']:.2f}, target >= 0.8); digest "
      f"{r['digest_best_ms']:.2f} ms for {r['param_bytes']/1e9:.1f} GB = {r['digest_gbps']:.0f} GB/s vs read sweep "
      f"{r['read_gbps']:.0f} GB/s (ratio {r['digest_to_read_ratio']:.2f}, target >= 0.8); verified "
      f"{r['digest_verified']}; kill detected in {k.get('detection_ms', float('nan')):.1f} ms: "
      f"{k.get('detected_within_deadline')}")
PY
  done
  grep -A12 "^GPU refit" "$LOG" >>"$SUMMARY" || true
fi

say "done: failures=$FAILED; logs in $OUT_DIR"
exit $FAILED
