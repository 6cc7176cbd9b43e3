# bash benchmarks/exp_token_slabs.sh a|b: the token-slab and chained-load experiments of this branch (TERNOP_A8_SLAB,
# TERNOP_A8_CHAIN, TERNOP_A16_SLAB) beside the kernels as dispatched; each part fits in ten minutes
# (a: the GPU tests, then int8 base, slab32 and chain; b: int8 slab16, 16-bit base16, slab8 and slab16, sweep_fused).
# Results go to $OUT (default benchmarks/results/exp), stamped with $TERNOP_BENCH_COMMIT or HEAD.
OUT=${OUT:-benchmarks/results/exp}; mkdir -p "$OUT"; export OUT
C=${TERNOP_BENCH_COMMIT:-$(git rev-parse --short HEAD)}
export PYTHONPATH=$PWD TERNOP_BENCH_COMMIT=$C
nvidia-smi --query-gpu=name --format=csv,noheader
bench() {  # variant
  unset TERNOP_A8_SLAB TERNOP_A8_CHAIN
  case $1 in slab32) export TERNOP_A8_SLAB=32;; slab16) export TERNOP_A8_SLAB=16;; chain) export TERNOP_A8_CHAIN=1;; esac
  timeout 85 python benchmarks/bench_linear.py --no-marlin --below-floors --shapes 1024x4096,1024x6144,2048x1024,3072x1024,4096x4096 --ms 24 32 33 48 64 96 128 --backends cuda_mma_a8 --rows ternop_a8_row --out $OUT/bench_linear_$1_$C.json > $OUT/bench_linear_$1_$C.log 2>&1; echo "$1 rc=$?"
  unset TERNOP_A8_SLAB TERNOP_A8_CHAIN
}
bench16() {  # variant: base16, slab8 or slab16 (TERNOP_A16_SLAB)
  unset TERNOP_A16_SLAB
  case $1 in slab8) export TERNOP_A16_SLAB=8;; slab16) export TERNOP_A16_SLAB=16;; esac
  timeout 85 python benchmarks/bench_linear.py --no-marlin --below-floors --shapes 1024x4096,1024x6144,2048x1024,3072x1024,4096x4096 --ms 16 24 32 33 48 64 --backends cuda_mma --rows ternop --out $OUT/bench_linear16_$1_$C.json > $OUT/bench_linear16_$1_$C.log 2>&1; echo "$1 rc=$?"
  unset TERNOP_A16_SLAB
}
if [ "$1" = a ]; then
  timeout 250 python -m pytest -v -n 8 -p no:cacheprovider tests/cuda/test_linear_cuda.py -k "token_slabs or eight_tiles" > $OUT/pytest_slabs_chain_$C.log 2>&1; echo "pytest rc=$?"; grep -c PASSED $OUT/pytest_slabs_chain_$C.log; grep -E "FAILED|Error" $OUT/pytest_slabs_chain_$C.log | head -5
  bench base; bench slab32; bench chain
else
  bench slab16; bench16 base16; bench16 slab8; bench16 slab16
  timeout 130 python benchmarks/sweep_fused.py --skip-check --a8-only --a8-row --shapes 2048x1024,3072x1024,1024x4096,1024x6144 --ms 128 256 384 512 --out $OUT/sweep_fused_a8row_06b_$C.json > $OUT/sweep_fused_a8row_06b_$C.log 2>&1; echo "sweep_fused rc=$?"
fi
python - <<'PY'
import json, glob, os, collections
out = os.environ["OUT"]; rows = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{out}/bench_linear*.json")):
    v = os.path.basename(f).split("_")[2]
    for r in json.load(open(f))["results"]:
        if r["impl"] in ("backend:cuda_mma_a8[a8 row]", "ternop_a8_row", "backend:triton_a8[a8 row]", "ternop",
                         "backend:cuda_mma[a16]"):
            rows[(r["K"], r["N"], r["M"])][f"{v}:{r['impl'].split(':')[-1][:12]}"] = r["speedup_vs_bf16"]
for k in sorted(rows):
    print(k, " ".join(f"{a}={b}" for a, b in sorted(rows[k].items())))
PY
