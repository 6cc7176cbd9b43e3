"""Where a decode step's device time goes, by kind of kernel, from the profiles in bench_vllm.py's JSON.

    python benchmarks/profile_breakdown.py benchmarks/results/h200/bench_vllm_decode_a8row_e371303.json [...]

``bench_vllm.py --profile`` records, per engine and batch (``profile_decode_batch1``, ``..16``), the
25 events with the most device self time over a run of ``steps`` decode steps. This sorts the
kernels among them into the kinds the docs' tables use and prints microseconds per step:

- a row with host time of its own (``aten::mm``, ``cudaGraphLaunch``) is left out: its device time
  is that of kernels listed beside it;
- a kernel that ran fewer times than once a step, and not at least four times a step, ran once in
  the run (the prefill, its GEMMs and attention) and is shown apart;
- cuBLAS GEMMs that run exactly once a step are the LM head; the others are the layers' linears.

The 25 rows leave out the smallest kernels, so the sum is a little under the device time, and the
step measured (``ms_per_step``, a separate timed run) is above it by the gaps between kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Triton kernels of ternop's own (the C++ ones carry "ternop::" in their names).
TERNOP_LINEAR_KERNELS = ("fused_a8_kernel", "fused_a16_kernel", "int8_gemm_kernel", "decode_int8_kernel",
                         "split_k_reduce_kernel", "ternary_gemv_kernel", "ternary_gemm_kernel",
                         "ternary_dequant_kernel")  # fmt: skip
TERNOP_QUANT_KERNELS = ("quant_rows_kernel", "rms_norm_quant_kernel")

KINDS = (
    "ternop linears",
    "ternop quantization and norms",
    "layer linears (cuBLAS)",
    "LM head (cuBLAS)",
    "Inductor (norms, activation, RoPE; and the quantization when fused into them)",
    "attention and KV-cache write",
    "sampling and other",
)


def kind_of(name: str, calls: int, steps: int) -> str | None:
    """The kind of a device event that ran ``calls`` times in ``steps`` steps; None for once a run."""
    if calls < steps or (calls % steps and calls < 4 * steps):
        return None
    if name.startswith(TERNOP_QUANT_KERNELS):
        return KINDS[1]
    if "ternop::" in name or name.startswith(TERNOP_LINEAR_KERNELS):
        return KINDS[0]
    if "nvjet" in name or "cublas" in name.lower() or "gemm" in name.lower():
        return KINDS[3] if calls == steps else KINDS[2]
    if name.startswith("triton_"):
        return KINDS[4]
    if "flash" in name.lower() or "reshape_and_cache" in name or "attention" in name.lower():
        return KINDS[5]
    return KINDS[6]


def breakdown(profile: dict) -> dict:
    """One ``profile_decode_batch*`` record -> microseconds per step by kind, the once-a-run kernels'
    total, and the kernels taken for each kind."""
    steps = profile["steps"]
    per_step = {kind: 0.0 for kind in KINDS}
    names = {kind: [] for kind in KINDS}
    once = 0.0
    for row in profile["top"]:
        if row.get("self_cpu_us", 0) != 0:  # a host-side op: its kernels are rows of their own
            continue
        kind = kind_of(row["name"], row["calls"], steps)
        if kind is None:
            once += row["self_us"]
        else:
            per_step[kind] += row["self_us"] / steps
            names[kind].append(row["name"][:60])
    return {"per_step_us": per_step, "once_a_run_us": once, "kernels": names}


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = [f"{path.name} (commit {data.get('commit', '?')})"]
    for workload in ("decode", "bitnet"):
        res = data.get(workload)
        if not isinstance(res, dict):
            continue
        for model in res.get("models", []):
            engine = res.get(model, {})
            for key in sorted(k for k in engine if k.startswith("profile_decode_batch")):
                batch = key.removeprefix("profile_decode_batch")
                b = breakdown(engine[key])
                measured = engine.get("decode", {}).get(f"batch_{batch}", {}).get("ms_per_step")
                lines.append(f"  {workload} {model} batch {batch}, us per step:")
                for kind, us in b["per_step_us"].items():
                    if us:
                        lines.append(f"    {us:8.0f}  {kind}")
                lines.append(f"    {sum(b['per_step_us'].values()):8.0f}  sum of these kernels")
                if measured is not None:
                    lines.append(f"    {measured * 1e3:8.0f}  step measured")
                lines.append(f"    ({b['once_a_run_us']:.0f} us once a run: prefill)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    for path in args.files:
        print(report(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
