#!/usr/bin/env bash
# Makes a self-contained set of the GPU binaries that can be carried to a GPU machine whose build
# dependencies (fmt, spdlog, xxhash, sqlite, cpp-httplib, gtest, ...) are not installed.
#
#   scripts/gpu/make_bundle.sh [BUILD_DIR=build/cuda] [BUNDLE_DIR=build/cuda-bundle]
#
# Approach: build here with the `cuda` preset (static CUDA runtime, so the binaries need only the
# driver's libcuda.so.1 from CUDA), copy the binaries to BUNDLE/bin and every shared library they
# load from this machine into BUNDLE/lib, except the C library family and libstdc++/libgcc_s (the
# GPU machine's newer ones are compatible), the CUDA driver (comes with the driver) and NCCL
# (218 MB: too large to carry; the GPU machine has it with PyTorch, run_gpu.sh finds it).
# run_gpu.sh puts BUNDLE/lib and NCCL's folder on LD_LIBRARY_PATH.
# At the end every binary is checked with ldd against BUNDLE/lib: nothing may be missing except
# libcuda/libnccl, which the GPU machine provides.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build/cuda}
BUNDLE=${2:-$ROOT/build/cuda-bundle}
# PYTHON=1: the bundle of the vLLM worker extension instead (scripts/gpu/run_vllm.sh): the CUDA
# build of the Python package (BUILD configured with ROLLOUTCORE_WITH_PYTHON=ON for the GPU
# machine's Python 3.12, see docs/vllm.md) and the `rolloutcore` binary; the package goes to
# BUNDLE/python/rolloutcore with its extension checked by ldd like the binaries. SKIP_BUILD=1 bundles
# what BUILD holds without building first.
if [[ "${PYTHON:-0}" == 1 ]]; then
  BINS=(src/apps/rolloutcore)
  [[ "${SKIP_BUILD:-0}" == 1 ]] || cmake --build "$BUILD" -j2 --target rolloutcore _core
else
  BINS=(src/apps/rolloutcore tests/gpu/gpu_kernels_test tests/gpu/gpu_fp8_test tests/gpu/gpu_transport_test tests/gpu/rc_gpu_owner
        src/transport/cuda_ipc/transport_cuda_ipc_test src/transport/nccl/transport_nccl_test
        tests/gpu/gpu_transport_conformance_test)
  [[ "${SKIP_BUILD:-0}" == 1 ]] || cmake --build "$BUILD" -j2 --target rolloutcore gpu_kernels_test gpu_fp8_test gpu_transport_test rc_gpu_owner \
    transport_cuda_ipc_test transport_nccl_test gpu_transport_conformance_test
fi
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
for b in "${BINS[@]}"; do
  cp "$BUILD/$b" "$BUNDLE/bin/"
  strip --strip-debug "$BUNDLE/bin/$(basename "$b")" || true
done
if [[ "${PYTHON:-0}" == 1 ]]; then
  mkdir -p "$BUNDLE/python"
  cp -rL "$BUILD/python/rolloutcore" "$BUNDLE/python/"
  strip --strip-debug "$BUNDLE"/python/rolloutcore/_core*.so || true
  # ldd below checks it with the binaries.
  ln -sf "../python/rolloutcore/$(basename "$BUNDLE"/python/rolloutcore/_core*.so)" "$BUNDLE/bin/_core.so"
fi
# Libraries not to carry (see the header).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnccl\.so)'
for b in "$BUNDLE"/bin/*; do
  ldd "$b" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    if [[ "$name" =~ $skip ]] || [[ "$path" == "not" ]]; then continue; fi
    [[ -e "$BUNDLE/lib/$name" ]] || cp -L "$path" "$BUNDLE/lib/$name"
  done
done
cat > "$BUNDLE/README" <<'TXT'
Carried GPU binaries of rolloutcore (made by scripts/gpu/make_bundle.sh). Run them through
scripts/gpu/run_gpu.sh, which sets LD_LIBRARY_PATH to lib/ plus the machine's NCCL folder.
TXT
echo "bundle: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1))"
du -sh "$BUNDLE"/bin/* "$BUNDLE"/lib/* | sort -h | tail -30
# Every binary resolves with only the C library family, libstdc++, the driver, NCCL and lib/.
bad=0
for b in "$BUNDLE"/bin/*; do
  missing=$(LD_LIBRARY_PATH="$BUNDLE/lib" ldd "$b" | awk '/not found/ {print $1}' | grep -Ev '^(libcuda|libnccl)' || true)
  outside=$(LD_LIBRARY_PATH="$BUNDLE/lib" ldd "$b" | awk '/=>/ {print $1, $3}' |
            grep -Ev "^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnccl\.so)" |
            grep -v " $BUNDLE/lib/" || true)
  if [[ -n "$missing$outside" ]]; then
    echo "ERROR: $(basename "$b") needs libraries outside the bundle: $missing $outside" >&2
    bad=1
  fi
done
rm -f "$BUNDLE/bin/_core.so"  # the link only served the ldd check (links are not carried)
[[ $bad == 0 ]] && echo "ldd check: every binary resolves to libc/libstdc++/libcuda/libnccl + $BUNDLE/lib"
exit $bad
