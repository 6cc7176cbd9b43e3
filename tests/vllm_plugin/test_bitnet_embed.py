"""The BitNet-style embedding model (Qwen3 with an RMSNorm before every projection, W1.58A8) in vLLM: converted from
transformers' BitNet form, served through vLLM's embed with last-token pooling, equal to transformers' own model."""

from __future__ import annotations

import json

import pytest
import torch

from ternop.checkpoint import read_quant_config
from ternop.quant.bitnet_import import PROJECTION_NORM_KEY
from ternop.quant.importer import convert_checkpoint
from tests.models import PROMPTS, hf_embed
from tests.ternary_sources import tiny_bitnet_qwen3
from tests.vllm_plugin._llm import a8_cosine_min, assert_close_embeddings, vllm_embed

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    root = tmp_path_factory.mktemp("bitnet-qwen3")
    src = tiny_bitnet_qwen3(root / "src")
    convert_checkpoint(src, root / "ternary", progress=False)
    return src, root / "ternary"


def test_bitnet_qwen3_converts_with_its_projection_norms(embedder):
    from ternop.vllm_plugin.bitnet_qwen3 import PROJECTION_NORM_KEY as SERVED_KEY

    _, ternary = embedder
    config = json.loads((ternary / "config.json").read_text())
    assert config["architectures"] == ["BitNetQwen3Model"] and config[PROJECTION_NORM_KEY] == 1e-6
    assert SERVED_KEY == PROJECTION_NORM_KEY and read_quant_config(ternary)["activation_bits"] == 8


@pytest.mark.parametrize("eager", [pytest.param(True, id="eager"), pytest.param(False, id="compiled")])
def test_bitnet_qwen3_embeddings_match_transformers(embedder, eager):
    from transformers import AutoModel

    src, ternary = embedder
    got, methods = vllm_embed(ternary, eager=eager)
    assert methods[0].get("TernaryLinearMethod") == 14  # 2 layers x 7 separate projections
    assert methods[0].get("rms_norm_quant") == 14  # each projection's norm hands it int8 rows
    model = AutoModel.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.compiler.set_stance("force_eager"):
        want = hf_embed(model, ternary, PROMPTS, "last")
        cosine_min = a8_cosine_min(model, ternary, "last", want)
    assert_close_embeddings(got, want, cosine_min)
