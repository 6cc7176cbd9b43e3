"""``ternop::rms_norm_quant`` against what a compiled model runs without it, at decode sizes.

    python benchmarks/bench_norm_quant.py --out benchmarks/results/h200/bench_norm_quant.json [--ms 1 16 64 512]

For BitNet-b1.58-2B-shaped rows (a pre-norm with its residual add, D = 2560:
``ternop::add_rms_norm_quant``; the attention sub-norm, D = 2560; the MLP's squared ReLU,
product and sub-norm, D = 6912 from a [M, 13824] gate/up output), times per call, in CUDA
graphs (``triton.testing.do_bench_cudagraph``):
- ``ternop``: the op, one kernel;
- ``inductor``: ``torch.compile`` of the same torch ops (``ternop.norm_quant.reference``,
  ``add_reference``), which is what the plugin's BitNet model ran before the ops, Inductor
  fusing norm and quantization;
- ``inductor_norm_only``: the compiled norm (and add) without the quantization, its output in
  bf16: what a bf16 model pays for the same norm.
Each result is checked first: the op's int8 codes within one step of the torch ops run eagerly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import ternop.norm_quant as nq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402

SHAPES = [("pre_norm_add", 2560, "residual"), ("attn_sub_norm", 2560, "none"),
          ("ffn_relu2_sub_norm", 6912, "relu2_glu")]  # fmt: skip


def _norm_only(x, w, eps, act, r=None):
    return nq.normed(x + r, w, eps) if act == "residual" else nq.normed(x, w, eps, act)


def main() -> int:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/h200/bench_norm_quant.json")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 512, 16384])
    args = parser.parse_args()
    torch.manual_seed(0)
    eps = 1e-5
    compiled = torch.compile(nq.reference, dynamic=True)
    compiled_add = torch.compile(nq.add_reference, dynamic=True)
    compiled_norm = torch.compile(_norm_only, dynamic=True)
    rows = []
    for name, d, act in SHAPES:
        w = (torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16)
        for m in args.ms:
            x = (torch.randn(m, 2 * d if act == "relu2_glu" else d, device="cuda") * 3).to(torch.bfloat16)
            r = torch.randn_like(x)
            if act == "residual":
                op = lambda: torch.ops.ternop.add_rms_norm_quant(x, r, w, eps)  # noqa: E731
                ref = lambda: compiled_add(x, r, w, eps)  # noqa: E731
                spec = nq.add_reference(x, r, w, eps)
            else:
                op = lambda: torch.ops.ternop.rms_norm_quant(x, w, eps, act)  # noqa: E731
                ref = lambda: compiled(x, w, eps, act)  # noqa: E731
                spec = nq.reference(x, w, eps, act)
            # Against the spec's torch ops run eagerly: within one code (the sum's order). Inductor's
            # fused code skips some of their roundings (x + residual in bf16), so it may differ more.
            q = op()[0].int()
            worst = int((q - spec[0].int()).abs().max())
            if worst > 1:
                raise SystemExit(f"{name} M={m}: the op's codes differ from the spec's torch ops by {worst}")
            row = {"shape": name, "D": d, "act": act, "M": m, "max_code_diff_vs_torch_ops": worst,
                   "max_code_diff_vs_inductor": int((q - ref()[0].int()).abs().max())}  # fmt: skip
            for impl, fn in (("ternop", op), ("inductor", ref),
                             ("inductor_norm_only", lambda: compiled_norm(x, w, eps, act, r))):  # fmt: skip
                row[f"{impl}_us"] = round(triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3, 3)
            row["inductor_over_ternop"] = round(row["inductor_us"] / row["ternop_us"], 3)
            rows.append(row)
            print(f"{name:20s} M={m:6d}  ternop {row['ternop_us']:8.2f} us  inductor {row['inductor_us']:8.2f} us"
                  f"  norm only {row['inductor_norm_only_us']:8.2f} us  ({row['inductor_over_ternop']:.2f}x)")
    out = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "method": "triton.testing.do_bench_cudagraph(rep=100), one call per replay, bf16 rows",
           "results": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
