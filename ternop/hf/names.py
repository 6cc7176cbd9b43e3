"""Names in a Hugging Face model against names in its checkpoint: the one mapper.

A checkpoint saved from ``BertForMaskedLM`` names a layer ``bert.encoder.layer.0...``; the
same layer in ``AutoModel`` (``BertModel``) is ``encoder.layer.0...``, and the reverse for a
checkpoint saved from the base model and loaded into a task model. The two differ at most by
the model's ``base_model_prefix`` in front.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def match_names(model: nn.Module, model_names: Iterable[str], checkpoint_names: Iterable[str]) -> dict[str, str]:
    """checkpoint name -> model name, for each checkpoint name that has a counterpart in ``model_names``.

    Names are module prefixes or tensor names alike; they match exactly, or after removing or
    adding ``model.base_model_prefix`` + ``"."`` in front of the checkpoint name.
    """
    names = set(model_names)
    base = getattr(model, "base_model_prefix", "") or ""
    out = {}
    for ckpt in checkpoint_names:
        candidates = [ckpt]
        if base:
            candidates += [ckpt[len(base) + 1 :]] if ckpt.startswith(base + ".") else [f"{base}.{ckpt}"]
        for cand in candidates:
            if cand in names:
                out[ckpt] = cand
                break
    return out


def module_to_checkpoint(model: nn.Module, module_names: Iterable[str], checkpoint_names: Iterable[str]) -> dict[str, str]:
    """model name -> checkpoint name (the inverse of :func:`match_names`), for the given model names."""
    wanted = list(module_names)
    return {m: c for c, m in match_names(model, wanted, checkpoint_names).items()}
