"""Benchmark ternop.linear on CUDA against cuBLAS bf16 and "dequantize, then F.linear".

    python benchmarks/bench_linear.py [--out benchmarks/results/h200/bench_linear.json]

(Tile candidates for the static config tables are timed by benchmarks/sweep_fused.py.)

Method (as a server runs: no per-call syncs):
- Weights are rotated: each timed graph calls the layer on R distinct weight copies, with R
  chosen so that the copies together exceed twice the 50 MB L2; every call reads its
  weights from HBM, for bf16 and ternary alike.
- Each implementation is captured once into a CUDA graph of R calls, R the same for every
  implementation of one (shape, M) (the largest copy count among them; fewer copies are
  cycled); CUDA events time whole replays, and the replays of all implementations take turns
  (one of each, seven rounds after two warm-up rounds), so that all of them see the same GPU
  clock: under sustained large-M GEMMs the H200 lowers its SM clock by up to a fifth, and
  timed one after another, with graphs of different lengths, the same call moved by up to
  10% (``probe_sustained.py``). The time per call is the median over rounds divided by R.
- Each timed replay follows an untimed replay of the same graph, so it starts from that
  implementation's own steady state (its clock, its L2), not from the one the implementation
  before it in the round left. (With only a read of twice the L2 between them, at 7f9e7eb,
  the dispatcher's row, which followed the slow ``dequant_bf16``, measured 1-14% slower at
  M <= 16 than the same kernel forced later in the round.)
- ``dequant_bf16`` takes no turns: it is timed on its own after the rounds. With the untimed
  replay alone (38af09e) the dispatcher's row, right after it, still read 2-6% slower at
  M = 8192 than the same backend forced later in the round; taken out (31e3824), the
  dispatcher's row, now right after ``cublas_bf16``, read 1-12% slower than the backend it runs,
  and still did when the order only rotated each round (d26b62c: a rotation keeps every
  neighbour). ``probe_dispatch.py`` timed the op, that backend and its C++ op within 1% of each
  other at M = 2048 and 8192. So each round now takes the implementations in its own shuffled
  order (seeded by the round), and the median is over rounds with different neighbours.
- Reported per (shape, M, implementation): microseconds per call, speed-up over cuBLAS
  bf16 at the same (shape, M), GB/s (the bytes the implementation must move: weights,
  x and out) and TFLOP/s (2*M*N*K).

Implementations: the dispatcher (what ``ternop.linear`` picks from M) as a served model
calls it: ``ternop`` (16-bit activations, weights repacked to the a16 layout), ``ternop_v1``
(the same on format-v1 weights as stored) and ``ternop_a8`` (int8 activations, a8 layout,
per-token quantization included), ``ternop_a8_row`` (the same with one scale per weight row,
``weight_scale`` [N, 1]), and ``ternop_q8_row`` (that product from rows quantized beforehand,
``ternop.linear_q8``: what is left when a compiled model fuses the quantization away); every
backend that can run the call, forced (``backend:<name>[<layout>]``; with ``--below-floors``
also where the dispatch's speed rules, such as a backend's smallest M, keep it out, as
``TERNOP_BACKEND`` forces it); ``cublas_bf16`` (F.linear on bf16 weights) and
``dequant_bf16`` (dequantize to bf16 with torch ops, then F.linear, every call); and, when
vLLM is importable, ``marlin_w4a16``: vLLM's Marlin kernel on GPTQ int4 weights (group 128,
no act-order), what a user would otherwise pick to shrink weights. The report is stamped
with the git commit of the code it ran.

Every time here is GPU time under CUDA graphs. Above M = 512 the dispatcher gives row-scaled
int8 calls up to M * N * K = 2^33 to ``cuda_wgmma_a8``, and 16-bit calls up to 2^33 to
``cuda_wgmma``, for their host time, which vLLM pays there (``ternop.cuda.configs``,
``EAGER_A8_ROW_MAX_MNK`` and ``EAGER_A16_MAX_MNK``), so ``ternop``, ``ternop_a8_row`` and
``ternop_q8_row`` show those kernels at those points; ``TERNOP_GRAPH_MAX_M=1000000000`` makes the
dispatcher choose by GPU time alone, as it did before those rules. The JSON records the value it
ran with.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ternop
from ternop import backends, layouts
from ternop.activations import quantize_rows
from ternop.cuda import configs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402

SHAPES = {
    "0.6B": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)],
    "8B": [(4096, 4096), (4096, 14336), (4096, 28672), (14336, 4096)],
}
MS = [1, 4, 16, 32, 64, 128, 256, 512, 2048, 8192]
L2_BYTES = 50 * 2**20
DTYPE = torch.bfloat16


def copies_for(bytes_per_copy: int, cap: int = 256) -> int:
    return max(2, min(cap, math.ceil(2 * L2_BYTES / bytes_per_copy)))


SEPARATE = ("dequant_bf16",)
"""Implementations timed after the rounds instead of taking turns in them (baselines, not contenders)."""


def capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn(i)`` for i in range(calls), after eager calls that compile kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 2)):
            fn(i)  # compiles kernels and builds the extension outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return graph


def time_interleaved(graphs: dict, calls: int, replays: int = 7, warmup: int = 2) -> dict:
    """name -> median microseconds per call over :func:`time_rounds`."""
    return {name: statistics.median(t) for name, t in time_rounds(graphs, calls, replays, warmup).items()}


def time_rounds(graphs: dict, calls: int, replays: int = 7, warmup: int = 2) -> dict:
    """name -> microseconds per call in each of ``replays`` rounds after ``warmup`` untimed ones; per
    round, each graph in turn is replayed twice and the second replay timed. Each round takes the
    graphs in its own order (a shuffle seeded by the round's number), so that no implementation
    always follows the same one."""
    times = {name: [] for name in graphs}
    for r in range(warmup + replays):
        order = list(graphs)
        random.Random(r).shuffle(order)
        for name in order:
            graph = graphs[name]
            graph.replay()  # untimed: this graph's own steady state for the timed replay
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if r >= warmup:
                times[name].append(start.elapsed_time(end) * 1000.0 / calls)
    return times


def time_graph(fn, calls: int, replays: int = 7, warmup: int = 2) -> float:
    """Median microseconds per call of ``fn(i)`` for i in range(calls), timed as CUDA graph replays."""
    graph = capture(fn, calls)
    return time_interleaved({"fn": graph}, calls, replays, warmup)["fn"]


def make_weights(k: int, n: int, copies: int):
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 3, (n, k // 4, 4), device="cuda", dtype=torch.uint8, generator=g)
        packed = codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6
        scale = (torch.rand((n, k // 128), device="cuda", generator=g) * 0.02 + 0.001).to(torch.float16)
        out.append((packed.contiguous(), scale))
    return out


def dequant(packed, scale, shifts):
    """Capture-safe dequantize to bf16 (ternop.format.dequantize builds a small CPU tensor per call)."""
    c = ((packed.unsqueeze(-1) >> shifts) & 3).reshape(packed.shape[0], -1).to(torch.int8)
    v = ((c & 1) - (c >> 1)).to(DTYPE)
    return (v.view(packed.shape[0], -1, 128) * scale.to(DTYPE).unsqueeze(-1)).view(packed.shape[0], -1)


def make_marlin(k: int, n: int, copies: int):
    """Marlin W4A16 weights (``copies`` rotated copies of one quantized weight) and its call, or
    None (with the reason printed) where vLLM or its Marlin kernel is missing."""
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.scalar_type import scalar_types

        wtype = scalar_types.uint4b8
        w = torch.randn(k, n, device="cuda", dtype=DTYPE) * 0.02
        _, q, s, _, _, _ = marlin_quantize(w, wtype, 128, False)
        empty = mu.marlin_make_empty_g_idx(w.device)
        workspace = mu.marlin_make_workspace_new(w.device)
    except Exception as exc:  # vLLM absent, or built without Marlin
        print(f"  marlin_w4a16 left out: {type(exc).__name__}: {exc}"[:200], flush=True)
        return None
    weights = [(q.clone(), s.clone()) for _ in range(copies)]
    del w

    def call(x, i):
        q_i, s_i = weights[i % copies]
        return mu.apply_gptq_marlin_linear(
            input=x, weight=q_i, weight_scale=s_i, weight_zp=empty, g_idx=empty, g_idx_sort_indices=empty,
            workspace=workspace, wtype=wtype, output_size_per_partition=n, input_size_per_partition=k,
            is_k_full=True,
        )  # fmt: skip

    return call, copies


def _can_implement(b, call, below_floors: bool) -> bool:
    """Whether backend ``b`` takes ``call``; with ``below_floors`` as if it were forced
    (``TERNOP_BACKEND``), which lifts the speed rules (M floors, tile-count rules) but not what
    the kernel cannot run."""
    if not below_floors:
        return b.can_implement(call)[0]
    with backends.forcing(b.name):
        return b.can_implement(call)[0]


# The rows besides the forced backends': cublas_bf16 (always timed) and these.
ROWS = ("dequant_bf16", "ternop", "ternop_v1", "ternop_a8", "ternop_a8_row", "ternop_q8_row")


def impls(x, tern, dense, marlin=None, below_floors=False, only=None, rows=None):
    """name -> (fn(i), n_copies) for one (shape, M). ``tern`` maps layout -> weight copies;
    ``only``, a set of backend names, keeps just those backends' forced rows; ``rows``, a set of
    ROWS names, keeps just those of the others (and cublas_bf16)."""
    q, q_scale = quantize_rows(x)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device="cuda")
    v1, a16, a8, a8r = tern["v1"], tern["a16"], tern["a8"], tern["a8 row"]
    res = {
        "cublas_bf16": (lambda i: F.linear(x, dense[i % len(dense)]), len(dense)),
        "dequant_bf16": (lambda i: F.linear(x, dequant(*v1[i % len(v1)], shifts)), len(dense)),
        "ternop": (lambda i: ternop.linear(x, *a16[i % len(a16)], layout="a16"), len(a16)),
        "ternop_v1": (lambda i: ternop.linear(x, *v1[i % len(v1)]), len(v1)),
        "ternop_a8": (lambda i: ternop.linear(x, *a8[i % len(a8)], activation_bits=8, layout="a8"), len(a8)),
        "ternop_a8_row": (lambda i: ternop.linear(x, *a8r[i % len(a8r)], activation_bits=8, layout="a8"), len(a8r)),
        # The same from rows quantized beforehand (ternop::linear_q8), as a compiled model runs it
        # when the quantization fuses into the op before the layer: the product alone.
        "ternop_q8_row": (lambda i: ternop.linear_q8(q, q_scale, *a8r[i % len(a8r)], out_dtype=x.dtype, layout="a8"),
                          len(a8r)),
    }
    if rows is not None:
        res = {name: impl for name, impl in res.items() if name == "cublas_bf16" or name in rows}
    if marlin is not None:
        marlin_call, copies = marlin
        res["marlin_w4a16"] = (lambda i: marlin_call(x, i), copies)
    for b in backends.available("cuda"):
        if only is not None and b.name not in only:
            continue
        for bits, weights in ((16, "a16"), (16, "v1"), (8, "a8"), (8, "a8 row")):
            w, layout = tern[weights], weights.split()[0]
            call = backends.LinearCall(x, *w[0], None, bits, layout)
            ok = _can_implement(b, call, below_floors)
            if ok and not (layout == "v1" and any(k.startswith(f"backend:{b.name}[") for k in res)):
                res[f"backend:{b.name}[{weights}]"] = (
                    (lambda b, w, bits, layout: lambda i: b.run(
                        backends.LinearCall(x, *w[i % len(w)], None, bits, layout)))(b, w, bits, layout),
                    len(w),
                )
    return res


def bytes_moved(name: str, m: int, k: int, n: int) -> int:
    act = 2 * m * k + 2 * m * n
    if name == "cublas_bf16":
        return 2 * n * k + act
    if name == "marlin_w4a16":
        return n * k // 2 + 2 * n * (k // 128) + act
    return n * k // 4 + 2 * n * (k // 128) + act


def families(chosen=None) -> dict[str, list[tuple[int, int]]]:
    """SHAPES by family, or with ``chosen`` (K, N) shapes only those, the ones of no family as
    family "other"."""
    if chosen is None:
        return {**SHAPES, "other": []}
    known = {shape for family in SHAPES.values() for shape in family}
    return {**{family: [shape for shape in shapes if shape in chosen] for family, shapes in SHAPES.items()},
            "other": [shape for shape in chosen if shape not in known]}


def run_bench(args, save=None) -> dict:
    """Times every implementation; ``save(report)`` is called after each shape (a cut-off run keeps what it measured)."""
    ternop.linear(torch.zeros(1, 128, device="cuda", dtype=DTYPE), *make_weights(128, 128, 1)[0])  # load backends
    unknown = sorted((args.backends or set()) - {b.name for b in backends.available("cuda")})
    if unknown:
        known = ", ".join(b.name for b in backends.available("cuda"))
        raise SystemExit(f"--backends: no CUDA backend {', '.join(unknown)}; these are registered: {known}")
    results = []
    for family, shapes in families(args.shapes or None).items():
        for k, n in shapes:
            tern_bytes = n * k // 4 + 2 * n * (k // 128)
            base = make_weights(k, n, copies_for(tern_bytes))
            tern = {lay: [(layouts.repack(p, lay), s) for p, s in base] for lay in ("a16", "a8")}
            tern["v1"] = base
            tern["a8 row"] = [(p, s[:, :1].contiguous()) for p, s in tern["a8"]]  # a scale per row
            dense = [ternop.dequantize(p, s, DTYPE) for p, s in base[: copies_for(2 * n * k)]]
            marlin = make_marlin(k, n, copies_for(n * k // 2)) if args.marlin else None
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                cell = impls(x, tern, dense, marlin, args.below_floors, args.backends, args.rows)
                calls = max(c for _, c in cell.values())
                graphs = {}
                for name, (fn, _) in cell.items():
                    try:
                        graphs[name] = capture(fn, calls)
                    except Exception as exc:  # report a broken backend, keep measuring the rest
                        print(f"  {name} failed at K={k} N={n} M={m}: {type(exc).__name__}: {exc}"[:400], flush=True)
                # The naive baseline is timed apart, after the rounds: it runs the GPU hardest of all
                # (up to 3x cuBLAS's time per call), and whichever implementation followed it in a
                # round read a few percent slow even after its own untimed replay.
                naive = {name: graphs.pop(name) for name in SEPARATE if name in graphs}
                row = time_interleaved(graphs, calls)
                row.update(time_interleaved(naive, calls) if naive else {})
                del graphs, naive
                base = row["cublas_bf16"]
                for name, us in row.items():
                    results.append({
                        "family": family, "K": k, "N": n, "M": m, "impl": name, "us": round(us, 3),
                        "speedup_vs_bf16": round(base / us, 3),
                        "GBps": round(bytes_moved(name, m, k, n) / us / 1e3, 1),
                        "TFLOPs": round(2 * m * n * k / us / 1e6, 2),
                    })
                best = min([(v, kname) for kname, v in row.items()
                            if kname.startswith("backend:") and "[a8" not in kname] or [(math.inf, "-")])
                tern_us, a8_us = row.get("ternop", math.inf), row.get("ternop_a8", math.inf)
                a8r_us = row.get("ternop_a8_row", math.inf)
                q8r_us = row.get("ternop_q8_row", math.inf)
                marlin_us = row.get("marlin_w4a16", math.inf)
                print(f"{family:5s} {k:6d}->{n:6d} M={m:5d}  bf16 {base:9.2f} us  ternop {tern_us:9.2f} us "
                      f"x{base / tern_us:5.2f}  a8 x{base / a8_us:5.2f}  a8 row x{base / a8r_us:5.2f}  (q8 x{base / q8r_us:5.2f})  marlin x{base / marlin_us:5.2f}  "
                      f"best a16 {best[1][8:]} x{base / best[0]:5.2f}",
                      flush=True)
            del tern, dense, base, marlin
            torch.cuda.empty_cache()
            if save is not None:
                save(_report(results, complete=False, below_floors=args.below_floors))
    return _report(results, complete=True, below_floors=args.below_floors)


def _report(results: list, complete: bool, below_floors: bool = False) -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "commit": git_commit(),
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA-graph replays of R calls over rotated weight copies (> 2x the 50 MB L2), R the same "
                  "for every implementation of a (shape, M); CUDA events; the implementations' replays take "
                  "turns in an order shuffled anew each round, each timed replay after an untimed one of "
                  "the same graph, median of 7 rounds after 2 "
                  "warm-up rounds (dequant_bf16 timed the same way on its own after the rounds); x and out in "
                  "bf16; ternop_a8 and "
                  "ternop_a8_row include the per-token quantization of x",
        "complete": complete,
        "backends_below_floors": below_floors,
        "graph_max_m": configs.graph_max_m(),  # above it the dispatcher weighs host time (see above)
        "results": results,
    }


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _shape_list(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are KxN[,KxN...], not {text!r}") from None
    if any(len(s) != 2 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes are KxN[,KxN...], not {text!r}")
    bad = [f"{k}x{n}" for k, n in shapes if k % 128 or k < 128 or n < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"K must be a positive multiple of 128 and N positive: {', '.join(bad)}")
    return shapes


def _backend_set(text: str) -> set[str]:
    names = {name for name in text.split(",") if name}
    if not names:
        raise argparse.ArgumentTypeError(f"backends are NAME[,NAME...], not {text!r}")
    return names


def _row_set(text: str) -> set[str]:
    names = {name for name in text.split(",") if name}
    unknown = sorted(names - set(ROWS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"rows are some of {', '.join(ROWS)}, not {text!r}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/bench_linear.json"))
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--shapes", type=_shape_list, default=None,
                        help="only these K->N shapes, e.g. 4096x14336,1024x4096 (default: the eight of the "
                             "0.6B and 8B families; others run as family 'other')")
    parser.add_argument("--below-floors", action="store_true",
                        help="time every backend that can run the call, also where the dispatch's speed rules "
                             "(M floors, tile-count rules) keep it out, as TERNOP_BACKEND would force it")
    parser.add_argument("--backends", type=_backend_set, default=None,
                        help="time only these backends' forced rows, e.g. cuda_wgmma,cuda_dequant (the "
                             "dispatcher's and the reference rows are always timed)")
    parser.add_argument("--rows", type=_row_set, default=None,
                        help=f"time only these of the other rows, e.g. ternop_a8_row (cublas_bf16 is always timed; "
                             f"default all: {', '.join(ROWS)})")
    parser.add_argument("--no-marlin", dest="marlin", action="store_false",
                        help="leave out vLLM's Marlin W4A16 row (it is left out by itself when vLLM is absent)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save(report):
            args.out.write_text(json.dumps(report, indent=1) + "\n")

        save(run_bench(args, save))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
