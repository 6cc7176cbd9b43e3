"""``ternop distill BASE DST``: quantization-aware distillation into a ternary v1 checkpoint.

The training itself is :mod:`ternop.quant.distill`; this module reads the options and the
training text and checks, before any training, that DST may be written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from ternop.cli.modes import ACTIVATIONS, bits_of
from ternop.quant.batches import check_mix
from ternop.quant.distill import DistillConfig
from ternop.quant.student_init import LR_SCALE


def read_texts(data: str) -> list[str]:
    """The training texts: ``builtin`` (disjoint from the evaluation sets) or a file, one text per line."""
    if data == "builtin":
        from ternop.cli.traindata import training_texts

        return training_texts()
    from ternop.quant.calibrate import read_calibration_text

    return read_calibration_text(data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig()
    parser.add_argument("base", help="fp Hugging Face embedding model folder (the teacher and the start)")
    parser.add_argument("dst", help="output folder for the ternary v1 checkpoint (must not exist or be empty)")
    parser.add_argument("--data", default="builtin",
                        help="training text file, one text per line; 'builtin' = ternop.cli.traindata.training_texts() "
                             "(news, Wikipedia, WordNet and Python-docs text, disjoint from every evaluation set)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="texts per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per text at most")
    parser.add_argument("--lr", type=float, default=d.lr, help="learning rate of latent weights, biases, norms")
    parser.add_argument("--lr-scale", type=float, default=d.lr_scale,
                        help=f"learning rate of the block scales (default: {LR_SCALE:g}, or 0 with --init-from: "
                             "with a fresh optimizer, learnt scales drift away from a trained start)")
    parser.add_argument("--cos-weight", type=float, default=d.cos_weight,
                        help="weight of 1 - cos between the student's and the teacher's pooled embeddings")
    parser.add_argument("--rel-weight", type=float, default=d.rel_weight,
                        help="weight of in-batch relational distillation (the teacher's similarity matrix)")
    parser.add_argument("--rel-temp", type=float, default=d.rel_temp,
                        help="relational term: softmax temperature of the KL form; 0 = MSE of the cosines")
    parser.add_argument("--hidden-weight", type=float, default=d.hidden_weight,
                        help="weight of the hidden-state MSE term (0 = embedding terms only)")
    parser.add_argument("--hidden-layers", choices=["last", "all"], default=d.hidden_layers,
                        help="hidden-state term on the last layer's output or the mean over every layer's")
    parser.add_argument("--mix", default=None, metavar="W,S,L",
                        help="length mix: probabilities of a step drawing single words/phrases (<= 3 words, "
                             "4x --batch-size texts), short texts (4-30 words, 2x) or long ones; default: "
                             "--batch-size texts sampled from all texts alike")
    parser.add_argument("--schedule", choices=["linear", "cosine", "constant"], default=d.schedule,
                        help="learning-rate decay after the warm-up (to 5%% of the peak)")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="steps of linear learning-rate warm-up")
    parser.add_argument("--export-every", type=int, default=d.export_every, metavar="N",
                        help="also write the student as a v1 checkpoint DST.step<N> every N steps (0 = never)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="end training so that the run (loading and calibration included) takes about SECONDS "
                             "plus the export: the schedule is shortened to the steps that fit (not reproducible)")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="append one JSON line every --log-every steps: loss terms (averaged), lr, lr_scale, seconds")
    parser.add_argument("--log-every", type=int, default=d.log_every, metavar="N", help="steps per --log line")
    parser.add_argument("--init", choices=["calibrated", "optimal", "absmean"], default=d.init,
                        help="how the student's codes and scales start")
    parser.add_argument("--init-from", default=None, metavar="CKPT",
                        help="start from this ternary checkpoint of BASE (e.g. an earlier run's DST): its codes, "
                             "scales, biases and norms, with a fresh optimizer and schedule (instead of --init)")
    parser.add_argument("--calib-tokens", type=int, default=d.calib_tokens, help="calibration tokens for --init calibrated")
    parser.add_argument("--scales", choices=["block", "row"], default=d.scales,
                        help="one learnt scale per 128 weights (block), or one per row (row: what the int8 kernels "
                             "sum over all of K, docs/KERNELS.md; starts from --init optimal or absmean)")
    parser.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                        help="keep modules matching PATTERN dense (repeat --skip for more patterns)")
    parser.add_argument("--keep-dense", choices=["none", "auto"], default="none",
                        help="auto: before training, rank the layers around the checkpoint CKPT below by the mean "
                             "cosine each one gains dense (visible wiki texts), keep dense the best per byte that fit "
                             "the size budget S, and distil the other layers around them (docs/QUALITY.md)")
    parser.add_argument("--rank-from", default=None, metavar="CKPT",
                        help="with keep dense auto: a ternary checkpoint of BASE made with the same --skip, e.g. "
                             "an earlier all-ternary run's DST; its trained biases and norms go into the dense model "
                             "the layers are ranked in")
    parser.add_argument("--size-budget", type=float, default=None, metavar="S",
                        help="with keep dense auto: the trained layers, dense ones counted in fp16, take at most S "
                             "of their fp16 bytes (e.g. 0.25; all ternary is 0.133)")
    parser.add_argument("--max-mrr-loss", type=float, default=None, metavar="X",
                        help="with keep dense auto: stop adding dense layers once the visible wiki MRR is within X "
                             "of the dense model's (default 0: take layers while they fit the budget)")
    parser.add_argument("--activations", choices=list(ACTIVATIONS), default="fp",
                        help="the mode to train for and write as quantization_config.activation_bits: fp (16, "
                             "activations as given) or int8 (8: each ternary layer's input is rounded per token to "
                             "int8 in the forward pass, straight-through in the backward pass)")
    parser.add_argument("--device", default=d.device, help="cpu or cuda")
    parser.add_argument("--no-tf32", dest="tf32", action="store_false",
                        help="on CUDA, train with full-precision fp32 matmuls (default: TF32 tensor cores)")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--resume", action="store_true", help="continue from the saved state")
    parser.add_argument("--state", default=None, metavar="FILE", help="state file (default: DST.distill-state.pt)")
    parser.add_argument("--keep-state", action="store_true", help="keep the state file after DST is written")
    parser.add_argument("--save-every", type=int, default=d.save_every, help="save the state every N steps")
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="save the state and stop after STEP (continue later with --resume)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the batch order and init")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")  # fmt: skip


def parse_mix(text: str | None) -> tuple[float, float, float] | None:
    """``"W,S,L"`` -> three floats (word, short, long); None stays None."""
    if text is None:
        return None
    try:
        return check_mix(text.split(","))
    except ValueError:
        raise ValueError(f"--mix expects three probabilities W,S,L >= 0 with a positive sum, got {text!r}") from None


def _bad_number(args: argparse.Namespace) -> str | None:
    for flag, value, low in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                             ("--save-every", args.save_every, 1), ("--log-every", args.log_every, 1),
                             ("--warmup", args.warmup, 0), ("--export-every", args.export_every, 0)):  # fmt: skip
        if value < low:
            return f"{flag} must be >= {low}, got {value}"
    if args.time_limit is not None and args.time_limit <= 0:
        return f"--time-limit must be > 0 seconds, got {args.time_limit}"
    return None


def _bad_keep_dense(args: argparse.Namespace) -> str | None:
    """What is wrong with the --keep-dense options, before any model is read, or None."""
    from ternop.cli.mixed import check_size_budget

    given = [flag for flag, value in (("--rank-from", args.rank_from), ("--size-budget", args.size_budget),
                                      ("--max-mrr-loss", args.max_mrr_loss)) if value is not None]  # fmt: skip
    if args.keep_dense != "auto":
        return f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --keep-dense auto" if given else None
    if args.rank_from is None or args.size_budget is None:
        return ("--keep-dense auto needs --rank-from CKPT (a ternary checkpoint of BASE, e.g. an earlier "
                "all-ternary run) and --size-budget S")  # fmt: skip
    if args.init_from:
        return ("--keep-dense auto trains the layers it leaves ternary from --init; --init-from would need "
                "those of CKPT to be exactly them (give the chosen layers as --skip instead)")  # fmt: skip
    if args.max_mrr_loss is not None and args.max_mrr_loss < 0:
        return f"--max-mrr-loss must be >= 0, got {args.max_mrr_loss}"
    try:
        check_size_budget(args.size_budget)
    except ValueError as e:
        return str(e)
    return None


def keep_dense(args: argparse.Namespace, state) -> list[str]:
    """The module names --keep-dense auto keeps dense: those a resumed run's state recorded, else
    the chooser's around --rank-from (printed with the --skip flags that repeat the choice)."""
    import torch

    from ternop.cli import mixed

    if args.resume and Path(state).exists():
        # Mapped, not read: run() loads the whole state again; only its list of dense layers is needed here.
        saved = torch.load(state, map_location="cpu", mmap=True).get("skip")
        if saved is None:
            raise ValueError(f"the state in {state} does not record its dense layers; resume without --keep-dense "
                             "auto, with the --skip flags the run printed")  # fmt: skip
        dense = [p for p in saved if p not in args.skip]
        print(f"keep-dense auto: resuming with the {len(dense)} dense layers the run chose", file=sys.stderr)
        return dense
    loss = args.max_mrr_loss or 0.0
    choice, shapes = mixed.choose_around(args.base, args.rank_from, tuple(args.skip), loss, progress=not args.quiet,
                                         size_budget=args.size_budget)  # fmt: skip
    share = mixed.size_share(shapes, set(choice.dense))
    verdict = "met" if choice.met else f"not met within the size budget {args.size_budget}"
    print(f"keep-dense auto: {len(choice.dense)} of {len(shapes)} layers dense, {share:.3f} of their fp16 bytes; "
          f"visible wiki MRR around {args.rank_from}: dense {choice.base['wiki_mrr']:.4f}, all ternary "
          f"{choice.all_ternary['wiki_mrr']:.4f}, chosen {choice.final['wiki_mrr']:.4f} (max loss {loss}: {verdict})")
    if choice.dense:
        print("  the same layers as flags: " + " ".join(f"--skip {name}" for name in choice.dense))
    return list(choice.dense)


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    known = {f.name for f in fields(DistillConfig)}
    values = {k: v for k, v in vars(args).items() if k in known}
    values["skip"] = tuple(args.skip)
    values["mix"] = parse_mix(args.mix)
    values["overwrite"] = args.force
    values["activation_bits"] = bits_of(getattr(args, "activations", "fp"))
    return DistillConfig(**values)


