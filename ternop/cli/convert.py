"""``ternop convert SRC DST``: a checkpoint that is already ternary -> a v1 checkpoint, exactly (:mod:`ternop.quant.importer`)."""

from __future__ import annotations

import argparse

from ternop.cli.modes import ACTIVATIONS, bits_of, describe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a Hugging Face BitNet folder (quant_method bitnet, packed or master weights), "
                                    "or a GGUF file with TQ1_0 / TQ2_0 layers (or a folder holding one)")
    parser.add_argument("dst", help="output folder for the ternary v1 checkpoint (must not exist or be empty)")
    parser.add_argument("--activations", choices=list(ACTIVATIONS), default=None,
                        help="the mode the checkpoint runs in (quantization_config.activation_bits): fp (16) or "
                             "int8 (8); by default the source's own: int8 for BitNet, fp for GGUF")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from ternop.quant.importer import convert_checkpoint

    bits = None if args.activations is None else bits_of(args.activations)
    report = convert_checkpoint(args.src, args.dst, overwrite=args.force, progress=not args.quiet, activation_bits=bits)
    print(f"{report.source}")
    print(f"{report.summary()} -> {report.dst}")
    print("  each ternary layer was checked to dequantize exactly to the source's weights")
    print(f"  activation_bits {report.activation_bits}: {describe(report.activation_bits)}")
    for name, why in report.skipped.items():
        print(f"  dense: {name} ({why})")
    return 0
