#!/usr/bin/env bash
# Sets up everything, builds rolloutcore (release) and runs the main job: `rolloutcore demo`,
# the whole system on loopback (directory, 2-rank synthetic trainer, engine at tp 2, controller),
# ending with a table and checks. Extra arguments go to `rolloutcore demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# ccache (CMakeLists.txt uses it when installed): paths relative to this checkout, so that clones in
# other folders share one cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
cmake --preset release >/dev/null
cmake --build build/release -j "${JOBS:-$(nproc)}" --target rolloutcore
exec ./build/release/src/apps/rolloutcore demo "$@"
