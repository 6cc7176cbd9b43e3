"""The ``ternop`` console script (also ``python -m ternop.cli``).

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``main(args) -> int``. Modules import their heavy dependencies (vllm, transformers)
inside ``main``, so ``ternop --help`` stays fast.

Errors a user can fix (a missing folder, a bad option, a corrupt checkpoint) print one line,
``ternop COMMAND: error: ...``, and exit 2; Ctrl-C and SIGTERM exit 130 and 143 after
the command's own clean-up (a half-written checkpoint folder is removed). Set
``TERNOP_TRACEBACK=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

COMMANDS = {
    "quantize": ("ternop.cli.quantize", "quantize an HF model folder into a ternary v1 checkpoint"),
    "convert": ("ternop.cli.convert", "convert a ternary checkpoint (HF BitNet, GGUF TQ1_0/TQ2_0) to v1, exactly"),
    "validate": ("ternop.cli.validate", "check a ternary checkpoint: codes, device load, TP shards"),
    "eval": ("ternop.cli.evaluate", "compare a ternary model's quality and memory against its base"),
    "serve": ("ternop.cli.serve", "serve a ternary checkpoint with vLLM's OpenAI-compatible server"),
    "distill": ("ternop.cli.distill", "quantization-aware distillation of an embedding model"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, unless it is empty or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or default == []:
            return text
        if not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that clean-up (``finally``, ``except BaseException``) runs."""


def _on_sigterm(signum, frame):
    raise Terminated


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (the others stay listed)."""
    from ternop import __version__

    parser = argparse.ArgumentParser(prog="ternop", description="Ternary-weight linear layers for PyTorch and vLLM.")
    parser.add_argument("--version", action="version", version=f"ternop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that carry a message for the user, not a bug report."""
    from ternop.cli.evaldata import EvalDataError
    from ternop.cli.wordnet import WordNetMissing

    return (ValueError, OSError, EvalDataError, WordNetMissing)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    previous = None
    if _in_main_thread():  # signal handlers can only be set there
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    debug = bool(os.environ.get("TERNOP_TRACEBACK"))
    try:
        return int(args._module.main(args) or 0)
    except KeyboardInterrupt:
        print(f"\nternop {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"ternop {args.command}: terminated", file=sys.stderr)
        return 143
    except _user_errors() as e:
        if debug:
            raise
        print(f"ternop {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()

