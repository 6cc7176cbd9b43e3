"""Quality of a ternary embedding model other than the demo's, post-training, through vLLM.

Each row is a checkpoint made by one exact ``ternop quantize`` command (recorded with its seconds)
and scored by ``ternop eval`` (vLLM, fp32 activations) against the fp model on every set of
``ternop.cli.evaldata.suite()``: Lee-50 and wiki retrieval (visible), the held-out split, and the
cosine to the fp embeddings. The calibration text is quality_minilm.py's.

    python benchmarks/quality_embedder.py --model DIR --name embeddinggemma-300m --work WORK [--force]
    python benchmarks/quality_embedder.py --model DIR --name NAME --work WORK --rows --merge \
        [--artifact "ROW=FILE@SECONDS" ...] [--checkpoint "ROW=DIR@SECONDS" ...] [--command "ROW=TEXT" ...]

Writes benchmarks/results/cpu/quality_<name>.json, and each row's checkpoint and report in WORK
(row0, row0.json, ...); refuses to replace any of them that already exist unless given ``--force``.
A row can also come from a checkpoint made elsewhere (``--checkpoint``, e.g. a ``ternop distill``
run's DST) or from a ``ternop.quant.artifact`` file (``--artifact``, e.g. a GPU distillation's,
assembled here from the fp model), recorded with the seconds given and the ``--command`` that made
it; ``--merge`` keeps the rows of the existing results that this run does not score again.
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
from quality_minilm import CALIB_RECIPE, row_spec, write_calibration_text  # noqa: E402
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


def _spec(text: str) -> tuple[str, str, float | None]:
    """quality_minilm's row_spec, refusing a spec without a row name or a path."""
    name, path, seconds = row_spec(text)
    if not name or not path:
        raise SystemExit(f"{text!r}: expected NAME=PATH@SECONDS")
    return name, path, seconds


def _row(name: str, command: str | None, seconds: float | None, r: dict, commit: str) -> dict:
    a, mem = r["agreement"], r["memory"]
    return {"name": name, "command": command, "seconds": seconds,
            "metrics": {k: r["models"]["ternary"][k] for k in METRICS},
            "cosine": {"mean": a["mean_cosine"], "min": a["min_cosine"],
                       "heldout_mean": a["heldout_mean_cosine"], "heldout_min": a["heldout_min_cosine"]},
            "linear_bytes": mem["ternary"]["disk_linear"], "total_bytes": mem["ternary"]["disk_total"],
            "quantized_layers": mem["quantized_layers"], "eval_seconds": r["seconds"], "commit": commit}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the fp sentence-transformers folder")
    p.add_argument("--name", required=True, help="the model's name in the results (and their file name)")
    p.add_argument("--work", required=True, help="folder for the checkpoints and the eval reports")
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS), metavar="NAME")
    p.add_argument("--out", help="default: benchmarks/results/cpu/quality_<name>.json")
    p.add_argument("--artifact", nargs="+", default=[], metavar="ROW=FILE@SECONDS",
                   help="a row from a ternop.quant.artifact file, assembled in WORK from --model")
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="ROW=DIR@SECONDS",
                   help="a row from a ternary checkpoint made beforehand")
    p.add_argument("--command", nargs="+", default=[], metavar="ROW=TEXT",
                   help="how an --artifact or --checkpoint row was made")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of an existing --out that this run does not redo")
    p.add_argument("--force", action="store_true", help="replace the checkpoints, reports and --out if they exist")
    args = p.parse_args()
    out = Path(args.out or HERE / "results" / "cpu" / f"quality_{args.name}.json")
    work = Path(args.work)
    extra = [("artifact", *_spec(t)) for t in args.artifact] + [("checkpoint", *_spec(t)) for t in args.checkpoint]
    if not args.rows and not extra:
        p.error("nothing to score: no --rows, --artifact or --checkpoint")
    commands = dict(c.partition("=")[::2] for c in args.command)
    unknown = sorted(set(commands) - {name for _, name, _, _ in extra})
    if unknown:
        p.error(f"--command for {', '.join(map(repr, unknown))}: no --artifact or --checkpoint row of that name")
    made = [q for i in range(len(args.rows)) for q in (work / f"row{i}", work / f"row{i}.json")]
    made += [work / f"extra{i}.json" for i in range(len(extra))]
    made += [work / f"extra{i}" for i, (kind, *_) in enumerate(extra) if kind == "artifact"]
    existing = [str(q) for q in (*made, *([] if args.merge else [out])) if q.exists()]
    if existing and not args.force:
        p.error(f"{', '.join(existing)} already exist(s); pass --force to replace")

    from ternop.quant import artifact

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
        rows.append(_row(name, "ternop quantize MODEL DST " + ROWS[name], seconds, r, commit))
    for i, (kind, name, path, seconds) in enumerate(extra):
        dst, report = Path(path), work / f"extra{i}.json"
        if kind == "artifact":
            dst = work / f"extra{i}"
            artifact.assemble(path, base, dst, overwrite=True, progress=True)
        _ternop(["eval", str(base), str(dst), "--json", str(report)])
        r = json.loads(report.read_text())
        reports.append(r)
        rows.append(_row(name, commands.get(name), seconds, r, commit))
        if kind == "artifact":
            rows[-1].update({"artifact": Path(path).name, "artifact_sha256": artifact.sha256_of(path)})
    # Every report scores the same fp model; the first one's figures make the fp32 row.
    fp, base_mem = reports[0]["models"]["base"], reports[0]["memory"]["base"]
    fp_row = {"name": "fp32", "command": None, "seconds": None, "metrics": {k: fp[k] for k in METRICS},
              "cosine": {"mean": 1.0, "min": 1.0, "heldout_mean": 1.0, "heldout_min": 1.0},
              "linear_bytes": base_mem["disk_linear"], "total_bytes": base_mem["disk_total"]}  # fmt: skip
    notes = {}
    if args.merge and out.exists():
        before = json.loads(out.read_text())
        new = {r["name"] for r in rows}
        old = [{**r, "commit": r.get("commit", before["commit"])} for r in before["rows"]
               if r["name"] not in new and r["name"] != "fp32"]  # fmt: skip
        notes = {k: before[k] for k in ("commit_note",) if k in before}
        order = {name: i for i, name in enumerate(ROWS)}
        rows = sorted(old + rows, key=lambda r: order.get(r["name"], len(order)))  # stable: the rest in turn
    rows = [fp_row, *rows]
    table = markdown(rows)
    weights = sorted(base.glob("*.safetensors"))
    result = {
        "model": args.name,
        "model_files_sha256": {w.name: artifact.sha256_of(w) for w in weights},
        "scored_through": "ternop eval: vLLM, float32 activations, the op's CPU reference for ternary layers",
        "calibration_text": CALIB_RECIPE,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},  # fmt: skip
        "commit": commit,  # of this run; each row has the commit that scored it ("commit" here where absent)
        "rows": rows,
        "table_markdown": table,
        **notes,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
