# Sourced by run_vllm.sh and run_vllm_bench.sh (GPU machine): selects the vLLM kit, unpacks its
# bundle (../shared/vllm/) at $VB/site if needed, checks that it is the release asked for, checks the
# carried CUDA build of the package (build/cuda-py-bundle) and exports the environment the tests and
# benches use. Exits 77 (CTest's skip code) when there is no GPU, no bundle or no CUDA build.
#
#   VLLM_KIT=0.26|0.33   the release (default 0.33); exported for the tests, which also read the
#                        running server's GET /version
#   VB=DIR               the kit's folder (default /tmp/vb for 0.26, /tmp/v33 for 0.33; an explicit
#                        VB wins): the pieces vllm_bundle.tar.xz.part-* + SHA256SUMS, or site/
#   OUT=DIR              results; this script moves them into $OUT/kit-$VLLM_KIT so that runs of
#                        both kits in one GPU call keep their logs apart
#   VLLM_OTHER_SITE=DIR  the other kit's site/ (only for the restart-on-another-release test);
#                        default: the other kit's default folder's site/ when it is unpacked there
#   RC_BUNDLE=DIR        the CUDA build of the package to use (default build/cuda-py-bundle), e.g.
#                        an older build's bundle for an old-against-new bench in the same call
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VLLM_KIT=${VLLM_KIT:-0.33}
case "$VLLM_KIT" in
  0.26) kit_default_vb=/tmp/vb; other_default_vb=/tmp/v33; other_kit=0.33 ;;
  0.33) kit_default_vb=/tmp/v33; other_default_vb=/tmp/vb; other_kit=0.26 ;;
  *) echo "VLLM_KIT must be 0.26 or 0.33, got '$VLLM_KIT'" >&2; exit 2 ;;
esac
export VLLM_KIT
OUT=${OUT:-$ROOT/out-vllm}
case "$OUT" in */kit-"$VLLM_KIT") ;; *) OUT="$OUT/kit-$VLLM_KIT" ;; esac
export OUT
mkdir -p "$OUT"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no NVIDIA GPU on this machine (the vLLM tests run on the GPU machine)"; exit 77
fi
VB=${VB:-$kit_default_vb}
# The release an unpacked site/ holds, from the version file the wheel generated
# (vllm/_version.py: __version__ = version = '0.33.0'); empty when there is none.
kit_version() {
  sed -n "s/^__version__ = version = '\([^']*\)'.*/\1/p" "$1/vllm/_version.py" 2>/dev/null | head -1
}
# unpack_kit DIR PREFIX WHAT HINT: unpacks DIR/PREFIX.part-* (checked against DIR/SHA256SUMS) into
# DIR unless DIR/site exists; exits 3 on a checksum mismatch, 77 (skip) when there are no pieces.
# Also used by run_trl.sh for the TRL kit.
unpack_kit() {
  local dir=$1 prefix=$2 what=$3 hint=$4
  [[ -d "$dir/site" ]] && return 0
  if ls "$dir/$prefix".part-* >/dev/null 2>&1; then
    (cd "$dir" && sha256sum -c SHA256SUMS >/dev/null) || { echo "$what pieces in $dir missing or checksum mismatch" >&2; exit 3; }
    cat "$dir/$prefix".part-* | xz -dc | tar -x -C "$dir"
  else
    echo "skipped: no $what at $dir ($hint)" >&2; exit 77
  fi
}
unpack_kit "$VB" vllm_bundle.tar.xz "vLLM $VLLM_KIT bundle" "see ../shared/vllm/README.md"
got=$(kit_version "$VB/site")
case "$got" in
  "$VLLM_KIT".*) ;;
  *) echo "VLLM_KIT=$VLLM_KIT but $VB/site holds vLLM '${got:-(no vllm/_version.py)}': point VB at the $VLLM_KIT kit" >&2
     exit 4 ;;
esac
echo "vLLM kit $VLLM_KIT: $got at $VB/site; results in $OUT"
if [[ -z "${VLLM_OTHER_SITE:-}" && -d "$other_default_vb/site" ]]; then
  case "$(kit_version "$other_default_vb/site")" in "$other_kit".*) VLLM_OTHER_SITE="$other_default_vb/site" ;; esac
fi
[[ -n "${VLLM_OTHER_SITE:-}" ]] && export VLLM_OTHER_SITE
B=$(realpath -m "${RC_BUNDLE:-$ROOT/build/cuda-py-bundle}")
[[ -f "$B/bin/rolloutcore" ]] || { echo "skipped: no $B: build it with PYTHON=1 scripts/gpu/make_bundle.sh" >&2; exit 77; }
chmod +x "$B/bin/rolloutcore"
export VLLM_SITE="$VB/site" RC_PYTHONPATH="$B/python" ROLLOUTCORE_BIN="$B/bin/rolloutcore"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$B/python:$ROOT/tests/vllm"
export MAKE_TINY=${MAKE_TINY:-$B/python/rolloutcore/vllm_models.py}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
