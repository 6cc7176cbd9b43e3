"""ternop.checkpoint: quantize / write / read v1 checkpoints, the quantize CLI, its errors and atomicity."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ternop import checkpoint as ckpt
from ternop.format import dequantize
from ternop.quantize import quantize_weight
from tests.models import tiny_bert, tiny_qwen3


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("bert") / "src")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "src")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    ckpt.add_arguments(parser)
    return ckpt.main(parser.parse_args(argv))


def test_quantize_checkpoint_bert_layout(bert_dir, tmp_path):
    dst = tmp_path / "q"
    report = ckpt.quantize_checkpoint(bert_dir, dst, progress=False)
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
    assert "embeddings.word_embeddings" in qc["modules_to_not_convert"]
    assert "encoder.layer.0.attention.output.LayerNorm" in qc["modules_to_not_convert"]
    assert not set(qc["modules_to_not_convert"]) & set(linear)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (bert_dir / name).read_bytes()
    assert ckpt.read_quant_config(dst) == qc


def test_quantize_checkpoint_skip_and_absmean(qwen3_dir, tmp_path):
    dst = tmp_path / "q"
    report = ckpt.quantize_checkpoint(qwen3_dir, dst, method="absmean", skip=["mlp"], progress=False)
    assert report.quantized and all("mlp" not in p for p in report.quantized)
    layers = ckpt.load_ternary_layers(dst)
    assert set(layers) == set(report.quantized)
    src = load_file(str(qwen3_dir / "model.safetensors"))
    packed, scale = quantize_weight(src["layers.1.self_attn.k_proj.weight"], "absmean")
    assert torch.equal(layers["layers.1.self_attn.k_proj"][0], packed)
    qc = ckpt.read_quant_config(dst)
    assert "layers.0.mlp.down_proj" in qc["modules_to_not_convert"]


def test_dequantized_state_dict_rebuilds_dense_weights(bert_dir, tmp_path):
    dst = tmp_path / "q"
    ckpt.quantize_checkpoint(bert_dir, dst, method="absmean", progress=False)
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


def test_quantize_errors_missing_folder_and_no_safetensors(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.quantize_checkpoint(tmp_path / "nope", tmp_path / "dst", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match=r"no \*\.safetensors"):
        ckpt.quantize_checkpoint(empty, tmp_path / "dst", progress=False)


def test_quantize_error_k_not_multiple_of_128_names_tensor_and_skip(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "toy"}))
    save_file({"layers.0.fc.weight": torch.randn(128, 100), "layers.0.out.weight": torch.randn(64, 128)},
              str(src / "model.safetensors"))  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match=r"layers\.0\.fc\.weight has K=100.*--skip layers\.0\.fc"):
        ckpt.quantize_checkpoint(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()
    report = ckpt.quantize_checkpoint(src, tmp_path / "dst", skip=["layers.0.fc"], progress=False)
    assert report.quantized == ["layers.0.out"]


def test_quantize_error_already_quantized(bert_dir, tmp_path):
    q = tmp_path / "q"
    ckpt.quantize_checkpoint(bert_dir, q, method="absmean", progress=False)
    with pytest.raises(ckpt.CheckpointError, match="already quantized.*quantization_config"):
        ckpt.quantize_checkpoint(q, tmp_path / "qq", progress=False)
    config = json.loads((q / "config.json").read_text())
    del config["quantization_config"]
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(ckpt.CheckpointError, match="already quantized.*weight_packed"):
        ckpt.quantize_checkpoint(q, tmp_path / "qq", progress=False)


def test_quantize_is_atomic_when_a_layer_fails(bert_dir, tmp_path):
    calls = []

    def failing(name, weight):
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return quantize_weight(weight, "absmean")

    dst = tmp_path / "out" / "model"
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.quantize_checkpoint(bert_dir, dst, quantizer=failing, progress=False)
    assert len(calls) == 5
    assert not dst.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no temporary folder left behind


def test_quantize_refuses_nonempty_destination_unless_forced(bert_dir, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="exists and is not empty"):
        ckpt.quantize_checkpoint(bert_dir, dst, progress=False)
    assert (dst / "keep.txt").exists()
    ckpt.quantize_checkpoint(bert_dir, dst, method="absmean", progress=False, overwrite=True)
    assert not (dst / "keep.txt").exists() and ckpt.read_quant_config(dst) is not None


def test_quantize_cli(bert_dir, tmp_path, capsys):
    assert _cli([str(bert_dir), str(tmp_path / "q"), "--method", "absmean", "--skip", "attention", "--quiet"]) == 0
    assert "quantized 4 linear layers" in capsys.readouterr().out
    assert _cli([str(tmp_path / "missing"), str(tmp_path / "x"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _cli([str(bert_dir), str(tmp_path / "c"), "--method", "calibrated", "--quiet"]) == 2
    assert "--calib" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli([str(bert_dir), str(tmp_path / "y"), "--method", "nonsense"])


def test_method_registry_is_extensible(bert_dir, tmp_path, monkeypatch):
    seen = []

    def factory(src, calib, skip):
        seen.append((Path(src), calib, skip))
        return lambda name, w: quantize_weight(w, "absmean")

    monkeypatch.setitem(ckpt.METHODS, "custom", factory)
    report = ckpt.quantize_checkpoint(bert_dir, tmp_path / "q", method="custom", calib="c.txt", skip=["layer.1."],
                                      progress=False)  # fmt: skip
    assert seen == [(bert_dir, "c.txt", ("layer.1.",))] and report.method == "custom" and len(report.quantized) == 6


def test_load_ternary_layers_reports_unpaired_tensor(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"layers.0.fc.weight_packed": torch.zeros(4, 32, dtype=torch.uint8)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ckpt.CheckpointError, match=r"layers\.0\.fc.*no layers\.0\.fc\.weight_scale"):
        ckpt.load_ternary_layers(tmp_path)


def test_read_quant_config_defaults_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "ternary"}}))
    assert ckpt.read_quant_config(tmp_path) == {
        "quant_method": "ternary", "format_version": 1, "block_size": 128, "modules_to_not_convert": [],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "ternary",
                                                                              "block_size": 64}}))  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match="block_size 64"):
        ckpt.read_quant_config(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert ckpt.read_quant_config(tmp_path) is None
