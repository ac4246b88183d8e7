#!/usr/bin/env bash
# Smoke-runs every libFuzzer target for a bounded time on its seed corpus.
#
#   ./scripts/fuzz.sh [BUILD_DIR]     default build/asan (the asan preset builds the fuzzers, target
#                                     rc_fuzzers; the fuzz preset works too: build/fuzz)
#
# Environment: FUZZ_SECONDS (per target, default 60), FUZZ_JOBS (targets run at once, default 2).
# Seeds: fuzz/corpus/<target>/ (checked in, read only here); the inputs a run finds go to a
# temporary folder, so the tree stays clean. A crash, sanitizer report, leak or a slow input
# (-timeout) fails the run and leaves the reproducer in fuzz-artifacts/<target>/; reproduce it
# with `build/asan/.../<target> fuzz-artifacts/<target>/crash-...`.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build/asan}"
seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-2}"

mapfile -t fuzzers < <(find "$build" -type f -name '*_fuzzer' -perm -u+x | sort)
if [ "${#fuzzers[@]}" -eq 0 ]; then
  echo "fuzz: no *_fuzzer binaries under $build (build target rc_fuzzers of the asan preset)" >&2
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export ROLLOUTCORE_LOG="${ROLLOUTCORE_LOG:-off}"

run_one() {  # run_one BINARY: one target, its log in $work/<name>.log
  local bin="$1" name seeds rc
  name="$(basename "$bin")"
  seeds="fuzz/corpus/$name"
  mkdir -p "$work/$name.corpus" "fuzz-artifacts/$name"
  if [ ! -d "$seeds" ]; then echo "fuzz: $name has no seed corpus $seeds" >&2; return 1; fi
  rc=0
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="fuzz-artifacts/$name/" "$work/$name.corpus" "$seeds" > "$work/$name.log" 2>&1 || rc=$?
  local runs
  runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$name.log" | grep -o '[0-9]*$' || echo '?')"
  if [ "$rc" -ne 0 ]; then
    echo "fuzz: $name FAILED (exit $rc) after $runs runs; last lines of its log:"
    tail -40 "$work/$name.log"
    return 1
  fi
  rmdir "fuzz-artifacts/$name" 2>/dev/null || true
  echo "fuzz: $name ok: $runs runs in ${seconds}s, $(find "$work/$name.corpus" -type f | wc -l) new inputs"
}
export -f run_one
export work seconds

echo "== fuzz: ${#fuzzers[@]} targets, ${seconds}s each, $jobs at a time"
status=0
printf '%s\n' "${fuzzers[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} || status=1
rmdir fuzz-artifacts 2>/dev/null || true
exit "$status"
