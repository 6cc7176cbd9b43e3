"""``--activations``: the names the tools give to a checkpoint's ``activation_bits``.

``fp`` is 16 (activations as given, the format's default) and ``int8`` is 8 (quantized per
token to int8; ternop/activations.py is the spec). Tables call them A16 and A8.
``ternop eval --activations`` also runs a checkpoint in a mode other than its own, through
:func:`activation_view`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

ACTIVATIONS = {"fp": 16, "int8": 8}


def bits_of(name: str) -> int:
    """``fp`` -> 16, ``int8`` -> 8; ValueError naming the choices otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"--activations must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def label(bits: int) -> str:
    """16 -> "A16", 8 -> "A8"."""
    return f"A{bits}"


def describe(bits: int) -> str:
    """One phrase for reports: what the mode does to activations."""
    return "int8 activations per token (W2A8)" if bits == 8 else "activations as given (W2A16)"


ACTIVATION_CHOICES = ("checkpoint", "fp", "int8", "both")
"""``ternop eval --activations``: the checkpoint's own mode, one mode, or A16 and A8 on the same weights."""


def activation_runs(choice: str, checkpoint_bits: int) -> list[tuple[str, int]]:
    """The ternary runs as (role in the report, activation_bits): one, or A16 then A8 for ``both``."""
    if choice == "checkpoint":
        return [("ternary", checkpoint_bits)]
    if choice == "both":
        return [("ternary", 16), ("ternary_a8", 8)]
    return [("ternary", bits_of(choice))]


def role_prefix(role: str) -> str:
    """The prefix of a role's values in a report: "" for ``ternary``, "a8_" for ``ternary_a8``."""
    return "" if role == "ternary" else role.removeprefix("ternary_") + "_"


@contextlib.contextmanager
def activation_view(path, bits: int | None) -> Iterator[Path]:
    """The checkpoint ``path`` as a folder whose ``quantization_config.activation_bits`` is ``bits``.

    ``path`` itself when it already says so (or ``bits`` is None); else a temporary folder with
    links to every file of ``path`` and a patched config.json, removed on exit.
    """
    from ternop.checkpoint import load_config, read_quant_config

    path = Path(path)
    if bits is None or read_quant_config(path)["activation_bits"] == bits:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="ternop-eval-") as tmp:
        view = Path(tmp) / path.name
        view.mkdir()
        for item in path.iterdir():
            if item.name != "config.json":
                (view / item.name).symlink_to(item.resolve())
        config = load_config(path)
        config["quantization_config"]["activation_bits"] = bits
        (view / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        yield view
