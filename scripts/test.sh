#!/usr/bin/env bash
# Sets up everything and runs the test suite.
#
#   ./scripts/test.sh            dev build, every test except those labelled gpu or slow; the dev
#                                preset also builds the Python extension and runs the pytest suite
#                                (python/tests, CTest test python_tests, labels e2e and python)
#   ./scripts/test.sh asan       AddressSanitizer+UBSan build (clang), unit and fault tests; also
#                                builds the libFuzzer targets (scripts/fuzz.sh runs them)
#   ./scripts/test.sh tsan       ThreadSanitizer build (clang, -Wthread-safety -Werror), unit and
#                                fault tests
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
case "$preset" in
  # The TRL integration's CPU test (CTest python_trl_tests) runs in its own environment.
  dev|release) ./scripts/trl-env.sh ;;
esac
# ccache (CMakeLists.txt uses it when installed): paths relative to this checkout, so that clones in
# other folders share one cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"

echo "== configure ($preset)"
cmake --preset "$preset" >/dev/null
# The sanitizer trees build only what their tests need: the unit and fault test binaries (CMake
# targets rc_tests_unit / rc_tests_fault, cmake/RolloutcoreHelpers.cmake), and in the asan tree the
# libFuzzer targets (rc_fuzzers, run by scripts/fuzz.sh). Not the app, e2e tests or benchmarks.
case "$preset" in
  asan) targets=(--target rc_tests_unit rc_tests_fault rc_fuzzers) ;;
  tsan) targets=(--target rc_tests_unit rc_tests_fault) ;;
  *)    targets=() ;;
esac
echo "== build ($preset, $jobs jobs${targets[*]:+, ${targets[*]:1}})"
t0=$(date +%s)
cmake --build "build/$preset" -j "$jobs" "${targets[@]}"
echo "== build ($preset) took $(( $(date +%s) - t0 ))s"

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
t0=$(date +%s)
# shellcheck disable=SC2086
ctest "${args[@]}" ${CTEST_ARGS:-}
echo "== test ($preset) took $(( $(date +%s) - t0 ))s"
