"""Helpers for the vLLM tests: build ternary checkpoints, run vLLM embed, compare with the HF reference."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ternop.vllm_plugin import linear_methods
from tests.models import PROMPTS, hf_embed

COSINE_MIN = 0.99999  # fp32, per prompt


def vllm_embed(path: str | Path, *, eager: bool, prompts=PROMPTS, **kwargs) -> tuple[torch.Tensor, list[dict]]:
    """vLLM ``embed`` in fp32 -> (L2-normalized [len(prompts), hidden], per-worker count of layer methods)."""
    from vllm import LLM

    llm = LLM(model=str(path), runner="pooling", dtype="float32", max_model_len=128, enforce_eager=eager,
              seed=0, **kwargs)  # fmt: skip
    try:
        outs = llm.embed(list(prompts))
        methods = llm.apply_model(linear_methods)
    finally:
        del llm
        gc.collect()
    vecs = torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32)
    return torch.nn.functional.normalize(vecs, dim=-1), methods


def reference_embed(path: str | Path, pooling: str, prompts=PROMPTS) -> torch.Tensor:
    """transformers on the dequantized weights (nn.Linear layers, no ternop op), fp32."""
    from ternop.hf import load_model

    return hf_embed(load_model(path, causal=False, dense=True), path, list(prompts), pooling)


def assert_close_embeddings(got: torch.Tensor, want: torch.Tensor) -> None:
    cos = (got * want).sum(-1)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert bool((cos >= COSINE_MIN).all()), f"per-prompt cosine {cos.tolist()} below {COSINE_MIN}"
