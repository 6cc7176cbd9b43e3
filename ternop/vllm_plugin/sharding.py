"""Tensor-parallel shards of a ternary checkpoint, computed by vLLM's own layers and loaders.

For each rank of a simulated TP group, the checkpoint's ternary layers are loaded into real
vLLM linear layers (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear,
RowParallelLinear) built with ``TernaryConfig``, through the same weight_loader_v2 and
parameter classes vLLM uses at serve time. Each rank's shard is then compared with
``torch.equal`` against slices of the fully unpacked matrix, computed here independently.

No process group is started: the TP rank and size are what vLLM's layer and parameter
modules read from ``get_tensor_model_parallel_rank/world_size``, which are patched for the
duration of one simulated rank.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from unittest import mock

import torch

from ternop.format import BLOCK_SIZE, unpack_codes
from ternop.selection import MERGED_PARTS, QKV_PARTS

_ROW_NAMES = {"o_proj", "down_proj", "out_proj", "c_proj", "fc2", "wo", "dense_4h_to_h"}


class ShardMismatch(AssertionError):
    """A rank's shard differs from the slice of the full matrix; the message names layer, rank and tensor."""


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int):
    """Makes vLLM's linear layers and parameters see TP rank ``rank`` of ``world_size``."""
    import vllm.model_executor.layers.linear as linear_mod
    import vllm.model_executor.parameter as param_mod

    with contextlib.ExitStack() as stack:
        for mod in (linear_mod, param_mod):
            stack.enter_context(mock.patch.object(mod, "get_tensor_model_parallel_rank", lambda: rank))
            stack.enter_context(mock.patch.object(mod, "get_tensor_model_parallel_world_size", lambda: world_size))
        yield


def _is_row(prefix: str) -> bool:
    parts = prefix.split(".")
    # BERT: attention.output.dense and layer.N.output.dense are row-parallel; intermediate.dense is not.
    return parts[-1] in _ROW_NAMES or (parts[-1] == "dense" and len(parts) > 1 and parts[-2] == "output")


def plan_groups(prefixes) -> list[tuple[str, str, list[tuple[str, object]]]]:
    """Groups checkpoint layers as vLLM fuses them: [(kind, fused_prefix, [(part_prefix, shard_id)])].

    kind is "qkv", "merged", "row" or "column".
    """
    remaining = set(prefixes)
    groups = []
    parents = {p.rpartition(".")[0] for p in remaining}
    for parent in sorted(parents):
        for names in QKV_PARTS:
            parts = [f"{parent}.{n}" for n in names]
            if all(p in remaining for p in parts):
                groups.append(("qkv", f"{parent}.qkv_proj", list(zip(parts, ("q", "k", "v")))))
                remaining -= set(parts)
        for names in MERGED_PARTS:
            parts = [f"{parent}.{n}" for n in names]
            if all(p in remaining for p in parts):
                groups.append(("merged", f"{parent}.gate_up_proj", list(zip(parts, range(len(parts))))))
                remaining -= set(parts)
    for p in sorted(remaining):
        groups.append(("row" if _is_row(p) else "column", p, [(p, None)]))
    return groups


def _heads(config: Mapping) -> tuple[int, int, int]:
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    return heads, kv, head_dim


