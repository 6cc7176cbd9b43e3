"""The ``ternop`` console script.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``main(args) -> int``. Modules import their heavy dependencies (vllm, transformers)
inside ``main``, so ``ternop --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "quantize": ("ternop.checkpoint.writer", "quantize an HF model folder into a ternary v1 checkpoint"),
    "validate": ("ternop.cli.validate", "check a ternary checkpoint: codes, device load, TP shards"),
    "eval": ("ternop.cli.evaluate", "compare a ternary model's quality and memory against its base"),
    "serve": ("ternop.cli.serve", "serve a ternary checkpoint with vLLM's OpenAI-compatible server"),
    "distill": ("ternop.quant.distill", "quantization-aware distillation of an embedding model"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (the others stay listed)."""
    parser = argparse.ArgumentParser(prog="ternop", description="Ternary-weight linear layers for PyTorch and vLLM.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
