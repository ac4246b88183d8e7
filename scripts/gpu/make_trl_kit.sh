#!/usr/bin/env bash
# make_trl_kit.sh OUT_DIR [PIECE_MIB=28]
#
# Builds the TRL kit for the offline GPU machine (docs/trl.md): TRL 1.16.0 plus what it needs that
# the GPU machine (CPython 3.12, torch 2.11, transformers 5.17, accelerate, pandas, pyarrow,
# numpy, requests, httpx, huggingface_hub) lacks: `datasets` and the parts of its dependencies that
# are not there (dill, multiprocess, xxhash, fsspec). One folder `site/` for CPython 3.12 on
# x86-64, used there through PYTHONPATH (scripts/gpu/run_trl.sh unpacks it to /tmp/trl/site).
#
#   OUT_DIR/wheels/   the pinned wheels from PyPI (pip checks every sha256; kept, a re-run skips them)
#   OUT_DIR/site/     the unpacked kit
#   OUT_DIR/pieces/   trl_kit.tar.xz.part-aa, ... (PIECE_MIB MiB each) + SHA256SUMS
#
# Versions: TRL 1.16.0 asks for datasets>=4.7.0; datasets 4.8.0 is the newest that still accepts
# huggingface_hub < 2 and pyarrow >= 21 (5.x wants pyarrow >= 24 and huggingface_hub >= 1.31, which
# the GPU machine may not have), with dill 0.4.0 / multiprocess 0.70.18 / fsspec 2026.2.0 inside its
# bounds. If `pip list` there shows another package missing, add its wheel (name, sha256 from
# PyPI's JSON API) to PINS.
#
# Needs: python3 with pip reaching PyPI, GNU tar, xz, split, sha256sum. Nothing is installed
# outside OUT_DIR. Set PYTHON=/path/to/python3 to use another interpreter for pip.
set -euo pipefail
export LC_ALL=C

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  echo "usage: $0 OUT_DIR [PIECE_MIB=28]" >&2; exit 2
fi
OUT=$(realpath -m "$1")
PIECE_MIB=${2:-28}
case $PIECE_MIB in ''|*[!0-9]*|0) echo "PIECE_MIB must be a positive integer, got '$PIECE_MIB'" >&2; exit 2;; esac
PY=${PYTHON:-python3}
WHEELS=$OUT/wheels
SITE=$OUT/site
PIECES=$OUT/pieces
say() { echo; echo "== $*"; }
die() { echo "ERROR: $*" >&2; exit 1; }

# File name and sha256 as published on PyPI.
PINS="
trl-1.16.0-py3-none-any.whl c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396
datasets-4.8.0-py3-none-any.whl 3d1e79657f588baf42cfb4a51dd030ca7467e02222e7e88a5f31011884f4f355
dill-0.4.0-py3-none-any.whl 44f54bf6412c2c8464c14e8243eb163690a9800dbe2c367330883b19c7561049
multiprocess-0.70.18-py312-none-any.whl 9b78f8e5024b573730bfb654783a13800c2c0f2dfc0c25e70b40d184d64adaa2
fsspec-2026.2.0-py3-none-any.whl 98de475b5cb3bd66bedd5c4679e87b4fdfe1a3bf4d707b151b3c07e58c9a2437
xxhash-4.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl 34b86625dc36b54403b525e1d7b74a64343d9b65cee6e94872c6bd70722267ac
"
NPINS=$(grep -c . <<< "$PINS")

# Target interpreter/platform for pip (the GPU machine), independent of the python running pip.
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

