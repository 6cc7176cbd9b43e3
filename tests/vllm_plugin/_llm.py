"""Helpers for the vLLM tests: build ternary checkpoints, run vLLM embed, compare with the HF reference."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ternop.vllm_plugin import linear_methods
from tests.models import PROMPTS, hf_embed

COSINE_MIN = 0.99999  # fp32, per prompt
GPU_MEMORY_UTILIZATION = 0.08
"""On a GPU, the share of its memory each test engine asks for (11 GiB of an H200; the test models are tiny).
On an H200 the engines that earlier tests had closed still held their shares when the next one started: with
vLLM's default (0.92) the second engine found 10.8 of 139.8 GiB free, and with 0.3 the fourth found 13.69 GiB,
just what three shares leave (results/h200/vllm_bitnet_greedy_gpu_0c89297.log)."""


def engine_args(**kwargs) -> dict:
    """``kwargs`` for ``vllm.LLM``, with this module's GPU memory share on a CUDA machine (none on the CPU)."""
    if torch.cuda.is_available():
        kwargs.setdefault("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
    return kwargs


def vllm_embed(path: str | Path, *, eager: bool, prompts=PROMPTS, **kwargs) -> tuple[torch.Tensor, list[dict]]:
    """vLLM ``embed`` in fp32 -> (L2-normalized [len(prompts), hidden], per-worker count of layer methods)."""
    from vllm import LLM

    llm = LLM(model=str(path), runner="pooling", dtype="float32", max_model_len=128, enforce_eager=eager,
              seed=0, **engine_args(**kwargs))  # fmt: skip
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