def _expected(kind: str, full: list[tuple[torch.Tensor, torch.Tensor]], rank: int, tp: int, heads_info):
    """This rank's (codes [n, k], scale [n, k/128]) from full per-part (codes, scale), by format arithmetic."""
    if kind == "row":
        codes, scale = full[0]
        k = codes.shape[1] // tp
        return codes[:, rank * k : (rank + 1) * k], scale[:, rank * k // BLOCK_SIZE : (rank + 1) * k // BLOCK_SIZE]
    rows = []
    for i, (codes, scale) in enumerate(full):
        n = codes.shape[0]
        if kind == "qkv" and i > 0:
            heads, kv, head_dim = heads_info
            per_rank = max(1, kv // tp) * head_dim
            index = rank // (tp // kv) if tp >= kv else rank
        else:
            per_rank, index = n // tp, rank
        rows.append((codes[index * per_rank : (index + 1) * per_rank], scale[index * per_rank : (index + 1) * per_rank]))
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def _build(kind: str, fused_prefix: str, full, config_heads, quant_config):
    from vllm.model_executor.layers import linear as L

    k = full[0][0].shape[1]
    if kind == "qkv":
        heads, kv, head_dim = config_heads
        return L.QKVParallelLinear(k, head_dim, heads, kv, bias=False, quant_config=quant_config, prefix=fused_prefix)
    if kind == "merged":
        sizes = [c.shape[0] for c, _ in full]
        return L.MergedColumnParallelLinear(k, sizes, bias=False, quant_config=quant_config, prefix=fused_prefix)
    cls = L.RowParallelLinear if kind == "row" else L.ColumnParallelLinear
    return cls(k, full[0][0].shape[0], bias=False, quant_config=quant_config, prefix=fused_prefix)


def supported_tp_sizes(layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]], config: Mapping,
                       max_tp: int = 8) -> list[int]:  # fmt: skip
    """The tensor-parallel sizes up to ``max_tp`` at which every ternary layer splits on whole blocks and heads.

    Row-parallel layers need K/tp to be a multiple of 128; column, merged and fused QKV layers
    need each part's N divisible by tp; QKV also needs the heads to split (vLLM replicates
    key/value heads when tp exceeds them). The arithmetic only: :func:`check_tp_shards` loads
    the shards through vLLM to prove it.
    """
    groups = plan_groups(layers)
    heads_info = _heads(config) if any(kind == "qkv" for kind, _, _ in groups) else None
    out = []
    for tp in range(1, max_tp + 1):
        ok = True
        for kind, _, parts in groups:
            packed = [layers[p][0] for p, _ in parts]
            if kind == "row":
                ok &= (packed[0].shape[1] * 4) % (tp * BLOCK_SIZE) == 0
            elif kind == "qkv":
                heads, kv, _ = heads_info
                ok &= heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            else:
                ok &= all(pk.shape[0] % tp == 0 for pk in packed)
        if ok:
            out.append(tp)
    return out


def check_tp_shards(
    layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]], config: Mapping, tp: int
) -> list[str]:
    """Loads every rank's shard through vLLM and compares it exactly; returns one line per fused layer.

    ``layers`` is ``ternop.checkpoint.load_ternary_layers(dir)``; ``config`` the parsed config.json.
    Raises ShardMismatch (or ValueError from vLLM's own checks, e.g. K/tp not a multiple of 128).
    """
    from ternop.vllm_plugin.config import TernaryConfig

    quant_config = TernaryConfig()
    heads_info = None
    done = []
    for kind, fused, parts in plan_groups(layers):
        full_packed = [layers[p] for p, _ in parts]
        full = [(unpack_codes(pk), sc) for pk, sc in full_packed]
        if kind == "qkv":
            heads_info = heads_info or _heads(config)
            heads, kv, head_dim = heads_info
            if heads % tp or (kv % tp and tp % kv):
                raise ValueError(f"{fused}: {heads} query / {kv} key-value heads cannot be split {tp} ways")
        for rank in range(tp):
            with simulated_rank(rank, tp):
                layer = _build(kind, fused, full, heads_info, quant_config)
                for (part, shard_id), (packed, scale) in zip(parts, full_packed):
                    for name, tensor in (("weight_packed", packed), ("weight_scale", scale)):
                        param = getattr(layer, name)
                        if shard_id is None:
                            param.weight_loader(param, tensor)
                        else:
                            param.weight_loader(param, tensor, shard_id)
            want_codes, want_scale = _expected(kind, full, rank, tp, heads_info)
            got_codes = unpack_codes(layer.weight_packed.data)
            if not torch.equal(got_codes, want_codes):
                raise ShardMismatch(f"{fused} ({kind}) rank {rank}/{tp}: weight_packed shard != slice of the full matrix")
            if not torch.equal(layer.weight_scale.data, want_scale):
                raise ShardMismatch(f"{fused} ({kind}) rank {rank}/{tp}: weight_scale shard != slice of the full scales")
        done.append(f"{fused} ({kind}, {len(parts)} part{'s' if len(parts) > 1 else ''})")
    return done


def check_tp_shards_dir(path, tp: int) -> list[str]:
    """check_tp_shards on a checkpoint folder."""
    from ternop.checkpoint import load_ternary_layers

    config = json.loads((Path(path) / "config.json").read_text())
    return check_tp_shards(load_ternary_layers(path), config, tp)
