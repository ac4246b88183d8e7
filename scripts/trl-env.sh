#!/usr/bin/env bash
# The Python environment of the TRL integration's CPU test (python/tests/test_trl_integration.py,
# CTest python_trl_tests; docs/trl.md): a virtual environment at build/trl-venv, made from the
# python3 that builds rolloutcore's extension, with PyTorch, TRL and what they need from PyPI,
# pinned. PyPI's Linux torch is the CUDA build: it runs on the CPU, but pulls ~2.8 GB of wheels
# (nvidia-*, triton) and the environment takes ~6 GB of disk; installing it took 78 s here.
# Nothing is installed outside build/trl-venv. Re-running with the pins satisfied does nothing.
#
#   ./scripts/trl-env.sh            create or complete build/trl-venv
#   TRL_VENV=DIR ./scripts/trl-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_VENV:-build/trl-venv}"
PINS=(torch==2.15.0 trl==1.16.0 transformers==5.25.0 datasets==5.2.0 accelerate==1.16.0
      safetensors==0.8.0 numpy==2.4.6 pytest==9.2.0)
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "${PINS[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
PY
  echo "[trl-env] $VENV: all pins present"
  exit 0
fi
if ! python3 -m venv "$VENV"; then
  echo "[trl-env] python3 -m venv $VENV failed: this python3 ($(command -v python3)) lacks venv/ensurepip" >&2
  exit 1
fi
echo "[trl-env] pip install into $VENV: ${PINS[*]} (~2.8 GB of wheels)"
t0=$(date +%s)
"$VENV/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check "${PINS[@]}"
echo "[trl-env] installed in $(( $(date +%s) - t0 ))s; $(du -sh "$VENV" | cut -f1) on disk"
