"""ternop.quant.convert: an HF folder -> a v1 checkpoint, its methods, its errors and atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ternop import checkpoint as ckpt
from ternop.quant import convert
from ternop.quantize import quantize_weight
from tests.models import tiny_bert, tiny_qwen3


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("bert") / "src")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "src")


def test_quantize_checkpoint_bert_layout(bert_dir, tmp_path):
    dst = tmp_path / "q"
    report = convert.quantize_checkpoint(bert_dir, dst, progress=False)
    src = load_file(str(bert_dir / "model.safetensors"))
    out = load_file(str(dst / "model.safetensors"))
    linear = sorted(k[: -len(".weight")] for k, v in src.items() if k.startswith("encoder.") and v.dim() == 2)
    assert sorted(report.quantized) == linear and len(linear) == 12
    for prefix in linear:
        assert prefix + ".weight" not in out
        packed, scale = quantize_weight(src[prefix + ".weight"], "optimal")
        assert torch.equal(out[prefix + ".weight_packed"], packed)
        assert torch.equal(out[prefix + ".weight_scale"], scale)
        assert torch.equal(out[prefix + ".bias"], src[prefix + ".bias"])
    for name, t in src.items():
        if not name.endswith(".weight") or name[: -len(".weight")] not in linear:
            assert torch.equal(out[name], t), name
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "ternary" and qc["format_version"] == 1 and qc["block_size"] == 128
    # It lists the linear layers left dense (none here): not embeddings, norms or other tensors.
    assert qc["modules_to_not_convert"] == [] and report.skipped == {}
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (bert_dir / name).read_bytes()
    assert ckpt.read_quant_config(dst) == qc


def test_quantize_checkpoint_activation_bits_8_writes_the_mode_and_the_same_weights(bert_dir, tmp_path):
    convert.quantize_checkpoint(bert_dir, tmp_path / "a16", progress=False)
    report = convert.quantize_checkpoint(bert_dir, tmp_path / "a8", progress=False, activation_bits=8)
    assert report.activation_bits == 8
    assert ckpt.read_quant_config(tmp_path / "a16")["activation_bits"] == 16  # written explicitly, the default
    assert ckpt.read_quant_config(tmp_path / "a8")["activation_bits"] == 8
    assert (tmp_path / "a8" / "model.safetensors").read_bytes() == (tmp_path / "a16" / "model.safetensors").read_bytes()


def test_quantize_checkpoint_refuses_unknown_activation_bits_before_reading(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="activation_bits 4 is not supported.*16.*8"):
        convert.quantize_checkpoint(tmp_path / "does-not-exist", tmp_path / "dst", progress=False, activation_bits=4)
    assert not (tmp_path / "dst").exists()


def test_quantize_cli_activations_int8(bert_dir, tmp_path, capsys):
    from ternop.cli import main

    assert main(["quantize", str(bert_dir), str(tmp_path / "a8"), "--activations", "int8", "--quiet"]) == 0
    assert "activation_bits 8: int8 activations per token" in capsys.readouterr().out
    assert ckpt.read_quant_config(tmp_path / "a8")["activation_bits"] == 8
    with pytest.raises(SystemExit):
        main(["quantize", str(bert_dir), str(tmp_path / "x"), "--activations", "int4", "--quiet"])
    assert "--activations: invalid choice: 'int4'" in capsys.readouterr().err


def test_quantize_checkpoint_skip_and_absmean(qwen3_dir, tmp_path):
    dst = tmp_path / "q"
    report = convert.quantize_checkpoint(qwen3_dir, dst, method="absmean", skip=["mlp"], progress=False)
    assert report.quantized and all("mlp" not in p for p in report.quantized)
    layers = ckpt.load_ternary_layers(dst)
    assert set(layers) == set(report.quantized)
    src = load_file(str(qwen3_dir / "model.safetensors"))
    packed, scale = quantize_weight(src["layers.1.self_attn.k_proj.weight"], "absmean")
    assert torch.equal(layers["layers.1.self_attn.k_proj"][0], packed)
    qc = ckpt.read_quant_config(dst)
    mlp = sorted(f"layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj"))
    assert qc["modules_to_not_convert"] == mlp == sorted(report.skipped)


def test_quantize_errors_missing_folder_and_no_safetensors(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        convert.quantize_checkpoint(tmp_path / "nope", tmp_path / "dst", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match=r"no \*\.safetensors"):
        convert.quantize_checkpoint(empty, tmp_path / "dst", progress=False)


def test_quantize_error_k_not_multiple_of_128_names_tensor_and_skip(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "toy"}))
    save_file({"layers.0.fc.weight": torch.randn(128, 100), "layers.0.out.weight": torch.randn(64, 128)},
              str(src / "model.safetensors"))  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match=r"layers\.0\.fc\.weight has K=100.*--skip layers\.0\.fc"):
        convert.quantize_checkpoint(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()
    report = convert.quantize_checkpoint(src, tmp_path / "dst", skip=["layers.0.fc"], progress=False)
    assert report.quantized == ["layers.0.out"]


def test_quantize_error_already_quantized(bert_dir, tmp_path):
    q = tmp_path / "q"
    convert.quantize_checkpoint(bert_dir, q, method="absmean", progress=False)
    with pytest.raises(ckpt.CheckpointError, match="already quantized.*quantization_config"):
        convert.quantize_checkpoint(q, tmp_path / "qq", progress=False)
    config = json.loads((q / "config.json").read_text())
    del config["quantization_config"]
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(ckpt.CheckpointError, match="already quantized.*weight_packed"):
        convert.quantize_checkpoint(q, tmp_path / "qq", progress=False)


def test_quantize_is_atomic_when_a_layer_fails(bert_dir, tmp_path):
    calls = []

    def failing(name, weight):
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return quantize_weight(weight, "absmean")

    dst = tmp_path / "out" / "model"
    with pytest.raises(RuntimeError, match="disk full"):
        convert.quantize_checkpoint(bert_dir, dst, quantizer=failing, progress=False)
    assert len(calls) == 5
    assert not dst.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no temporary folder left behind


def test_quantize_refuses_nonempty_destination_unless_forced(bert_dir, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="exists and is not empty"):
        convert.quantize_checkpoint(bert_dir, dst, progress=False)
    assert (dst / "keep.txt").exists()
    convert.quantize_checkpoint(bert_dir, dst, method="absmean", progress=False, overwrite=True)
    assert not (dst / "keep.txt").exists() and ckpt.read_quant_config(dst) is not None


def test_method_registry_is_extensible(bert_dir, tmp_path, monkeypatch):
    seen = []

    def factory(src, calib, skip, calib_tokens, progress):
        seen.append((Path(src), calib, skip, calib_tokens, progress))
        return lambda name, w: quantize_weight(w, "absmean")

    monkeypatch.setitem(convert.METHODS, "custom", factory)
    report = convert.quantize_checkpoint(bert_dir, tmp_path / "q", method="custom", calib="c.txt", skip=["layer.1."],
                                      calib_tokens=100, progress=False)  # fmt: skip
    assert seen == [(bert_dir, "c.txt", ("layer.1.",), 100, False)]
    assert report.method == "custom" and len(report.quantized) == 6
