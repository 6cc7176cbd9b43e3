"""A conversion plan and its writer: every output tensor, decided before any byte is written.

A source (:mod:`ternop.quant.bitnet_import`, :mod:`ternop.quant.gguf_import`) becomes a :class:`Plan`:
each ternary layer with a function that reads its dense dequantized weight, each other tensor with
a function that reads it, the config and the side files. :func:`write_plan` writes it one tensor
at a time into a hidden folder that replaces DST at the end or is removed on any error
(``atomic_folder``); each ternary layer goes through :func:`ternop.quant.exact.exact_pair`, which
checks that the pair dequantizes to exactly that weight.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ternop.checkpoint import CheckpointError, atomic_folder, quant_config
from ternop.checkpoint.safetensors_io import element_size, write_safetensors
from ternop.format import BLOCK_SIZE, CODES_PER_BYTE, PACKED_DTYPE, SCALE_DTYPE, packed_bytes
from ternop.quant.exact import NotExact, exact_pair

PACKED_SUFFIX, SCALE_SUFFIX = ".weight_packed", ".weight_scale"
SHARD_BYTES = 4 << 30  # one output file per this many bytes of tensors, as save_pretrained shards


@dataclass
class Layer:
    """One ternary layer: ``load()`` returns its dense dequantized weight ``[n, k]`` (the exactness reference)."""

    prefix: str
    n: int
    k: int
    load: Callable[[], torch.Tensor]
    source_bytes: int = 0


@dataclass
class Dense:
    """One tensor copied as it is (after the source's own dequantization): embeddings, norms, dense layers."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


@dataclass
class Plan:
    """Everything a conversion will write, decided before anything is read."""

    description: str
    config: dict  # config.json without quantization_config; quantization_config is added on writing
    layers: list[Layer] = field(default_factory=list)
    dense: list[Dense] = field(default_factory=list)
    dense_linears: dict[str, str] = field(default_factory=dict)  # prefix -> why; modules_to_not_convert
    activation_bits: int = 16
    write_files: Callable[[Path], None] = lambda tmp: None  # tokenizer and other files beside the weights


def check_layer_shapes(layers: list[Layer]) -> None:
    """NotExact naming the first layer whose K format v1 cannot store (before anything is read)."""
    for layer in layers:
        if layer.k % BLOCK_SIZE != 0:
            raise NotExact(
                f"{layer.prefix}.weight has K={layer.k} (shape [{layer.n}, {layer.k}]), not a multiple of "
                f"{BLOCK_SIZE}: format v1 cannot store it exactly, and ternop convert does not round"
            )


def _items(plan: Plan) -> list[tuple[int, list[tuple[str, torch.dtype, tuple[int, ...]]], object]]:
    """(bytes, [(name, dtype, shape)], what) per unit that must stay in one file: a layer's pair, or a tensor."""
    out = []
    for layer in plan.layers:
        entries = [(layer.prefix + PACKED_SUFFIX, PACKED_DTYPE, (layer.n, layer.k // CODES_PER_BYTE)),
                   (layer.prefix + SCALE_SUFFIX, SCALE_DTYPE, (layer.n, layer.k // BLOCK_SIZE))]  # fmt: skip
        out.append((packed_bytes(layer.n, layer.k), entries, layer))
    for t in plan.dense:
        size = element_size(t.dtype) * int(torch.Size(t.shape).numel())
        out.append((size, [(t.name, t.dtype, t.shape)], t))
    return out


def _shards(plan: Plan, shard_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for item in _items(plan):
        if current and size + item[0] > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item[0]
    return [*shards, current] if current else shards


def write_plan(plan: Plan, dst: str | os.PathLike, *, overwrite: bool = False, progress: bool = True,
               shard_bytes: int = SHARD_BYTES) -> None:  # fmt: skip
    """Writes ``plan`` as a v1 checkpoint at ``dst``: whole, or not at all."""
    from tqdm import tqdm

    names = [e[0] for _, entries, _ in _items(plan) for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"the conversion would write these tensors twice: {dup[:5]}")
    qc = quant_config(plan.dense_linears, plan.activation_bits)
    shards = _shards(plan, shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])  # fmt: skip
    with atomic_folder(dst) as tmp:
        plan.write_files(tmp)
        config = {**plan.config, "quantization_config": qc}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        bar = tqdm(total=len(plan.layers), unit="layer", desc="convert", file=sys.stderr, disable=not progress)
        weight_map = {}
        for file, shard in zip(files, shards):
            table = {}
            for _, entries, what in shard:
                for name, _, _ in entries:
                    table[name] = what
                    weight_map[name] = file
            pending: dict[str, torch.Tensor] = {}

            def produce(name: str, table=table, pending=pending) -> torch.Tensor:
                if name in pending:
                    return pending.pop(name)
                what = table[name]
                if isinstance(what, Dense):
                    return what.load().to(what.dtype)
                bar.set_postfix_str(what.prefix, refresh=False)
                packed, scale = exact_pair(what.load(), what.prefix + ".weight")
                pending[what.prefix + SCALE_SUFFIX] = scale
                bar.update(1)
                return packed

            plan_entries = [e for _, entries, _ in shard for e in entries]
            write_safetensors(tmp / file, plan_entries, produce, {"format": "pt"})
        bar.close()
        if len(files) > 1:
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, tmp: Path) -> None:
    """Copies a model folder's files other than weights and config.json (tokenizer, generation config, README)."""
    for item in src.iterdir():
        if item.name == "config.json" or item.name.startswith(".") or item.suffix == ".safetensors" \
                or item.name.endswith(".safetensors.index.json"):  # fmt: skip
            continue
        if item.is_dir():
            shutil.copytree(item, tmp / item.name)
        else:
            shutil.copy2(item, tmp / item.name)