def main(args: argparse.Namespace) -> int:
    from ternop.checkpoint import check_destination, model_folder, safetensors_files
    from ternop.quant.distill import default_state_path, run

    bad = _bad_number(args) or _bad_keep_dense(args)
    if bad is None and args.scales == "row" and args.init == "calibrated" and not args.init_from:
        bad = "--scales row starts from --init optimal or absmean (calibration fits a scale per block)"
    if bad:
        print(f"ternop distill: error: {bad}", file=sys.stderr)
        return 2
    # Every check that needs no model runs first: a mistake costs seconds, not a training run.
    safetensors_files(model_folder(args.base))
    if args.init_from:
        safetensors_files(model_folder(args.init_from))
        if Path(args.init_from).resolve() == Path(args.dst).resolve():
            print("ternop distill: error: --init-from and DST are one folder; write the new run elsewhere",
                  file=sys.stderr)  # fmt: skip
            return 2
    if args.keep_dense == "auto":
        safetensors_files(model_folder(args.rank_from))
    check_destination(args.base, args.dst, args.force)
    state = args.state or default_state_path(args.dst)
    texts = read_texts(args.data)
    if args.keep_dense == "auto":
        args.skip = [*args.skip, *keep_dense(args, state)]
    cfg = config_from_args(args)
    if not args.quiet:
        print(f"ternop distill: resumable state in {state}" + ("" if args.keep_state else " (removed when done)"),
              file=sys.stderr)  # fmt: skip
    summary = run(args.base, args.dst, texts, cfg)
    if summary.get("stopped"):
        print(f"stopped at step {summary['steps']} of {args.steps}; state in {summary['state']}; "
              "continue with --resume")  # fmt: skip
        return 0
    limited = " (shortened by --time-limit)" if summary.get("time_limited") else ""
    print(f"distilled {summary['steps']} steps{limited} in {summary['seconds']:.0f} s "
          f"(last batch cosine {summary.get('cos', float('nan')):.4f}) -> {args.dst}")  # fmt: skip
    return 0
