"""ternop.checkpoint: write and read v1 checkpoint folders, atomically, with the folder's errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ternop import checkpoint as ckpt
from ternop.format import dequantize
from ternop.quant.convert import quantize_checkpoint
from ternop.quantize import quantize_weight
from tests.models import tiny_bert


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("bert") / "src")


def test_dequantized_state_dict_rebuilds_dense_weights(bert_dir, tmp_path):
    dst = tmp_path / "q"
    quantize_checkpoint(bert_dir, dst, method="absmean", progress=False)
    state = ckpt.dequantized_state_dict(dst)
    packed = load_file(str(dst / "model.safetensors"))
    prefix = "encoder.layer.1.intermediate.dense"
    w = state[prefix + ".weight"]
    assert w.dtype == torch.float32 and w.shape == (512, 256)
    assert torch.equal(w, dequantize(packed[prefix + ".weight_packed"], packed[prefix + ".weight_scale"]))
    assert not any(k.endswith(".weight_packed") or k.endswith(".weight_scale") for k in state)


def test_write_checkpoint_with_overrides_and_sharded_index(bert_dir, tmp_path):
    from transformers import BertModel

    sharded = tmp_path / "sharded"
    BertModel.from_pretrained(str(bert_dir)).save_pretrained(str(sharded), max_shard_size="300KB")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((bert_dir / name).read_bytes())
    assert len(list(sharded.glob("*.safetensors"))) > 1
    src = {}
    for f in sharded.glob("*.safetensors"):
        src.update(load_file(str(f)))
    prefix = "encoder.layer.0.output.dense"
    pair = quantize_weight(src[prefix + ".weight"], "absmean")
    new_bias = torch.arange(256, dtype=torch.float32)
    dst = tmp_path / "out"
    ckpt.write_checkpoint(sharded, dst, {prefix: pair}, modules_to_not_convert=["pooler.dense"],
                          overrides={prefix + ".bias": new_bias}, progress=False)  # fmt: skip
    layers = ckpt.load_ternary_layers(dst)
    assert list(layers) == [prefix]
    assert torch.equal(layers[prefix][0], pair[0]) and torch.equal(layers[prefix][1], pair[1])
    state = ckpt.dequantized_state_dict(dst)
    assert torch.equal(state[prefix + ".bias"], new_bias)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert prefix + ".weight" not in index
    for suffix in (".weight_packed", ".weight_scale"):
        with safe_open(str(dst / index[prefix + suffix]), "pt") as f:
            assert prefix + suffix in f.keys()
    assert ckpt.read_quant_config(dst)["modules_to_not_convert"] == ["pooler.dense"]


def test_write_checkpoint_rejects_wrong_layer_shape(bert_dir, tmp_path):
    bad = quantize_weight(torch.randn(256, 512), "optimal")  # the layer is [256, 256]
    with pytest.raises(ckpt.CheckpointError, match=r"encoder\.layer\.0\.attention\.output\.dense.*\[256, 512\]"):
        ckpt.write_checkpoint(bert_dir, tmp_path / "o", {"encoder.layer.0.attention.output.dense": bad},
                              modules_to_not_convert=[], progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()
    with pytest.raises(ckpt.CheckpointError, match=r"no <prefix>\.weight.*encoder\.layer\.9\.output\.dense"):
        ckpt.write_checkpoint(bert_dir, tmp_path / "o", {"encoder.layer.9.output.dense": bad},
                              modules_to_not_convert=[], progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_load_ternary_layers_reports_unpaired_tensor(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"layers.0.fc.weight_packed": torch.zeros(4, 32, dtype=torch.uint8)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ckpt.CheckpointError, match=r"layers\.0\.fc.*no layers\.0\.fc\.weight_scale"):
        ckpt.load_ternary_layers(tmp_path)


def test_read_quant_config_defaults_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "ternary"}}))
    assert ckpt.read_quant_config(tmp_path) == {
        "quant_method": "ternary", "format_version": 1, "block_size": 128, "modules_to_not_convert": [],
        "activation_bits": 16,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "ternary",
                                                                              "block_size": 64}}))  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match="block_size 64"):
        ckpt.read_quant_config(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert ckpt.read_quant_config(tmp_path) is None


@pytest.mark.parametrize("bits, ok", [(16, True), (8, True), (4, False), (32, False), ("8", False), (None, False),
                                      (True, False), (8.0, False)])  # fmt: skip
def test_read_quant_config_activation_bits(tmp_path, bits, ok):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "ternary",
                                                                              "activation_bits": bits}}))  # fmt: skip
    if ok:
        assert ckpt.read_quant_config(tmp_path)["activation_bits"] == bits
    else:
        with pytest.raises(ckpt.CheckpointError, match=r"quantization_config: activation_bits .* must be 16 .* or 8"):
            ckpt.read_quant_config(tmp_path)


def test_write_checkpoint_records_activation_bits_and_refuses_unknown_ones_before_writing(bert_dir, tmp_path):
    layers = {"encoder.layer.0.output.dense": quantize_weight(load_file(str(bert_dir / "model.safetensors"))[
        "encoder.layer.0.output.dense.weight"])}  # fmt: skip
    ckpt.write_checkpoint(bert_dir, tmp_path / "a8", layers, modules_to_not_convert=[], progress=False,
                          activation_bits=8)  # fmt: skip
    assert json.loads((tmp_path / "a8" / "config.json").read_text())["quantization_config"]["activation_bits"] == 8
    with pytest.raises(ckpt.CheckpointError, match="activation_bits 12 is not supported"):
        ckpt.write_checkpoint(bert_dir, tmp_path / "bad", layers, modules_to_not_convert=[], progress=False,
                              activation_bits=12)  # fmt: skip
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.partial-*"))


def test_codes_and_scales_may_sit_in_different_files_and_scales_may_be_zero_or_negative(bert_dir, tmp_path):
    """What docs/FORMAT.md allows, readers accept: split files, a zero block, a negative scale."""
    from ternop.cli import validate

    dst = tmp_path / "q"
    quantize_checkpoint(bert_dir, dst, method="absmean", progress=False)
    tensors = load_file(str(dst / "model.safetensors"))
    prefix = "encoder.layer.1.output.dense"
    packed, scale = tensors[prefix + ".weight_packed"], tensors[prefix + ".weight_scale"].clone()
    want = dequantize(packed, scale)
    # Negative scale with the codes swapped (01 <-> 10) is the same weight; a zero scale zeroes its block.
    swapped = ((packed & 0x55) << 1) | ((packed >> 1) & 0x55)
    tensors[prefix + ".weight_packed"] = torch.cat([swapped[:1], packed[1:]])
    scale[0] = -scale[0]
    scale[1, 0] = 0.0
    tensors[prefix + ".weight_scale"] = scale
    want[1, :128] = 0.0
    codes = {k: v for k, v in tensors.items() if k.endswith(".weight_packed")}
    rest = {k: v for k, v in tensors.items() if k not in codes}
    (dst / "model.safetensors").unlink()
    save_file(codes, str(dst / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(rest, str(dst / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    layers = ckpt.load_ternary_layers(dst)
    assert torch.equal(dequantize(*layers[prefix]), want)
    assert validate.check_cpu_unpack(dst).startswith("12 layers")


def test_written_folders_get_mkdir_permissions_and_no_partial_folder_survives_an_interrupt(bert_dir, tmp_path):
    old = os.umask(0o027)
    try:
        with pytest.raises(KeyboardInterrupt):
            with ckpt.atomic_folder(tmp_path / "out") as tmp:
                (tmp / "half.bin").write_bytes(b"x")
                raise KeyboardInterrupt
        assert list(tmp_path.iterdir()) == []
        with ckpt.atomic_folder(tmp_path / "out") as tmp:
            (tmp / "whole.bin").write_bytes(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750 and [p.name for p in tmp_path.iterdir()] == ["out"]
