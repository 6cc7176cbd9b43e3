"""``ternop validate DIR [--tp N]``: is a ternary checkpoint loadable and shardable?

Prints exactly three lines and exits non-zero if any says FAIL:

    CPU_UNPACK: OK|FAIL <reason>          codes legal, shapes right, unpacked values exact
    GPU_LOAD: OK|SKIPPED|FAIL <reason>    bytes copied to the CUDA device equal the bytes on disk
    TP_SHARD: OK|FAIL <reason>            each rank's shard (through vLLM's loaders) equals a slice
                                          of the full matrix, for every fused layer
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch


def _independent_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/4] -> int8 values [N, K], written from the format text without ternop's unpacker."""
    out = torch.empty(packed.shape[0], packed.shape[1], 4, dtype=torch.int8)
    for j in range(4):
        code = (packed.to(torch.int16) >> (2 * j)) & 0b11
        out[:, :, j] = torch.where(code == 0b01, 1, torch.where(code == 0b10, -1, 0)).to(torch.int8)
    return out.reshape(packed.shape[0], -1)


def check_cpu_unpack(path) -> str:
    """Raises on the first problem; returns a short summary."""
    from ternop.checkpoint import CheckpointError, load_ternary_layers, read_quant_config
    from ternop.format import codes_to_values, dequantize, unpack_codes, validate

    qc = read_quant_config(path)
    if qc is None:
        raise CheckpointError("config.json has no quantization_config; not a ternary checkpoint")
    layers = load_ternary_layers(path)
    if not layers:
        raise CheckpointError("no <prefix>.weight_packed tensors found")
    skipped = set(qc["modules_to_not_convert"])
    n_weights = 0
    for prefix, (packed, scale) in layers.items():
        validate(packed, scale, prefix)
        if prefix in skipped:
            raise CheckpointError(f"{prefix}: is ternary but listed in modules_to_not_convert")
        values = codes_to_values(unpack_codes(packed))
        if not torch.equal(values, _independent_values(packed)):
            raise CheckpointError(f"{prefix}: unpacked codes differ from the format's bit layout")
        dense = dequantize(packed, scale)
        want = values.to(torch.float32) * scale.to(torch.float32).repeat_interleave(128, dim=1)
        if not torch.equal(dense, want):
            raise CheckpointError(f"{prefix}: dequantized weight differs from value * scale")
        n_weights += values.numel()
    return f"{len(layers)} layers, {n_weights:,} weights"


def check_gpu_load(path) -> str | None:
    """None when there is no CUDA device; else copies each layer to it and compares the bytes."""
    if not torch.cuda.is_available():
        return None
    from ternop.checkpoint import load_ternary_layers

    layers = load_ternary_layers(path)
    device = torch.device("cuda")
    for prefix, (packed, scale) in layers.items():
        for name, t in (("weight_packed", packed), ("weight_scale", scale)):
            on_device = t.to(device)
            if on_device.dtype != t.dtype or on_device.shape != t.shape:
                raise RuntimeError(f"{prefix}.{name}: {on_device.dtype} {list(on_device.shape)} on {device}")
            if not torch.equal(on_device.cpu().view(torch.uint8), t.view(torch.uint8)):
                raise RuntimeError(f"{prefix}.{name}: bytes on {device} differ from the bytes on disk")
    return f"{len(layers)} layers on {torch.cuda.get_device_name(device)}"


def check_tp_shard(path, tp: int) -> str:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from ternop.vllm_plugin.sharding import check_tp_shards_dir

    groups = check_tp_shards_dir(path, tp)
    kinds = sorted({g.split("(")[1].split(",")[0] for g in groups})
    return f"tp={tp}, {len(groups)} layers ({', '.join(kinds)})"


def run(path, tp: int = 2) -> tuple[list[str], bool]:
    """The three status lines and whether all passed."""
    lines, ok = [], True

    def one(label, fn, *args):
        nonlocal ok
        try:
            # vLLM and others may print on stdout; the three status lines must be the only output there.
            with contextlib.redirect_stdout(sys.stderr):
                detail = fn(*args)
        except Exception as e:  # noqa: BLE001  (the reason is the report)
            ok = False
            lines.append(f"{label}: FAIL {type(e).__name__}: {e}".replace("\n", " "))
            return
        if detail is None:
            lines.append(f"{label}: SKIPPED (no CUDA device)")
        else:
            lines.append(f"{label}: OK ({detail})")

    one("CPU_UNPACK", check_cpu_unpack, path)
    one("GPU_LOAD", check_gpu_load, path)
    one("TP_SHARD", check_tp_shard, path, tp)
    return lines, ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="ternary v1 checkpoint folder")
    parser.add_argument("--tp", type=int, default=2, metavar="N", help="tensor-parallel size to simulate (default 2)")


def main(args: argparse.Namespace) -> int:
    if args.tp < 1:
        print(f"ternop validate: error: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    lines, ok = run(args.dir, args.tp)
    for line in lines:
        print(line)
    return 0 if ok else 1
