"""Times one decode step's ternary linears, every layer with its own weights, in one CUDA graph.

    python benchmarks/bench_decode_linears.py [--family 8B|qwen3_8b|bitnet] [--ms 1 4 8] [--force N=SETS ...]
        [--x-in]

``sweep_tiles.py`` times one layer's kernel over and over; a decoder step instead runs each of
its layers' four linears once, one after the other, and reads every weight once (1.7 GB for the
8B shapes). This benchmark captures exactly that sequence of the int8 small-M kernel
(``ternop::linear_cuda_mma_a8`` given quantized rows, as vLLM's compiled graph calls it) and
times it with the kernel's own split (``rule``) and with the sets of 16 rows a CTA forced per
output width (``--force 28672=8``: every layer with N = 28672 takes eight sets; ``forced``).
``--x-in`` adds the step as vLLM runs it with ``TERNOP_FUSE_QUANT=0``, given x in bf16: ``op``,
``ternop::linear`` with ``activation_bits=8`` (the dispatcher's choice: at M <= 2 the kernel that
quantizes x itself, ``cuda_mma_a8_fused``, where the registry lets it; else ternop's quantization
launch and then the kernel), and at M <= 2 ``fused``, that kernel on every layer. The
variants take turns as in bench_linear (``time_rounds``: a new order each round, an untimed
replay before each timed one); the report gives each one's median, min and max over the rounds,
in microseconds per step, stamped with the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import ternop
from ternop import layouts
from ternop.activations import quantize_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import capture, make_weights, time_rounds  # noqa: E402
from stamp import git_commit  # noqa: E402

# (K, N) of one layer's four linears (qkv, o, gate_up, down) and the number of layers.
FAMILIES = {
    "8B": ([(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)], 32),  # Llama-3-8B, bench_linear's 8B
    "qwen3_8b": ([(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)], 36),  # bench_vllm's decode model
    "bitnet": ([(2560, 3840), (2560, 2560), (2560, 13824), (6912, 2560)], 30),
}


def _weights(k: int, n: int):
    """One layer's weights in the a8 layout with a scale per row, as the vLLM plugin hands them on."""
    packed, scale = make_weights(k, n, 1)[0]
    return layouts.repack(packed, "a8"), scale[:, :1].contiguous()


def run(family: str, ms: list[int], force: dict[int, int], rounds: int, x_in: bool = False) -> dict:
    shapes, layers = FAMILIES[family]
    weights = [[_weights(k, n) for k, n in shapes] for _ in range(layers)]
    op = torch.ops.ternop.linear_cuda_mma_a8
    fused = torch.ops.ternop.linear_cuda_mma_a8_fused
    results = []
    for m in ms:
        xf = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes}
        xs = {k: quantize_rows(x) for k, x in xf.items()}

        def step(forced: bool):
            for layer in weights:
                for (k, n), (p, s) in zip(shapes, layer):
                    q, qs = xs[k]
                    op(q, qs, p, s, None, torch.bfloat16, force.get(n, -1) if forced else -1, -1)

        def step_op():
            for layer in weights:
                for (k, _), (p, s) in zip(shapes, layer):
                    torch.ops.ternop.linear(xf[k], p, s, None, 8, "a8")

        def step_fused():
            for layer in weights:
                for (k, _), (p, s) in zip(shapes, layer):
                    fused(xf[k], p, s, None, -1, -1)

        variants = {"rule": lambda i: step(False)}
        if force:
            variants["forced"] = lambda i: step(True)
        if x_in:
            variants["op"] = lambda i: step_op()
            if m <= 2:
                variants["fused"] = lambda i: step_fused()
        graphs = {name: capture(fn, 1) for name, fn in variants.items()}
        times = time_rounds(graphs, 1, replays=rounds)
        row = {"M": m}
        for name, ts in times.items():
            row[name] = {"median_us": round(statistics.median(ts), 2), "min_us": round(min(ts), 2),
                         "max_us": round(max(ts), 2)}
            if name != "rule":
                row[name + "_over_rule"] = round(row[name]["median_us"] / row["rule"]["median_us"], 4)
        print(f"{family} M={m}: " + ", ".join(
            f"{name} {row[name]['median_us']:.1f} us/step ({row[name]['min_us']:.1f}-{row[name]['max_us']:.1f})"
            for name in times) + (f"; forced {force}" if force else ""), flush=True)  # fmt: skip
        results.append(row)
        del graphs
    return {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "family": family, "layers": layers, "shapes": shapes, "force": force, "x_in": x_in, "rounds": rounds,
            "results": results}


def _force(text: str) -> tuple[int, int]:
    n, sets = text.split("=")
    return int(n), int(sets)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="8B")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--force", type=_force, nargs="+", default=[], metavar="N=SETS")
    parser.add_argument("--x-in", action="store_true",
                        help="also time the step from bf16 x: the dispatcher (op) and, at M <= 2, the fused kernel")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_linears needs a CUDA device", file=sys.stderr)
        return 2
    ternop.linear(torch.zeros(1, 128, device="cuda", dtype=torch.bfloat16),
                  torch.zeros(128, 32, dtype=torch.uint8, device="cuda"),
                  torch.ones(128, 1, dtype=torch.float16, device="cuda"))  # builds the extension
    with torch.inference_mode():
        report = run(args.family, args.ms, dict(args.force), args.rounds, args.x_in)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
