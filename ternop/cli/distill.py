"""``ternop distill BASE DST``: quantization-aware distillation into a ternary v1 checkpoint.

The training itself is :mod:`ternop.quant.distill`; this module reads the options and the
training text and checks, before any training, that DST may be written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from ternop.cli.modes import ACTIVATIONS, bits_of
from ternop.quant.distill import DistillConfig


def read_texts(data: str) -> list[str]:
    """The training texts: ``builtin`` (disjoint from the evaluation sets) or a file, one text per line."""
    if data == "builtin":
        from ternop.cli.evaldata import training_texts

        return training_texts()
    from ternop.quant.calibrate import read_calibration_text

    return read_calibration_text(data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig()
    parser.add_argument("base", help="fp Hugging Face embedding model folder (the teacher and the start)")
    parser.add_argument("dst", help="output folder for the ternary v1 checkpoint (must not exist or be empty)")
    parser.add_argument("--data", default="builtin",
                        help="training text file, one text per line; 'builtin' = ternop.cli.evaldata.training_texts() "
                             "(disjoint from the evaluation sets)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="texts per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per text at most")
    parser.add_argument("--lr", type=float, default=d.lr, help="learning rate of latent weights, biases, norms")
    parser.add_argument("--lr-scale", type=float, default=d.lr_scale, help="learning rate of the block scales")
    parser.add_argument("--hidden-weight", type=float, default=d.hidden_weight,
                        help="weight of the hidden-state MSE term (0 = embedding cosine only)")
    parser.add_argument("--init", choices=["calibrated", "optimal", "absmean"], default=d.init,
                        help="how the student's codes and scales start")
    parser.add_argument("--calib-tokens", type=int, default=d.calib_tokens, help="calibration tokens for --init calibrated")
    parser.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                        help="keep modules matching PATTERN dense (repeat --skip for more patterns)")
    parser.add_argument("--activations", choices=list(ACTIVATIONS), default="fp",
                        help="the mode to train for and write as quantization_config.activation_bits: fp (16, "
                             "activations as given) or int8 (8: each ternary layer's input is rounded per token to "
                             "int8 in the forward pass, straight-through in the backward pass)")
    parser.add_argument("--device", default=d.device, help="cpu or cuda")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--resume", action="store_true", help="continue from the saved state")
    parser.add_argument("--state", default=None, metavar="FILE", help="state file (default: DST.distill-state.pt)")
    parser.add_argument("--keep-state", action="store_true", help="keep the state file after DST is written")
    parser.add_argument("--save-every", type=int, default=d.save_every, help="save the state every N steps")
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="save the state and stop after STEP (continue later with --resume)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the batch order and init")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    known = {f.name for f in fields(DistillConfig)}
    values = {k: v for k, v in vars(args).items() if k in known}
    values["skip"] = tuple(args.skip)
    values["overwrite"] = args.force
    values["activation_bits"] = bits_of(getattr(args, "activations", "fp"))
    return DistillConfig(**values)


def main(args: argparse.Namespace) -> int:
    from ternop.checkpoint import check_destination, model_folder, safetensors_files
    from ternop.quant.distill import default_state_path, run

    if args.steps < 1:
        print(f"ternop distill: error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    # Every check that needs no model runs first: a mistake costs seconds, not a training run.
    safetensors_files(model_folder(args.base))
    check_destination(args.base, args.dst, args.force)
    texts = read_texts(args.data)
    cfg = config_from_args(args)
    state = args.state or default_state_path(args.dst)
    if not args.quiet:
        print(f"ternop distill: resumable state in {state}" + ("" if args.keep_state else " (removed when done)"),
              file=sys.stderr)  # fmt: skip
    summary = run(args.base, args.dst, texts, cfg)
    if summary.get("stopped"):
        print(f"stopped at step {summary['steps']} of {args.steps}; state in {summary['state']}; "
              "continue with --resume")  # fmt: skip
        return 0
    print(f"distilled {summary['steps']} steps in {summary['seconds']:.0f} s "
          f"(last batch cosine {summary.get('cos', float('nan')):.4f}) -> {args.dst}")  # fmt: skip
    return 0
