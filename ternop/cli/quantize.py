"""``ternop quantize SRC DST``: an HF model folder -> a ternary v1 checkpoint (:mod:`ternop.quant.convert`)."""

from __future__ import annotations

import argparse

from ternop.cli.modes import ACTIVATIONS, bits_of, describe
from ternop.quant.convert import CALIB_TOKENS, METHODS, quantize_checkpoint, rounding_quantizer
from ternop.quantize import METHODS as QUANTIZE_METHODS
from ternop.quantize import SCALES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="Hugging Face model folder with fp32/fp16/bf16 *.safetensors")
    parser.add_argument("dst", help="output folder for the ternary v1 checkpoint (must not exist or be empty)")
    parser.add_argument("--method", choices=sorted(METHODS), default="optimal",
                        help="how each 128-weight block is made ternary: optimal (the L2-optimal threshold), "
                             "absmean, or calibrated (needs --calib)")
    parser.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                        help="keep modules whose name matches PATTERN (glob, anywhere in the name) dense; "
                             "repeat --skip for more patterns")
    parser.add_argument("--calib", metavar="FILE", default=None, help="calibration text, for --method calibrated")
    parser.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                        help=f"tokens of --calib that calibration uses (default {CALIB_TOKENS}): more estimate each "
                             "layer's input statistics better, at more time and memory")
    parser.add_argument("--activations", choices=list(ACTIVATIONS), default="fp",
                        help="the mode the checkpoint runs in, written as quantization_config.activation_bits: "
                             "fp (16, activations as given) or int8 (8, int8 per token); the weights are the same")
    parser.add_argument("--scales", choices=list(SCALES), default="block",
                        help="one scale per 128 weights (block, the default), or one per row, fitted over the whole "
                             "row and stored in each of its blocks: with --activations int8 the GPU kernels then "
                             "sum whole rows in int32, faster at large batches, at some cost in quality "
                             "(docs/QUALITY.md); --method optimal or absmean")  # fmt: skip
    parser.add_argument("--keep-dense", choices=["none", "auto"], default="none",
                        help="auto: keep the fewest layers dense, ranked by their measured sensitivity, so that the "
                             "wiki MRR of an embedding model (visible set) loses at most X against the fp model")
    parser.add_argument("--max-mrr-loss", type=float, default=0.02, metavar="X",
                        help="with keep dense auto: the largest wiki MRR loss against the fp model to accept")
    parser.add_argument("--size-budget", type=float, default=None, metavar="S",
                        help="with keep dense auto: the converted layers, dense ones counted in fp16, take at most "
                             "S of their fp16 bytes (e.g. 0.25; all ternary is 0.133); layers are then ranked by "
                             "sensitivity per byte, and the bound may be missed")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    skip, quantizer = list(args.skip), None
    if args.scales == "row":
        if args.method not in QUANTIZE_METHODS:
            raise ValueError(f"--scales row takes --method {' or '.join(QUANTIZE_METHODS)}, not {args.method}")
        quantizer = rounding_quantizer(args.method, "row")
    if args.calib_tokens is not None and args.method != "calibrated":
        raise ValueError("--calib-tokens applies to --method calibrated")
    calib_tokens = CALIB_TOKENS if args.calib_tokens is None else args.calib_tokens
    if args.size_budget is not None and args.keep_dense != "auto":
        raise ValueError("--size-budget applies to --keep-dense auto")
    if args.keep_dense == "auto":
        from pathlib import Path

        from ternop.checkpoint import check_destination, check_not_quantized
        from ternop.cli import mixed

        # Every check that needs no model runs before minutes of measuring.
        mixed.check_size_budget(args.size_budget)
        check_not_quantized(Path(args.src))
        check_destination(Path(args.src), args.dst, args.force)
        if quantizer is None:
            quantizer = METHODS[args.method](Path(args.src), args.calib, tuple(skip), calib_tokens, not args.quiet)
        choice, prefixes = mixed.choose(args.src, quantizer, tuple(skip), args.max_mrr_loss, progress=not args.quiet,
                                        size_budget=args.size_budget)  # fmt: skip
        skip += prefixes
        size = mixed.dense_bytes(args.src, prefixes)
        if choice.met:
            verdict = "met"
        elif args.size_budget is None:
            verdict = "NOT met even with every layer dense"
        else:
            verdict = f"NOT met within the size budget {args.size_budget}"
        print(f"keep-dense auto: {len(prefixes)} layers dense ({size['stored'] / 1e6:.2f} MB as stored, "
              f"{size['fp16'] / 1e6:.2f} MB in fp16); wiki MRR {choice.final['wiki_mrr']:.4f} against the fp model's "
              f"{choice.base['wiki_mrr']:.4f} (all ternary {choice.all_ternary['wiki_mrr']:.4f}); "
              f"max loss {args.max_mrr_loss}: {verdict}")  # fmt: skip
    report = quantize_checkpoint(args.src, args.dst, method=args.method, skip=skip, progress=not args.quiet,
                                 calib=args.calib, calib_tokens=calib_tokens, overwrite=args.force,
                                 quantizer=quantizer,
                                 activation_bits=bits_of(args.activations))  # fmt: skip
    print(f"{report.summary()} -> {report.dst}")
    print(f"  activation_bits {report.activation_bits}: {describe(report.activation_bits)}")
    for name, why in report.skipped.items():
        print(f"  dense: {name} ({why})")
    return 0
