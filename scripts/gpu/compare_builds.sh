#!/usr/bin/env bash
# Old against new: the same benchmarks from two builds, alternated in one sitting, on the GPU
# machine (16 quiet cores and the H200; the development machine is too noisy for a 3 % bound).
# Used for "behaviour and speed unchanged" refactors (issue 38: bench refit shm, bench cycle tiny
# and qwen3-0.6b, bench refit cuda_ipc).
#
#   scripts/gpu/compare_builds.sh OLD_BUNDLE NEW_BUNDLE [ROUNDS=2]
#
# Each bundle is a folder with bin/rolloutcore and lib/ (scripts/gpu/make_bundle.sh, plain or
# PYTHON=1). Per round the order alternates (old new, then new old, ...), so drift of the machine
# falls on both. Writes every report to $OUT/compare (OUT default ./out-gpu) and prints, per figure,
# the median of each build and new/old. BENCHES (default "shm tiny qwen06 cuda_ipc") picks a subset.
# For the cycle benches (tiny, qwen06, run with --trace) it then prints where a difference sits:
# per part of the cycle (the report's per-cycle fields and their parts) and per step of the
# engine's stage (the trace's "stage parts"), medians over the warm cycles of all runs.
set -uo pipefail
if [[ $# -lt 2 || "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
OLD=$(realpath "$1")
NEW=$(realpath "$2")
ROUNDS=${3:-2}
case $ROUNDS in '' | *[!0-9]* | 0) echo "ROUNDS must be a positive integer, got '$ROUNDS'" >&2; exit 2 ;; esac
for b in "$OLD" "$NEW"; do
  [[ -x "$b/bin/rolloutcore" ]] || { echo "no executable $b/bin/rolloutcore" >&2; exit 2; }
done
OUT_DIR=${OUT:-$PWD/out-gpu}/compare
mkdir -p "$OUT_DIR"
BENCHES=${BENCHES:-shm tiny qwen06 cuda_ipc}
has_gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=1

run_one() {  # run_one BUNDLE NAME ROUND BENCH
  local b=$1 name=$2 round=$3 bench=$4 out="$OUT_DIR/$4.$2.$3.json" t0=$SECONDS
  local -a args
  case $bench in
    shm) args=(bench refit --model qwen3-0.6b --transport shm --repeats 5 --json) ;;
    tiny) args=(bench cycle --model tiny --cycles "${TINY_CYCLES:-8}" --restarts 1 --trace --json) ;;
    qwen06) args=(bench cycle --model qwen3-0.6b --cycles 3 --restarts 1 --trace --json) ;;
    cuda_ipc)
      [[ $has_gpu == 1 ]] || { echo "  $bench: skipped (no GPU)"; return 0; }
      args=(bench refit --transport cuda_ipc --model qwen3-8b --source fsdp:1 --target tp:1 --owner-device 0
            --device 0 --repeats 5 --json-out "$out") ;;
    *) echo "unknown bench '$bench' (shm tiny qwen06 cuda_ipc)" >&2; return 2 ;;
  esac
  if [[ $bench == cuda_ipc ]]; then
    LD_LIBRARY_PATH="$b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 300 "$b/bin/rolloutcore" "${args[@]}" \
      >"$OUT_DIR/$bench.$name.$round.log" 2>&1
  else
    LD_LIBRARY_PATH="$b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 300 "$b/bin/rolloutcore" "${args[@]}" \
      >"$out" 2>"$OUT_DIR/$bench.$name.$round.log"
  fi
  local rc=$?
  echo "  $bench $name round $round: rc=$rc, $((SECONDS - t0)) s"
  return $rc
}

rc=0
for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then order=("old:$OLD" "new:$NEW"); else order=("new:$NEW" "old:$OLD"); fi
  for bench in $BENCHES; do
    for e in "${order[@]}"; do
      run_one "${e#*:}" "${e%%:*}" "$r" "$bench" || rc=1
    done
  done
done

