#!/usr/bin/env bash
# Sets up everything, builds rolloutcore (release) and runs the main job.
# Until `rolloutcore demo` exists, the main job is the lifecycle simulator on a shipped scenario
# (a live rollout during an update), printed as a readable report.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build build/release -j "${JOBS:-$(nproc)}" --target rolloutcore
scenario="${1:-examples/scenarios/live_rollout_during_update.json}"
./build/release/src/apps/rolloutcore simulate "$scenario" --format text \
  --expect "${scenario%.json}.expected.json"
