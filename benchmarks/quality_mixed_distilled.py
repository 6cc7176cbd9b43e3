"""Mixed precision around a distilled model: keep its most useful layers dense, within a size budget.

    python benchmarks/quality_mixed_distilled.py [--artifact FILE] [--size-budget 0.25]
        [--work DIR] [--out benchmarks/results/cpu/mixed_distilled.json] [--force]

``ternop quantize --keep-dense auto`` ranks layers of a model it rounds itself. This asks the same
question of the demo's distilled model (``--artifact``, a ``ternop.quant.artifact`` file): the fp32
all-MiniLM-L6-v2 with the artifact's trained norms and biases is the "dense" model, the artifact's
ternary codes are each layer's ternary form, and ``ternop.cli.mixed.choose`` keeps layers dense by
gain per byte within ``--size-budget`` of the fp16 bytes (``--max-mrr-loss 0``: as many as fit and
gain). The chosen checkpoint is written (dense layers from fp32, the rest the artifact's codes) and
scored like every row of ``quality_minilm.py``, held-out split included, which the choice never saw.
It writes three checkpoint folders under ``--work`` and the ``--out`` JSON, and replaces none of
them that already exist unless given ``--force``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality_minilm import checkpoint_bytes, minilm_dir, score  # noqa: E402
from stamp import git_commit  # noqa: E402

ARTIFACT = HERE.parent / "artifacts" / "all-MiniLM-L6-v2-ternary" / "model.safetensors"
CODES = (".weight_packed", ".weight_scale")


def dense_with_trained_norms(base: Path, tensors: dict, dst: Path) -> int:
    """``base`` copied to ``dst`` with every non-code tensor of the artifact (trained norms and
    biases) in place of the original; returns how many were replaced."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(base, dst)
    state = load_file(str(base / "model.safetensors"))
    replaced = 0
    for key, value in tensors.items():
        if key.endswith(CODES):
            continue
        match = [k for k in state if k == key or k.endswith("." + key)]
        if len(match) != 1:
            raise KeyError(f"artifact tensor {key!r} matches {len(match)} tensors of the base model")
        state[match[0]] = value.to(state[match[0]].dtype)
        replaced += 1
    save_file(state, str(dst / "model.safetensors"))
    return replaced


def _shown(path: Path) -> str:
    """The path relative to the repository when inside it, else the file's name alone."""
    path = path.resolve()
    root = HERE.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, default=ARTIFACT)
    p.add_argument("--size-budget", type=float, default=0.25)
    p.add_argument("--work", type=Path, default=Path("work/mixed_distilled"))
    p.add_argument("--out", type=Path, default=HERE / "results" / "cpu" / "mixed_distilled.json")
    p.add_argument("--force", action="store_true", help="replace the --work folders and --out if they exist")
    args = p.parse_args(argv)
    src, dst, all_ternary = (args.work / name for name in ("dense_trained_norms", f"mixed_{args.size_budget}",
                                                           "all_ternary"))  # fmt: skip
    existing = [str(q) for q in (src, dst, all_ternary, args.out) if q.exists()]
    if existing and not args.force:
        p.error(f"{', '.join(existing)} already exist(s); pass --force to replace")

    from ternop.cli import evaldata, mixed
    from ternop.quant import artifact
    from ternop.quant.convert import quantize_checkpoint

    tensors, qc = artifact.load(args.artifact)
    base = Path(minilm_dir())
    replaced = dense_with_trained_norms(base, tensors, src)
    codes = {k[: -len(CODES[0])]: (tensors[k], tensors[k[: -len(CODES[0])] + CODES[1]])
             for k in tensors if k.endswith(CODES[0])}  # fmt: skip

    def quantizer(prefix: str, weight):
        hits = [c for c in codes if prefix == c or prefix.endswith("." + c)]
        if len(hits) != 1:
            raise KeyError(f"layer {prefix!r} matches {len(hits)} ternary layers of the artifact")
        return codes[hits[0]]

    t0 = time.time()
    choice, prefixes = mixed.choose(str(src), quantizer, (), 0.0, progress=True, size_budget=args.size_budget)
    quantize_checkpoint(str(src), str(dst), skip=list(prefixes), progress=False, quantizer=quantizer,
                        overwrite=True, activation_bits=qc.get("activation_bits", 16))  # fmt: skip
    seconds = time.time() - t0
    suite = evaldata.suite()
    fp32, ref = score(str(base), suite, None)
    rows = {"fp32": fp32}
    artifact.assemble(args.artifact, base, all_ternary, overwrite=True)
    for name, path in (("all ternary (the artifact)", all_ternary), ("dense, trained norms", src), ("mixed", dst)):
        row, _ = score(str(path), suite, ref)
        rows[name] = {**row, **checkpoint_bytes(str(path))}
    report = {
        "commit": git_commit(),
        "artifact": _shown(args.artifact),
        "artifact_sha256": artifact.sha256_of(args.artifact),
        "size_budget": args.size_budget,
        "replaced_tensors": replaced,
        "dense_layers": list(prefixes),
        "choice": {"met": choice.met, "base": choice.base, "all_ternary": choice.all_ternary, "final": choice.final,
                   "ranking": choice.ranking, "trials": choice.trials},
        "seconds_to_choose_and_write": round(seconds, 1),
        "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:28s} wiki MRR {row['wiki_mrr']:.4f}  held-out passages {row['heldout_passage_mrr']:.4f}  "
              f"short {row['heldout_short_mrr']:.4f}  cos {row['cos_mean']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
