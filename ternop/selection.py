"""Which linear layers become ternary: one rule for quantize_module, checkpoints, calibration and distillation.

By default, the linear layers inside the repeated transformer blocks are quantized
(``...layers.3.mlp.down_proj``, ``...encoder.layer.0.attention.self.query``, ``...h.2.attn.c_proj``).
Embeddings, lm_head, poolers, classifier heads and anything that matches a skip pattern stay as they are.

A skip pattern is a glob matched anywhere in the dotted module name: ``attention`` skips every
module whose name contains "attention", ``*.0.*`` skips block 0, ``lm_head`` skips the head.
A pattern that matches no linear layer is an error: it is almost always a typo.

Some layers are one layer to a serving engine: vLLM fuses ``q_proj``/``k_proj``/``v_proj`` (BERT's
``query``/``key``/``value``) into ``qkv_proj`` and ``gate_proj``/``up_proj`` into ``gate_up_proj``,
so their parts must be all ternary or all dense (docs/FORMAT.md). :func:`fused_groups` names them,
for whatever chooses layers to keep dense.

:class:`QuantizeReport` records what a conversion decided. It lives here, beside the rule,
so that writing a checkpoint needs neither the op nor ``nn.Module`` conversion.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ternop.format import BLOCK_SIZE

_BLOCK_RE = re.compile(r"(^|\.)(layers?|h|blocks?)\.\d+\.")

DEFAULT_SKIP: tuple[str, ...] = ("lm_head",)

# Sibling layers a serving engine runs as one (the attention input projections; the gated MLP's two).
QKV_PARTS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
MERGED_PARTS: tuple[tuple[str, ...], ...] = (("gate_proj", "up_proj"),)


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


def check_skip_patterns(skip: Iterable[str], linear_names: Iterable[str]) -> None:
    """ValueError naming each pattern of ``skip`` that matches none of ``linear_names``."""
    names = list(linear_names)
    unused = [p for p in skip if not any(matches_any(n, (p,)) for n in names)]
    if unused:
        example = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ValueError(
            f"skip pattern{'s' if len(unused) > 1 else ''} {', '.join(map(repr, unused))} "
            f"match{'' if len(unused) > 1 else 'es'} no linear layer (names look like: {example})"
        )


def fused_groups(names: Iterable[str]) -> list[tuple[str, ...]]:
    """``names`` (dotted layer names) as the units a serving engine loads: the parts of a fused layer
    together (every part present, in QKV_PARTS / MERGED_PARTS order), every other name alone; in
    the order of each unit's first name."""
    names = list(names)
    present = set(names)
    group_of: dict[str, tuple[str, ...]] = {}
    for name in names:
        parent, _, last = name.rpartition(".")
        for parts in (*QKV_PARTS, *MERGED_PARTS):
            if last in parts:
                members = tuple(f"{parent}.{p}" if parent else p for p in parts)
                if all(m in present for m in members):
                    group_of[name] = members
    groups, seen = [], set()
    for name in names:
        unit = group_of.get(name, (name,))
        if unit[0] not in seen:
            seen.add(unit[0])
            groups.append(unit)
    return groups


def select_linears(model: nn.Module, skip=()) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """(name -> nn.Linear to quantize, name -> why each other nn.Linear stays dense), in model order.

    Only plain ``nn.Linear`` modules are considered (subclasses may carry other semantics).
    """
    targets, dense = {}, {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        ok, why = should_quantize(name, module.in_features, skip)
        if ok:
            targets[name] = module
        else:
            dense[name] = why
    check_skip_patterns(skip, [*targets, *dense])
    return targets, dense


@dataclass
class QuantizeReport:
    """What a conversion did: linear layers made ternary, linear layers left dense (with why), weight bytes.

    ``dense_bytes`` and ``ternary_bytes`` count the quantized layers' weights before and after.
    """

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    dense_bytes: int = 0
    ternary_bytes: int = 0

    def summary(self) -> str:
        """One line: counts and bytes."""
        ratio = self.dense_bytes / self.ternary_bytes if self.ternary_bytes else float("nan")
        return (
            f"quantized {len(self.quantized)} linear layers, left {len(self.skipped)} dense; "
            f"their weights: {self.dense_bytes:,} B -> {self.ternary_bytes:,} B ({ratio:.2f}x smaller)"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.quantized:
            lines.append("ternary: " + ", ".join(self.quantized))
        for name, why in self.skipped.items():
            lines.append(f"dense:   {name} ({why})")
        return "\n".join(lines)