python3 - "$OUT_DIR" <<'PY'
import glob, json, os, statistics, sys
d = sys.argv[1]
# figure: (bench, label, path into the report, lower is better)
figures = [
    ("shm", "refit shm e2e_ms", ["e2e_ms"]),
    ("shm", "refit shm wire_gbps_best", ["wire_gbps_best"]),
    ("tiny", "cycle tiny cycle_ms_median", ["cycle", "cycle_ms_median"]),
    ("tiny", "cycle tiny pause_window_ms_median", ["cycle", "pause_window_ms_median"]),
    ("qwen06", "cycle qwen3-0.6b cycle_ms_median", ["cycle", "cycle_ms_median"]),
    ("qwen06", "cycle qwen3-0.6b stage (wire) ms, cycle 2+", ["cycle", "cycles", "*wire_ms"]),
    ("cuda_ipc", "refit cuda_ipc wire_gbps", ["wire_gbps"]),
    ("cuda_ipc", "refit cuda_ipc install_gbps", ["install_gbps"]),
    ("cuda_ipc", "refit cuda_ipc digest_best_ms", ["digest_best_ms"]),
]
def get(rep, path):
    v = rep
    for k in path:
        if k.startswith("*"):  # a list of cycles: the warm ones' median
            vals = [c[k[1:]] for c in v if not c.get("cold")]
            return statistics.median(vals) if vals else None
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v
print(f"{'figure':48} {'old (median)':>14} {'new (median)':>14} {'new/old':>8}  runs")
for bench, label, path in figures:
    vals = {}
    for name in ("old", "new"):
        xs = []
        for f in sorted(glob.glob(os.path.join(d, f"{bench}.{name}.*.json"))):
            try:
                x = get(json.load(open(f)), path)
            except (ValueError, OSError):
                x = None
            if isinstance(x, (int, float)):
                xs.append(float(x))
        vals[name] = xs
    if not vals["old"] or not vals["new"]:
        continue
    o, n = statistics.median(vals["old"]), statistics.median(vals["new"])
    print(f"{label:48} {o:14.3f} {n:14.3f} {n / o if o else float('nan'):8.3f}  "
          f"old {['%.2f' % x for x in vals['old']]} new {['%.2f' % x for x in vals['new']]}")

# Where a cycle's difference sits: every numeric per-cycle field and field.part, warm cycles of all
# runs pooled, and the engine's stage steps from the trace's "stage parts of VERSION (ms, engine): {...}".
def flat(c, prefix=""):
    for k, v in c.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            yield prefix + k, float(v)
        elif isinstance(v, dict) and not prefix:
            yield from flat(v, k + ".")
for bench in ("tiny", "qwen06"):
    pooled = {"old": {}, "new": {}}
    for name in ("old", "new"):
        for f in sorted(glob.glob(os.path.join(d, f"{bench}.{name}.*.json"))):
            try:
                cycles = json.load(open(f))["cycle"]["cycles"]
            except (ValueError, OSError, KeyError, TypeError):
                continue
            for c in cycles:
                if c.get("cold"):
                    continue
                for k, v in flat(c):
                    pooled[name].setdefault(k, []).append(v)
        for f in sorted(glob.glob(os.path.join(d, f"{bench}.{name}.*.log"))):
            parts = []
            for line in open(f, errors="replace"):
                if "stage parts of" in line and ": {" in line:
                    try:
                        parts.append(json.loads(line.split(": ", 1)[1]))
                    except ValueError:
                        pass
            for p in parts[1:]:  # the first stage is cold (allocation, imports, plan)
                for k, v in p.items():
                    if isinstance(v, (int, float)):
                        pooled[name].setdefault("engine_stage." + k, []).append(float(v))
    keys = sorted(set(pooled["old"]) & set(pooled["new"]))
    if not keys:
        continue
    print(f"\n{bench}: parts, medians over warm cycles (ms unless named), new-old")
    for k in keys:
        o, n = statistics.median(pooled["old"][k]), statistics.median(pooled["new"][k])
        if max(abs(o), abs(n)) < 1e-3:
            continue
        print(f"  {k:58} {o:10.3f} {n:10.3f} {n - o:+9.3f}")
PY
exit $rc