say "checking tools"
for t in tar xz split sha256sum realpath; do command -v "$t" >/dev/null || die "'$t' not found"; done
tar --version | head -1 | grep -q 'GNU tar' || die "GNU tar is needed (for --sort=name)"
"$PY" -m pip --version || die "'$PY -m pip' does not work"
mkdir -p "$WHEELS" "$PIECES"
TMP=$(mktemp -d "$OUT/.tmp.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

say "1/3 wheels -> $WHEELS"
: > "$TMP/req.txt"
while read -r f sha; do
  [ -n "$f" ] || continue
  if [ -f "$WHEELS/$f" ] && [ "$(sha_of "$WHEELS/$f")" = "$sha" ]; then
    echo "   have $f"
  else
    name=${f%%-*}; rest=${f#*-}; ver=${rest%%-*}
    echo "$name==$ver --hash=sha256:$sha" >> "$TMP/req.txt"
    echo "   need $name==$ver"
  fi
done <<< "$PINS"
if [ -s "$TMP/req.txt" ]; then
  "$PY" -m pip download --no-deps --only-binary=:all: --require-hashes --no-cache-dir \
      --progress-bar off "${TARGET[@]}" -d "$WHEELS" -r "$TMP/req.txt"
fi
( cd "$WHEELS" && while read -r f sha; do
    [ -n "$f" ] || continue
    [ -f "$f" ] || die "$f missing after download"
    [ "$(sha_of "$f")" = "$sha" ] || die "$f: sha256 differs from the pinned one"
    echo "$sha  $f"
  done <<< "$PINS" > SHA256SUMS )
echo "   $NPINS wheels present, sha256 verified ($WHEELS/SHA256SUMS)"

say "2/3 site -> $SITE"
NEW=$TMP/site
ALL=()
while read -r f _; do [ -n "$f" ] && ALL+=("$WHEELS/$f"); done <<< "$PINS"
"$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --only-binary=:all: \
    --root-user-action=ignore "${TARGET[@]}" --target "$NEW" "${ALL[@]}"
rm -rf "${NEW:?}/bin"                   # console scripts (`trl`): run `python3 -m trl.cli` instead
find "$NEW" -name __pycache__ -type d -prune -exec rm -rf {} +
for f in trl/__init__.py trl/trainer/grpo_trainer.py trl/generation/vllm_client.py datasets/__init__.py \
         dill/__init__.py multiprocess/__init__.py fsspec/__init__.py xxhash/__init__.py; do
  [ -f "$NEW/$f" ] || die "site is missing $f"
done
ls "$NEW"/xxhash/_xxhash.cpython-312-x86_64-linux-gnu.so >/dev/null || die "site is missing xxhash's cp312 extension"
rm -rf "$SITE"
mv "$NEW" "$SITE"
echo "   site: $(find "$SITE" -type f | wc -l) files, $(du -sb "$SITE" | cut -f1) bytes"

say "3/3 pieces -> $PIECES (tar | xz -9e, ${PIECE_MIB} MiB pieces)"
rm -f "$PIECES"/trl_kit.tar.xz.part-* "$PIECES/SHA256SUMS"
tar -C "$OUT" --sort=name --format=gnu --owner=0 --group=0 --numeric-owner \
    --mtime=@1700000000 --mode=u+rwX,go+rX,go-w -cf - site \
  | xz -9e -T0 -c > "$TMP/trl_kit.tar.xz"
xz -t "$TMP/trl_kit.tar.xz"
( cd "$PIECES" && split -b "${PIECE_MIB}M" -a 2 "$TMP/trl_kit.tar.xz" trl_kit.tar.xz.part- \
    && sha256sum trl_kit.tar.xz.part-* > SHA256SUMS )
echo
echo "pieces (bytes):"
( cd "$PIECES" && for f in trl_kit.tar.xz.part-* SHA256SUMS; do printf '  %10d  %s\n' "$(stat -c %s "$f")" "$f"; done )
echo
echo "On the GPU machine: put the pieces and SHA256SUMS into /tmp/trl (or set TRL_KIT), then"
echo "  (cd /tmp/trl && sha256sum -c SHA256SUMS) && cat /tmp/trl/trl_kit.tar.xz.part-* | xz -dc | tar -x -C /tmp/trl"
echo "  export PYTHONPATH=/tmp/trl/site\${PYTHONPATH:+:\$PYTHONPATH}"
echo "(scripts/gpu/run_trl.sh does this itself)."
