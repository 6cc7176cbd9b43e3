"""``ternop validate DIR [--tp N]``: is a ternary checkpoint loadable and shardable?

Prints exactly three lines and exits 1 if any says FAIL (2 for a folder that does not exist):

    CPU_UNPACK: OK|FAIL <reason>          config readable (its activation_bits is named, and for
                                          int8 how many layers have one scale per row), codes
                                          legal, shapes right, an independent decoding agrees
    GPU_LOAD: OK|SKIPPED|FAIL <reason>    bytes copied to the CUDA device equal the bytes on disk
    TP_SHARD: OK|SKIPPED|FAIL <reason>    the parts of each layer vLLM fuses (q/k/v, gate/up) are all
                                          ternary or all dense, and each rank's shard (through vLLM's
                                          loaders) equals a slice of the full matrix, for every fused layer

Without ``--tp``, TP_SHARD checks tensor parallelism 1 and the largest size up to 8 at which
the checkpoint's layers split on whole 128-weight blocks and heads, and names every such size;
with ``--tp N`` it checks N alone. GPU_LOAD and TP_SHARD are SKIPPED when CPU_UNPACK fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from ternop.format import BLOCK_SIZE

MAX_TP = 8


def _independent_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/4] -> int8 values [N, K], written from the format text without ternop's unpacker."""
    out = torch.empty(packed.shape[0], packed.shape[1], 4, dtype=torch.int8)
    for j in range(4):
        code = (packed.to(torch.int16) >> (2 * j)) & 0b11
        out[:, :, j] = torch.where(code == 0b01, 1, torch.where(code == 0b10, -1, 0)).to(torch.int8)
    return out.reshape(packed.shape[0], -1)


def _independent_dense(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: each 128-block of the independent values times its scale, by broadcasting."""
    values = _independent_values(packed).to(torch.float32)
    n, k = values.shape
    blocks = values.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE) * scale.to(torch.float32).unsqueeze(-1)
    return blocks.reshape(n, k)


def check_cpu_unpack(path) -> str:
    """Raises on the first problem; returns a short summary that names the activation mode."""
    from ternop.checkpoint import CheckpointError, load_ternary_layers, read_quant_config
    from ternop.cli.modes import describe
    from ternop.format import codes_to_values, dequantize, unpack_codes, validate

    qc = read_quant_config(path)
    if qc is None:
        raise CheckpointError("not a ternary checkpoint: config.json has no quantization_config")
    layers = load_ternary_layers(path)
    if not layers:
        raise CheckpointError("not a ternary checkpoint: no <prefix>.weight_packed tensors found")
    skipped = set(qc["modules_to_not_convert"])
    n_weights = 0
    for prefix, (packed, scale) in layers.items():
        validate(packed, scale, prefix)
        if prefix in skipped:
            raise CheckpointError(f"{prefix}: is ternary but listed in modules_to_not_convert")
        if not torch.equal(codes_to_values(unpack_codes(packed)), _independent_values(packed)):
            raise CheckpointError(f"{prefix}: unpacked codes differ from the format's bit layout")
        if not torch.equal(dequantize(packed, scale), _independent_dense(packed, scale)):
            raise CheckpointError(f"{prefix}: dequantized weight differs from value x block scale")
        n_weights += packed.numel() * 4
    bits = qc["activation_bits"]
    summary = f"{len(layers)} layers, {n_weights:,} weights; activation_bits {bits}: {describe(bits)}"
    if bits == 8:
        from ternop.activations import row_scales

        rows = sum(row_scales(scale) is not None for _, scale in layers.values())
        summary += f"; {rows} of {len(layers)} layers with one scale per row (int32 sums over all of K)"
    return summary


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


def check_fused_parts(ternary, dense) -> None:
    """CheckpointError naming the first layer vLLM fuses (q/k/v, gate/up) of which ``dense`` (the
    checkpoint's ``modules_to_not_convert``) lists some parts but not all: vLLM refuses to load it."""
    from ternop.checkpoint import CheckpointError
    from ternop.selection import fused_groups

    dense = set(dense)
    for group in fused_groups([*ternary, *(d for d in dense if d not in ternary)]):
        listed = [p for p in group if p in dense]
        if 0 < len(listed) < len(group):
            raise CheckpointError(f"vLLM runs {', '.join(group)} as one layer, so they must be all ternary or all "
                                  f"dense, but modules_to_not_convert lists only {', '.join(listed)}")  # fmt: skip


def check_tp_shard(path, tp: int | None) -> str:
    """With ``tp``, that size only; without, 1 and the largest supported size up to MAX_TP."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from ternop.checkpoint import load_config, load_ternary_layers, read_quant_config
    from ternop.vllm_plugin.sharding import check_tp_shards, supported_tp_sizes

    layers, config = load_ternary_layers(path), load_config(path)
    check_fused_parts(layers, read_quant_config(path)["modules_to_not_convert"])
    supported = supported_tp_sizes(layers, config, MAX_TP)
    sizes = [tp] if tp is not None else sorted({1, max(supported, default=1)})
    for size in sizes:
        groups = check_tp_shards(layers, config, size)
    kinds = sorted({g.split("(")[1].split(",")[0] for g in groups})
    detail = f"tp={', '.join(map(str, sizes))}: {len(groups)} layers ({', '.join(kinds)})"
    if tp is None:
        detail += f"; supported tp sizes up to {MAX_TP}: {', '.join(map(str, supported))}"
    return detail


def run(path, tp: int | None = None) -> tuple[list[str], bool]:
    """The three status lines and whether all passed."""
    lines, ok = [], True

    def one(label, fn, *args) -> bool:
        nonlocal ok
        try:
            # vLLM and others may print on stdout; the three status lines must be the only output there.
            with contextlib.redirect_stdout(sys.stderr):
                detail = fn(*args)
        except Exception as e:  # noqa: BLE001  (the reason is the report)
            ok = False
            lines.append(f"{label}: FAIL {type(e).__name__}: {e}".replace("\n", " "))
            return False
        lines.append(f"{label}: SKIPPED (no CUDA device)" if detail is None else f"{label}: OK ({detail})")
        return True

    if one("CPU_UNPACK", check_cpu_unpack, path):
        one("GPU_LOAD", check_gpu_load, path)
        one("TP_SHARD", check_tp_shard, path, tp)
    else:
        lines += ["GPU_LOAD: SKIPPED (CPU_UNPACK failed)", "TP_SHARD: SKIPPED (CPU_UNPACK failed)"]
    return lines, ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="ternary v1 checkpoint folder")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help=f"check this tensor-parallel size only (default: 1 and the largest size up to "
                             f"{MAX_TP} the checkpoint supports)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from ternop.checkpoint import model_folder

    if args.tp is not None and args.tp < 1:
        print(f"ternop validate: error: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    model_folder(args.dir)  # a missing folder is a usage error (exit 2), not a FAIL line
    lines, ok = run(args.dir, args.tp)
    for line in lines:
        print(line)
    return 0 if ok else 1
