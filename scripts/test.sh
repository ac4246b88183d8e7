#!/usr/bin/env bash
# Sets up everything and runs the test suite.
#
#   ./scripts/test.sh            dev build, every test except those labelled gpu or slow; the dev
#                                preset also builds the Python extension and runs the pytest suite
#                                (python/tests, CTest test python_tests, labels e2e and python)
#   ./scripts/test.sh asan       AddressSanitizer+UBSan build, unit and fault tests
#   ./scripts/test.sh tsan       ThreadSanitizer build, unit and fault tests
#   ./scripts/test.sh release    optimized build, same tests as dev
#
# Environment: JOBS (parallel build/test jobs, default: number of cores),
#              CTEST_ARGS (extra ctest arguments, e.g. "-R Lifecycle").
set -euo pipefail
cd "$(dirname "$0")/.."

preset="${1:-dev}"
case "$preset" in
  dev|release|asan|tsan) ;;
  *) echo "usage: $0 [dev|release|asan|tsan]" >&2; exit 2 ;;
esac
jobs="${JOBS:-$(nproc)}"

./scripts/install-deps.sh

echo "== configure ($preset)"
cmake --preset "$preset" >/dev/null
echo "== build ($preset, $jobs jobs)"
cmake --build "build/$preset" -j "$jobs"

echo "== test ($preset)"
case "$preset" in
  asan|tsan) labels='unit|fault' ;;
  *)         labels='' ;;
esac
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp}"
export ROLLOUTCORE_LOG="${ROLLOUTCORE_LOG:-warn}"
args=(--test-dir "build/$preset" --output-on-failure -j "$jobs" -LE 'gpu|slow')
if [ -n "$labels" ]; then args+=(-L "$labels"); fi
# shellcheck disable=SC2086
ctest "${args[@]}" ${CTEST_ARGS:-}
