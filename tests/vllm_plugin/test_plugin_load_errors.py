"""Corrupted checkpoints fail at vLLM load time with a message that names the layer; a checkpoint from an
independent writer (written here from the format text, without ternop's packer) loads and matches."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ternop.quant.convert import quantize_checkpoint
from tests.models import tiny_qwen3
from tests.vllm_plugin._llm import assert_close_embeddings, vllm_embed

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYER = "layers.1.mlp.down_proj"  # K = 512: 128 packed bytes and 4 scale blocks per row


@pytest.fixture(scope="module")
def fp_qwen3(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "fp")


@pytest.fixture(scope="module")
def ternary_qwen3(fp_qwen3, tmp_path_factory):
    dst = tmp_path_factory.mktemp("qwen3t") / "ternary"
    quantize_checkpoint(fp_qwen3, dst, progress=False)
    return dst


def _corrupt(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _reserved_code(t):
    t[LAYER + ".weight_packed"][3, 7] = 0b11_00_01_10


def _wrong_shape(t):
    t[LAYER + ".weight_scale"] = t[LAYER + ".weight_scale"][:, :3].contiguous()


def _nan_scale(t):
    t[LAYER + ".weight_scale"][5, 1] = float("nan")


@pytest.mark.parametrize(
    "edit, message",
    [
        pytest.param(_reserved_code, "reserved code", id="reserved-code"),
        pytest.param(_wrong_shape, r"weight_scale.*\[N, K/128\].*\[256, 3\]", id="wrong-shape"),
        pytest.param(_nan_scale, "non-finite", id="nan-scale"),
    ],
)
def test_corrupt_checkpoint_fails_at_load_naming_the_layer(ternary_qwen3, tmp_path, edit, message):
    bad = _corrupt(ternary_qwen3, tmp_path / "bad", edit)
    with pytest.raises(Exception) as info:
        vllm_embed(bad, eager=True)
    text = "".join(str(e) for e in _chain(info.value))
    assert LAYER in text, text
    assert re.search(message, text), text


def _chain(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


# --- an independent writer, from docs/FORMAT.md: codes 00=0, 01=+1, 10=-1; 4 codes per byte, first in the
# low bits; fp16 scale per 128 weights along K. Nothing from ternop is used to build these bytes. ---


def _independent_ternary(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (packed uint8 [N, K/4], scale fp16 [N, K/128], the dense fp32 weight they encode)."""
    n, k = w.shape
    blocks = w.reshape(n, k // 128, 128)
    threshold = 0.7 * blocks.abs().mean(-1, keepdim=True)
    values = torch.where(blocks > threshold, 1, torch.where(blocks < -threshold, -1, 0))
    kept = values.abs().sum(-1).clamp(min=1)
    scale = ((blocks.abs() * values.abs()).sum(-1) / kept).to(torch.float16)
    values = values.reshape(n, k)
    packed = bytearray(n * k // 4)
    code_of = {0: 0, 1: 1, -1: 2}
    flat = values.tolist()
    for row in range(n):
        for j in range(k // 4):
            byte = 0
            for i in range(4):
                byte |= code_of[flat[row][4 * j + i]] << (2 * i)
            packed[row * (k // 4) + j] = byte
    packed_t = torch.frombuffer(packed, dtype=torch.uint8).reshape(n, k // 4).clone()
    dense = values.to(torch.float32) * scale.to(torch.float32).repeat_interleave(128, dim=1)
    return packed_t, scale, dense


def test_independent_writer_checkpoint_loads_and_matches(fp_qwen3, tmp_path):
    from tests.models import PROMPTS, hf_embed

    dst = tmp_path / "interop"
    shutil.copytree(fp_qwen3, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    dense_weights, out = {}, {}
    for name, t in tensors.items():
        if name.startswith("layers.") and name.endswith("_proj.weight"):
            packed, scale, dense = _independent_ternary(t)
            prefix = name[: -len(".weight")]
            out[prefix + ".weight_packed"], out[prefix + ".weight_scale"] = packed, scale
            dense_weights[name] = dense
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "ternary", "format_version": 1, "block_size": 128,
                                     "modules_to_not_convert": ["embed_tokens"]}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))

    from transformers import AutoModel

    reference = AutoModel.from_pretrained(str(fp_qwen3), dtype=torch.float32).eval()
    reference.load_state_dict(dense_weights, strict=False)
    want = hf_embed(reference, fp_qwen3, PROMPTS, "last")
    got, methods = vllm_embed(dst, eager=True)
    assert methods[0].get("TernaryLinearMethod") == 8
    assert_close_embeddings(got, want)
