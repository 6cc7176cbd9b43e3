"""``ternop distill --keep-dense auto`` against an all-ternary distillation of the same recipe, on all-MiniLM-L6-v2.

Two distillations with one recipe (by default the CPU distillation of docs/QUALITY.md: 400 steps,
batch 8, 192 tokens, lr 1.5e-4, scales 2e-5, calibrated start; ``--extra`` adds options to both):

  all ternary       ternop distill BASE DST RECIPE
  keep-dense auto   ternop distill BASE DST RECIPE --keep-dense auto --rank-from RANK --size-budget S

RANK, the ternary checkpoint the layers are ranked around, is the first run's output (what a user
has: an earlier all-ternary run of the same base), or with ``--rank-from artifact`` the model of
``--artifact`` (default: the demo's, assembled here from the fp32 model). fp32 and both checkpoints
are scored as the rows of ``quality_minilm.py`` are, the held-out split included: the ranking
measures the visible wiki set only, and no evaluation text is in the training text.

    python benchmarks/quality_keep_dense.py --work DIR                  # both distillations
    python benchmarks/quality_keep_dense.py --work DIR --reuse "all ternary=DIR@SECONDS"   # score one made before

Writes benchmarks/results/cpu/keep_dense_distill.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality_a8 import ternop  # noqa: E402
from quality_minilm import checkpoint_bytes, dense_layers, markdown, minilm_dir, row_spec, score  # noqa: E402
from stamp import git_commit  # noqa: E402

ARTIFACT = HERE.parent / "artifacts" / "all-MiniLM-L6-v2-ternary" / "model.safetensors"
NAMES = ("all ternary", "keep-dense auto")


def command(name: str, args) -> list[str]:
    """The ``ternop`` command that makes checkpoint ``name``, with BASE, DST and RANK as placeholders."""
    recipe = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--lr", str(args.lr), "--lr-scale", str(args.lr_scale), *shlex.split(args.extra), "--quiet",
              "--force"]  # fmt: skip
    extra = ["--keep-dense", "auto", "--rank-from", "RANK", "--size-budget", str(args.size_budget)]
    return ["distill", "BASE", "DST", *recipe, *(extra if name == "keep-dense auto" else [])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="folder for the checkpoints and the log")
    p.add_argument("--rank-from", choices=["all-ternary", "artifact"], default="all-ternary",
                   help="rank the layers around the all-ternary run's output, or around --artifact")
    p.add_argument("--artifact", type=Path, default=ARTIFACT, help="with --rank-from artifact: a ternop.quant.artifact")
    p.add_argument("--extra", default="", help="more ternop distill options for both runs, e.g. \"--rel-weight 1\"")
    p.add_argument("--reuse", nargs="+", default=[], metavar="NAME=DIR@SECONDS",
                   help="score a checkpoint made beforehand with this script's command for NAME and the same options")
    p.add_argument("--size-budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--lr-scale", type=float, default=2e-5)
    p.add_argument("--out", type=Path, default=HERE / "results" / "cpu" / "keep_dense_distill.json")
    args = p.parse_args()
    reuse = {name: (path, seconds) for name, path, seconds in map(row_spec, args.reuse)}
    unknown = sorted(set(reuse) - set(NAMES))
    if unknown:
        p.error(f"--reuse names {unknown}; the checkpoints are {list(NAMES)}")

    from ternop.cli import evaldata
    from ternop.quant import artifact

    base = minilm_dir()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.rank_from == "artifact":
        rank = str(work / "rank-from")
        artifact.assemble(args.artifact, base, rank, overwrite=True)
        rank_from = {"artifact": args.artifact.name, "sha256": artifact.sha256_of(args.artifact)}
    else:
        rank, rank_from = None, "the all-ternary run's output"
    log = work / "quality_keep_dense.log"
    suite = evaldata.suite()
    commit = git_commit()
    fp, ref = score(base, suite, None)
    rows = [{"name": "fp32", **fp, **checkpoint_bytes(base), "command": None, "seconds": None}]
    for name in NAMES:
        argv = command(name, args)
        if name in reuse:
            dst, seconds = reuse[name]
        else:
            dst = str(work / name.replace(" ", "-"))
            seconds = ternop([{"BASE": base, "DST": dst, "RANK": rank}.get(a, a) for a in argv], log)
        if name == "all ternary" and rank is None:
            rank = dst
        row, _ = score(dst, suite, ref)
        rows.append({"name": name, **row, **checkpoint_bytes(dst), "command": ["ternop", *argv],
                     "reused": name in reuse, "seconds": seconds, "dense_layers": dense_layers(dst)})  # fmt: skip
        print(markdown(rows, rows[0]["encoder_linear_bytes_fp16_dense"]), flush=True)
    table = markdown(rows, rows[0]["encoder_linear_bytes_fp16_dense"])
    result = {
        "what": "ternop distill --keep-dense auto against all ternary, one recipe, all-MiniLM-L6-v2",
        "commit": commit,
        "rank_from": rank_from,
        "size_budget": args.size_budget,
        "recipe": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                   "lr_scale": args.lr_scale, "extra": args.extra},  # fmt: skip
        "scored_through": "transformers, dequantized ternary weights; the visible and held-out splits of "
                          "ternop.cli.evaldata",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},  # fmt: skip
        "rows": rows,
        "table_markdown": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
