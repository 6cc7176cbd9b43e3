"""Which linear layers become ternary: one rule for quantize_module and for checkpoints.

By default, the linear layers inside the repeated transformer blocks are quantized
(``...layers.3.mlp.down_proj``, ``...encoder.layer.0.attention.self.query``, ``...h.2.attn.c_proj``).
Embeddings, lm_head, poolers, classifier heads and anything that matches a skip pattern stay as they are.

A skip pattern is a glob matched anywhere in the dotted module name: ``attention`` skips every
module whose name contains "attention", ``*.0.*`` skips block 0, ``lm_head`` skips the head.
"""

from __future__ import annotations

import fnmatch
import re

from ternop.format import BLOCK_SIZE

_BLOCK_RE = re.compile(r"(^|\.)(layers?|h|blocks?)\.\d+\.")

DEFAULT_SKIP: tuple[str, ...] = ("lm_head",)


def matches_any(name: str, patterns) -> str | None:
    """The first pattern that matches ``name`` (glob, anywhere in the name), or None."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, f"*{pattern}*"):
            return pattern
    return None


def in_transformer_block(name: str) -> bool:
    return _BLOCK_RE.search(name) is not None


def should_quantize(name: str, in_features: int, skip=()) -> tuple[bool, str]:
    """(True, "") if the linear layer ``name`` with K=in_features is quantized, else (False, why)."""
    pattern = matches_any(name, (*DEFAULT_SKIP, *skip))
    if pattern is not None:
        return False, f"matches skip pattern {pattern!r}"
    if not in_transformer_block(name):
        return False, "outside the transformer blocks"
    if in_features % BLOCK_SIZE != 0:
        return False, f"K={in_features} is not a multiple of {BLOCK_SIZE}"
    return True, ""
