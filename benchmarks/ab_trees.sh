# bash benchmarks/ab_trees.sh OLD_TREE OLD_COMMIT [bench_linear.py arguments...]
#
# The same bench_linear.py run on two versions of the package, on one machine, taking turns:
# old, new, old, new. OLD_TREE holds an earlier commit's package (its `ternop/` directory), made with
#   mkdir -p OLD_TREE && git archive OLD_COMMIT ternop | tar -x -C OLD_TREE
# and the new one is this checkout's. Runs of one machine only differ by what changed between the
# two trees, where two full runs on two machines also differ by their cuBLAS and clocks (3-5% at
# small M between two H100s). Each tree builds its own C++ extension (the build cache is keyed by
# the sources' digest), so the first run of each takes a minute or two longer.
#
# Results: $OUT (default benchmarks/results/ab)/bench_linear_{old,new}_r{1,2}_<commit>.json and .log,
# stamped with OLD_COMMIT and this checkout's commit as benchmarks/stamp.py gives it ($TERNOP_BENCH_COMMIT
# if set, else HEAD, marked "-dirty" where tracked code differs from it).
set -euo pipefail
if [ $# -lt 2 ] || [ ! -d "$1/ternop" ]; then
  echo "usage: bash benchmarks/ab_trees.sh OLD_TREE OLD_COMMIT [bench_linear.py arguments...]" >&2
  echo "OLD_TREE must hold an earlier commit's ternop/ package (git archive OLD_COMMIT ternop | tar -x -C OLD_TREE)" >&2
  exit 2
fi
old_tree=$(cd "$1" && pwd)
old_commit=$2
shift 2
new_commit=$(python benchmarks/stamp.py)  # $TERNOP_BENCH_COMMIT, else HEAD with "-dirty" for changed code
OUT=${OUT:-benchmarks/results/ab}
mkdir -p "$OUT"
run() {  # tag, package root, commit, round
  local out="$OUT/bench_linear_$1_r$4_$3" rc=0
  PYTHONPATH="$2" TERNOP_BENCH_COMMIT="$3" python benchmarks/bench_linear.py --no-marlin "${@:5}" \
    --out "$out.json" > "$out.log" 2>&1 || rc=$?
  echo "$1 r$4 ($3): rc=$rc"
}
for round in 1 2; do
  run old "$old_tree" "$old_commit" "$round" "$@"
  run new "$PWD" "$new_commit" "$round" "$@"
done
python - "$OUT" "$old_commit" "$new_commit" <<'PY'
import json, os, statistics, sys
out, old, new = sys.argv[1:]
def times(tag, commit):
    paths = [f"{out}/bench_linear_{tag}_r{r}_{commit}.json" for r in (1, 2)]
    runs = [json.load(open(p))["results"] for p in paths if os.path.exists(p)]  # a failed run wrote none
    cells = {}
    for results in runs:
        for row in results:
            cells.setdefault((row["impl"], row["K"], row["N"], row["M"]), []).append(row["us"])
    return {key: statistics.median(us) for key, us in cells.items()}
a, b = times("old", old), times("new", new)
print(f"new / old time a call, median of two rounds each ({new} against {old}):")
for key in sorted(set(a) & set(b)):
    if key[0] != "cublas_bf16":
        print(f"  {key[0]:>16} {key[1]:5d}->{key[2]:5d} M={key[3]:5d}  {b[key] / a[key]:.3f}")
PY
