"""ternop convert from Hugging Face BitNet checkpoints: every layer dequantizes to exactly what transformers' BitNet
code computes with (torch.equal), everything else is copied bit for bit, and what cannot convert fails whole."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ternop.checkpoint import CheckpointError, load_ternary_layers, read_quant_config, tensor_index
from ternop.format import dequantize, validate
from ternop.quant.exact import NotExact
from ternop.quant.importer import convert_checkpoint
from tests.ternary_sources import BITNET_QUANT, tiny_bitnet

pytest.importorskip("transformers")

FORMS = list(BITNET_QUANT)


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for name, info in tensor_index(path).items():
        with safe_open(str(info.file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def transformers_weight(form: str, src: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The weight transformers' BitNet layer of ``form`` computes with, from its own code (run eagerly)."""
    from transformers.integrations.bitnet import WeightQuant, unpack_weights

    w = src[prefix + ".weight"]
    with torch.compiler.set_stance("force_eager"):
        if form == "master":
            return WeightQuant.apply(w)
        ws = src[prefix + ".weight_scale"]
        if form == "autobitlinear":
            return unpack_weights(w, dtype=ws.dtype) * ws
        # BitLinear divides its output by weight_scale; ternop does that division in float16.
        return unpack_weights(w, dtype=torch.float16) / ws.to(torch.float16)


@pytest.fixture(scope="module", params=FORMS)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = tiny_bitnet(root / "src", request.param)
    report = convert_checkpoint(src, root / "dst", progress=False)
    return request.param, src, root / "dst", report


def test_bitnet_layers_dequantize_to_transformers_weights(converted):
    form, src, dst, report = converted
    source, layers = _tensors(src), load_ternary_layers(dst)
    assert sorted(layers) == sorted(report.quantized) and len(layers) == 14  # 2 layers x 7 projections
    for prefix, (packed, scale) in layers.items():
        validate(packed, scale, prefix)
        want = transformers_weight(form, source, prefix)
        assert torch.equal(dequantize(packed, scale, want.dtype), want), prefix
        nonzero = scale[scale != 0]
        assert bool((nonzero == nonzero[0]).all()), f"{prefix}: BitNet has one scale per tensor"


def test_bitnet_other_tensors_are_copied_and_config_says_a8(converted):
    form, src, dst, report = converted
    source, out = _tensors(src), _tensors(dst)
    copied = {n for n in source if not (n.endswith("_proj.weight") or n.endswith(".weight_scale"))}
    assert copied == {n for n in out if not n.endswith((".weight_packed", ".weight_scale"))}
    for name in copied:
        assert out[name].dtype == source[name].dtype and torch.equal(out[name], source[name]), name
    qc = read_quant_config(dst)
    assert qc["activation_bits"] == 8 and qc["modules_to_not_convert"] == ["lm_head"]
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["BitNetForCausalLM"] and (dst / "tokenizer.json").is_file()
    assert report.activation_bits == 8 and list(report.skipped) == ["lm_head"]


def test_bitnet_tied_embeddings_list_no_dense_linear(tmp_path):
    src = tiny_bitnet(tmp_path / "src", "bitlinear", tie=True)
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert read_quant_config(tmp_path / "dst")["modules_to_not_convert"] == []
    assert "lm_head.weight" not in tensor_index(tmp_path / "dst")


def _rewrite(path, name, fn):
    from safetensors.torch import save_file

    tensors = _tensors(path)
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_bitnet_unused_code_fails_naming_the_tensor_and_writes_nothing(tmp_path):
    src = tiny_bitnet(tmp_path / "src", "bitlinear")
    _rewrite(src, "model.layers.1.mlp.up_proj.weight", lambda w: w | 0b11)
    with pytest.raises(NotExact, match=r"model\.layers\.1\.mlp\.up_proj\.weight: code 0b11"):
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary folder left behind


def test_bitnet_k_not_a_multiple_of_128_fails_before_writing(tmp_path):
    src = tiny_bitnet(tmp_path / "src", "master", intermediate=320)  # down_proj has K=320
    with pytest.raises(NotExact, match=r"model\.layers\.0\.mlp\.down_proj\.weight has K=320"):
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_bitnet_fp32_master_weights_cannot_convert_exactly(tmp_path):
    """BitNet ternarizes in the master dtype: fp32 masters give an fp32 scale that float16 cannot hold."""
    src = tiny_bitnet(tmp_path / "src", "master", dtype=torch.float32)
    with pytest.raises(NotExact, match=r"_proj\.weight: row 0, block 0 has scale .* float16 cannot hold exactly"):
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_convert_refuses_a_non_empty_destination_unless_forced(tmp_path):
    src = tiny_bitnet(tmp_path / "src", "bitlinear")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert (tmp_path / "dst" / "keep.txt").read_text() == "mine"
    convert_checkpoint(src, tmp_path / "dst", progress=False, overwrite=True)
    assert not (tmp_path / "dst" / "keep.txt").exists() and read_quant_config(tmp_path / "dst")


def test_convert_refuses_a_model_that_is_not_ternary(tmp_path):
    from tests.models import tiny_qwen3

    src = tiny_qwen3(tmp_path / "fp")
    with pytest.raises(CheckpointError, match="not a ternary source.*use ternop quantize"):
        convert_checkpoint(src, tmp_path / "dst", progress=False)


def test_convert_shards_large_outputs_with_an_index(tmp_path):
    src = tiny_bitnet(tmp_path / "src", "autobitlinear")
    convert_checkpoint(src, tmp_path / "one", progress=False)
    convert_checkpoint(src, tmp_path / "many", progress=False, shard_bytes=200_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    one, many = _tensors(tmp_path / "one"), _tensors(tmp_path / "many")
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
