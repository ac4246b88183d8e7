#!/usr/bin/env bash
# Runs clang-tidy (config: .clang-tidy) over the C++ files changed since a base commit, and fails
# on any finding in those files.
#
#   ./scripts/lint.sh [BASE]     BASE default: $LINT_BASE, else HEAD~1 (the last commit's changes;
#                                after a merge, everything the merge brought). On a branch, lint all
#                                of it with `./scripts/lint.sh $(git merge-base origin/main HEAD)`.
#                                Without a parent commit (shallow clone): every tracked C++ file.
#   LINT_ALL=1 ./scripts/lint.sh every tracked C++ file.
#
# Environment: LINT_BUILD (tree whose compile_commands.json is used, default build/tsan, the clang
# tree; configured here if missing), JOBS (parallel clang-tidy processes, default nproc).
# Only findings located in the changed files count (--line-filter), not those in other headers the
# files include. A changed header is checked through the .cc of the same name next to it (or, for
# include/rolloutcore/<m>/x.h, src/<m>/x.cc); a header with none is checked through the first
# translation unit that includes it. Files outside the tree (CUDA, UCX, Python extension sources
# when the tree does not build them) are listed as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${LINT_BUILD:-build/tsan}"
jobs="${JOBS:-$(nproc)}"
if [ ! -f "$build/compile_commands.json" ]; then
  cmake --preset "$(basename "$build")" >/dev/null
fi

if [ "${LINT_ALL:-0}" = 1 ]; then
  mapfile -t changed < <(git ls-files -- '*.cc' '*.h')
  what="all tracked files"
else
  base="${1:-${LINT_BASE:-HEAD~1}}"
  if git rev-parse -q --verify "$base^{commit}" >/dev/null; then
    mapfile -t changed < <(git diff --name-only --diff-filter=d "$base" -- '*.cc' '*.h')
    what="changed since $base ($(git rev-parse --short "$base"))"
  else
    mapfile -t changed < <(git ls-files -- '*.cc' '*.h')
    what="all tracked files ($base does not exist)"
  fi
fi

# Map each changed file to a translation unit of the compile database.
mapfile -t tus < <(python3 - "$build/compile_commands.json" "${changed[@]}" <<'PY'
import json, os, sys
db = json.load(open(sys.argv[1]))
root = os.getcwd()
units = {os.path.relpath(os.path.realpath(e["file"]), root) for e in db}
picked, skipped = [], []
for f in sys.argv[2:]:
    if not os.path.exists(f):
        continue
    if f.endswith(".cc"):
        (picked if f in units else skipped).append((f, f))
        continue
    stem = os.path.splitext(f)[0]
    cands = [stem + ".cc"]
    parts = f.split("/")
    if parts[:2] == ["include", "rolloutcore"] and len(parts) >= 4:
        cands.append("/".join(["src"] + parts[2:-1] + [os.path.splitext(parts[-1])[0] + ".cc"]))
    tu = next((c for c in cands if c in units), None)
    if tu is None:
        inc = f.split("include/", 1)[1] if f.startswith("include/") else "/".join(parts[1:]) if parts[0] == "src" else f
        for u in sorted(units):
            try:
                if ('"' + inc + '"') in open(u, errors="replace").read():
                    tu = u
                    break
            except OSError:
                pass
    (picked if tu else skipped).append((f, tu))
for f, tu in skipped:
    print("SKIP " + f, flush=True)
for f, tu in picked:
    print(tu + " " + f)
PY
)

declare -A unit_files=()
files_json=()
for line in "${tus[@]}"; do
  case "$line" in
    SKIP\ *) echo "lint: skipped ${line#SKIP } (not in $build/compile_commands.json)" ;;
    *) tu="${line%% *}"; f="${line#* }"; unit_files["$tu"]=1; files_json+=("{\"name\":\"$f\"}") ;;
  esac
done
if [ "${#unit_files[@]}" -eq 0 ]; then
  echo "lint: no C++ file to check ($what)"
  exit 0
fi
filter="[$(IFS=,; echo "${files_json[*]}")]"
echo "== clang-tidy: ${#files_json[@]} files $what, through ${#unit_files[@]} translation units, $jobs jobs"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
printf '%s\n' "${!unit_files[@]}" | sort |
  xargs -P "$jobs" -n 1 clang-tidy -p "$build" --quiet --line-filter="$filter" > "$log" 2>&1 || status=$?
grep -v -E '^[0-9]+ warnings? (and [0-9]+ errors? )?generated\.$|^Suppressed [0-9]+ warnings|^Use -header-filter|^Error while processing' "$log" || true
if [ "$status" -ne 0 ] || grep -q -E ': (warning|error): ' "$log"; then
  echo "lint: clang-tidy findings above (config .clang-tidy; fix them, or NOLINT(check) with the reason)"
  exit 1
fi
echo "lint: clean"
