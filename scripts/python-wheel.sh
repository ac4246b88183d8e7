#!/usr/bin/env bash
# Builds wheels of the Python package (extension + `rolloutcore` binary + the shared libraries a
# plain Ubuntu/Debian may lack) for one or more interpreters, into build/wheels/.
#
#   ./scripts/python-wheel.sh                         for python3
#   ./scripts/python-wheel.sh /path/to/python3.12 ... for each interpreter given
#
# All interpreters share one CMake tree (build/python-wheel), so a second interpreter rebuilds
# only the extension. The wheel is what to carry to a machine without the build dependencies
# (docs/python.md, "On a machine without the build tools"): pip install --no-deps WHEEL there.
# Environment: JOBS (parallel build jobs, default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-$(nproc)}"
pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then pythons=(python3); fi
mkdir -p build/wheels
for py in "${pythons[@]}"; do
  echo "== wheel for $("$py" --version 2>&1) ($py)"
  "$py" -m pip wheel . --no-deps -w build/wheels
done
ls -l build/wheels
