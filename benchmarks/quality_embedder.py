"""Quality of a ternary embedding model other than the demo's, post-training, through vLLM.

Each row is a checkpoint made by one exact ``ternop quantize`` command (recorded with its seconds)
and scored by ``ternop eval`` (vLLM, fp32 activations) against the fp model on every set of
``ternop.cli.evaldata.suite()``: Lee-50 and wiki retrieval (visible), the held-out split, and the
cosine to the fp embeddings. The calibration text is quality_minilm.py's.

    python benchmarks/quality_embedder.py --model DIR --name embeddinggemma-300m --work WORK [--force]

Writes benchmarks/results/cpu/quality_<name>.json, and each row's checkpoint and report in WORK
(row0, row0.json, ...); refuses to replace any of them that already exist unless given ``--force``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality_minilm import CALIB_RECIPE, write_calibration_text  # noqa: E402
from stamp import git_commit  # noqa: E402

# name -> the ternop quantize arguments after SRC DST (CALIB is filled in).
ROWS = {
    "optimal": "--method optimal",
    "calibrated": "--method calibrated --calib CALIB",
    "calibrated, 32,768 calibration tokens": "--method calibrated --calib CALIB --calib-tokens 32768",
}
METRICS = ("lee50_spearman", "wiki_r1", "wiki_r10", "wiki_mrr", "heldout_passage_mrr", "heldout_short_mrr",
           "heldout_simlex_spearman", "heldout_wordsim_spearman")  # fmt: skip


def _ternop(args: list[str]) -> float:
    from ternop.cli import main

    print("$ ternop " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    if main(args) != 0:
        raise RuntimeError(f"ternop {' '.join(args)} failed")
    return time.perf_counter() - t0


def markdown(rows: list[dict]) -> str:
    head = ("| weights | Lee-50 | wiki R@1 | R@10 | MRR | held-out passages MRR | short queries MRR | SimLex | "
            "WordSim | cos to fp32 (mean / min) | held out (mean / min) | linear bytes | seconds |")  # fmt: skip
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        m = r["metrics"]
        cells = " | ".join(f"{m[k]:.3f}" for k in METRICS)
        cos = r["cosine"]
        sec = "-" if r["seconds"] is None else f"{r['seconds']:.0f} s"
        lines.append(f"| {r['name']} | {cells} | {cos['mean']:.3f} / {cos['min']:.3f} | "
                     f"{cos['heldout_mean']:.3f} / {cos['heldout_min']:.3f} | {r['linear_bytes'] / 1e6:.2f} MB | {sec} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the fp sentence-transformers folder")
    p.add_argument("--name", required=True, help="the model's name in the results (and their file name)")
    p.add_argument("--work", required=True, help="folder for the checkpoints and the eval reports")
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS), metavar="NAME")
    p.add_argument("--out", help="default: benchmarks/results/cpu/quality_<name>.json")
    p.add_argument("--force", action="store_true", help="replace the checkpoints, reports and --out if they exist")
    args = p.parse_args()
    out = Path(args.out or HERE / "results" / "cpu" / f"quality_{args.name}.json")
    work = Path(args.work)
    made = [q for i in range(len(args.rows)) for q in (work / f"row{i}", work / f"row{i}.json")]
    existing = [str(q) for q in (*made, out) if q.exists()]
    if existing and not args.force:
        p.error(f"{', '.join(existing)} already exist(s); pass --force to replace")

    from ternop.quant.artifact import sha256_of

    base = Path(args.model)
    work.mkdir(parents=True, exist_ok=True)
    calib = write_calibration_text(work / "calib.txt")
    commit = git_commit()
    rows, reports = [], []
    for i, name in enumerate(args.rows):
        dst, report = work / f"row{i}", work / f"row{i}.json"
        quantize = ROWS[name].replace("CALIB", str(calib)).split()
        seconds = _ternop(["quantize", str(base), str(dst), *quantize, "--force", "--quiet"])
        _ternop(["eval", str(base), str(dst), "--json", str(report)])
        r = json.loads(report.read_text())
        reports.append(r)
        a, mem = r["agreement"], r["memory"]
        rows.append({"name": name, "command": "ternop quantize MODEL DST " + ROWS[name], "seconds": seconds,
                     "metrics": {k: r["models"]["ternary"][k] for k in METRICS},
                     "cosine": {"mean": a["mean_cosine"], "min": a["min_cosine"],
                                "heldout_mean": a["heldout_mean_cosine"], "heldout_min": a["heldout_min_cosine"]},
                     "linear_bytes": mem["ternary"]["disk_linear"], "total_bytes": mem["ternary"]["disk_total"],
                     "quantized_layers": mem["quantized_layers"], "eval_seconds": r["seconds"]})  # fmt: skip
    # Every report scores the same fp model; the first one's figures make the fp32 row.
    fp, base_mem = reports[0]["models"]["base"], reports[0]["memory"]["base"]
    fp_row = {"name": "fp32", "command": None, "seconds": None, "metrics": {k: fp[k] for k in METRICS},
              "cosine": {"mean": 1.0, "min": 1.0, "heldout_mean": 1.0, "heldout_min": 1.0},
              "linear_bytes": base_mem["disk_linear"], "total_bytes": base_mem["disk_total"]}  # fmt: skip
    rows = [fp_row, *rows]
    table = markdown(rows)
    weights = sorted(base.glob("*.safetensors"))
    result = {
        "model": args.name,
        "model_files_sha256": {w.name: sha256_of(w) for w in weights},
        "scored_through": "ternop eval: vLLM, float32 activations, the op's CPU reference for ternary layers",
        "calibration_text": CALIB_RECIPE,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},  # fmt: skip
        "commit": commit,
        "rows": rows,
        "table_markdown": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
