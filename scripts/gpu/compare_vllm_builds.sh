#!/usr/bin/env bash
# Old against new on a real vLLM (GPU machine): `rolloutcore bench cycle --engine vllm` (through
# run_vllm_bench.sh, so the kit is selected as there: VLLM_KIT, VB) from two builds of the package,
# alternated run by run (old new, new old, ...), then per figure the median of each build over the
# warm cycles of all its runs, the median of its run medians, and new/old for both.
#
#   scripts/gpu/compare_vllm_builds.sh OLD_BUNDLE NEW_BUNDLE [RUNS_EACH=2] [SHAPE=8b]
#
# Each bundle is a PYTHON=1 scripts/gpu/make_bundle.sh folder. CYCLES (default 6) per run; the runs
# skip the restart and the digest bench (BENCH_ARGS adds to that). STOP_AFTER_S (default 480) stops
# starting runs past that many seconds, so a GPU call still prints its summary. Logs in
# $OUT/compare-vllm (OUT default ./out-vllm).
set -uo pipefail
if [[ $# -lt 2 || "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
OLD=$(realpath "$1")
NEW=$(realpath "$2")
RUNS=${3:-2}
SHAPE=${4:-8b}
case $RUNS in '' | *[!0-9]* | 0) echo "RUNS_EACH must be a positive integer, got '$RUNS'" >&2; exit 2 ;; esac
for b in "$OLD" "$NEW"; do
  [[ -x "$b/bin/rolloutcore" && -d "$b/python" ]] || { echo "$b is not a PYTHON=1 bundle (bin/rolloutcore, python/)" >&2; exit 2; }
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${OUT:-$ROOT/out-vllm}/compare-vllm
mkdir -p "$DIR"
t0=$SECONDS
rc=0
# GPU processes that were there before the first run are left alone; any other one still alive
# after a run (a vLLM server whose bench died, e.g. of an OOM in the trainer) is killed, so that the
# next run neither lacks its memory nor talks to a server of the other build on the same port.
gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | sort -u; }
before=$(gpu_pids)
reap_leftovers() {
  local p left
  left=$(comm -13 <(echo "$before") <(gpu_pids))
  [[ -z $left ]] && return
  echo "  killing GPU processes left by the run: ${left//$'\n'/ }"
  for p in $left; do kill -9 "$p" 2>/dev/null; done
  sleep 3
}
for ((r = 1; r <= RUNS; r++)); do
  if ((r % 2)); then order=(old new); else order=(new old); fi
  for name in "${order[@]}"; do
    if ((SECONDS - t0 > ${STOP_AFTER_S:-480})); then
      echo "stopping: ${STOP_AFTER_S:-480} s passed"; break 2
    fi
    b=$NEW; [[ $name == old ]] && b=$OLD
    # shellcheck disable=SC2086
    RC_BUNDLE=$b OUT="$DIR/$name.$r" CYCLES=${CYCLES:-6} BENCH_ARGS="--no-restart --no-digest-bench ${BENCH_ARGS:-}" \
      "$ROOT/scripts/gpu/run_vllm_bench.sh" "$SHAPE" >"$DIR/$name.$r.log" 2>&1 || rc=1
    echo "  $name run $r: $(grep -c '"hot_cycle_ms"' "$DIR/$name.$r.log") cycles, $((SECONDS - t0)) s"
    reap_leftovers
  done
done
python3 - "$DIR" "$SHAPE" <<'PY'
import glob, json, os, statistics, sys
d, shape = sys.argv[1], sys.argv[2]
keys = ["hot_cycle_ms", "stage_ms", "stage_engine_ms", "stage_wire_ms", "stage_digest_ms", "pause_window_ms",
        "pause_call_ms", "install_call_ms", "install_ms", "install_kernel_ms", "reset_ms", "resume_ms",
        "first_token_ms"]
pooled = {"old": {}, "new": {}}
per_run = {"old": {}, "new": {}}
for name in ("old", "new"):
    for f in sorted(glob.glob(os.path.join(d, f"{name}.*", "kit-*", f"bench_vllm_{shape}.json"))):
        rows = json.load(open(f)).get("rows", [])[1:]  # the first cycle is cold
        for k in keys:
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            if vals:
                pooled[name].setdefault(k, []).extend(vals)
                per_run[name].setdefault(k, []).append(statistics.median(vals))
        for r in rows:
            for k, v in (r.get("stage_parts_ms") or {}).items():
                if isinstance(v, (int, float)):
                    pooled[name].setdefault("stage_parts." + k, []).append(v)
print(f"{'figure (warm cycles)':34} {'old':>9} {'new':>9} {'new/old':>8}   {'run medians old | new':>s}")
for k in sorted(set(pooled["old"]) & set(pooled["new"]), key=lambda k: (k.startswith("stage_parts"), k)):
    o, n = statistics.median(pooled["old"][k]), statistics.median(pooled["new"][k])
    runs = ""
    if k in per_run["old"] and k in per_run["new"]:
        ro, rn = statistics.median(per_run["old"][k]), statistics.median(per_run["new"][k])
        runs = (f"{' '.join('%.1f' % x for x in per_run['old'][k])} | {' '.join('%.1f' % x for x in per_run['new'][k])}"
                f"  (of run medians {rn / ro if ro else float('nan'):.3f})")
    print(f"{k:34} {o:9.3f} {n:9.3f} {n / o if o else float('nan'):8.3f}   {runs}")
PY
exit $rc
