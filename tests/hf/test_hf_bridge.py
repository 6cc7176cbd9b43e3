"""The HF front door: transformers and sentence-transformers load v1 checkpoints with TernaryLinear layers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ternop.hf
from ternop import TernaryLinear
from ternop.checkpoint import load_ternary_layers, read_quant_config, ternary_prefixes
from ternop.quant.convert import quantize_checkpoint
from tests.models import PROMPTS, minilm_dir, tiny_bert


@pytest.fixture(scope="module")
def ternary_minilm(tmp_path_factory):
    dst = tmp_path_factory.mktemp("minilm") / "ternary"
    quantize_checkpoint(minilm_dir(), dst, progress=False)
    return dst


def _ternary_layers(model: nn.Module) -> dict[str, TernaryLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TernaryLinear)}


def test_hf_automodel_loads_ternary_layers_with_the_checkpoint_bytes(ternary_minilm):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(ternary_minilm))
    layers = _ternary_layers(model)
    on_disk = load_ternary_layers(ternary_minilm)
    assert sorted(layers) == sorted(on_disk) and len(layers) == 36
    for name, (packed, scale) in on_disk.items():
        assert torch.equal(layers[name].weight_packed, packed) and torch.equal(layers[name].weight_scale, scale)
    assert type(model.pooler.dense) is nn.Linear  # left dense by the checkpoint
    bias = load_file(str(ternary_minilm / "model.safetensors"))["encoder.layer.0.output.dense.bias"]
    assert torch.equal(model.encoder.layer[0].output.dense.bias, bias)


def test_hf_bf16_load_keeps_scales_in_float16(ternary_minilm):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(ternary_minilm), dtype=torch.bfloat16)
    layer = model.encoder.layer[3].intermediate.dense
    assert layer.weight_scale.dtype == torch.float16 and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight_scale, load_ternary_layers(ternary_minilm)["encoder.layer.3.intermediate.dense"][1])


def test_hf_ternary_model_matches_the_dequantized_reference(ternary_minilm):
    texts = PROMPTS
    got = ternop.hf.embed_texts(ternary_minilm, texts)
    want = ternop.hf.embed_texts(ternary_minilm, texts, dense=True)
    dense = ternop.hf.load_model(ternary_minilm, dense=True)
    assert not _ternary_layers(dense) and dense.config.to_dict().get("quantization_config") is None
    assert float((got * want).sum(-1).min()) > 0.99999


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])  # fmt: skip
def test_hf_ternary_model_runs_on_each_device(ternary_minilm, device):
    model = ternop.hf.load_model(ternary_minilm).to(device)
    tok = ternop.hf.load_tokenizer(ternary_minilm)
    got = ternop.hf.embed_model(model, tok, PROMPTS)
    want = ternop.hf.embed_texts(ternary_minilm, PROMPTS, dense=True)
    assert float((got * want).sum(-1).min()) > 0.9999


def test_hf_sentence_transformer_loads_ternary_layers(ternary_minilm):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(ternary_minilm), device="cpu")
    assert len(_ternary_layers(model)) == 36
    got = model.encode(PROMPTS, convert_to_tensor=True, normalize_embeddings=True)
    want = ternop.hf.embed_texts(ternary_minilm, PROMPTS)
    assert float((got.cpu() * want).sum(-1).min()) > 0.99999


@pytest.mark.vllm
@pytest.mark.slow
def test_hf_and_sentence_transformers_match_vllm(ternary_minilm):
    """The same checkpoint three ways: vLLM's plugin, transformers' quantizer, sentence-transformers."""
    pytest.importorskip("vllm")
    st = pytest.importorskip("sentence_transformers")
    from tests.vllm_plugin._llm import assert_close_embeddings, vllm_embed

    got, methods = vllm_embed(ternary_minilm, eager=True)
    assert methods[0].get("TernaryLinearMethod") == 24
    assert_close_embeddings(got, ternop.hf.embed_texts(ternary_minilm, PROMPTS))
    sentence = st.SentenceTransformer(str(ternary_minilm), device="cpu")
    assert_close_embeddings(got, sentence.encode(PROMPTS, convert_to_tensor=True, normalize_embeddings=True).cpu())


def test_hf_maps_names_across_the_base_model_prefix(tmp_path):
    """A checkpoint saved from a task model ("bert." in front) loads into AutoModel and back."""
    src = tiny_bert(tmp_path / "fp")
    tensors = load_file(str(src / "model.safetensors"))
    save_file({f"bert.{k}": v for k, v in tensors.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    dst = tmp_path / "ternary"
    quantize_checkpoint(src, dst, method="absmean", progress=False)
    assert ternary_prefixes(dst)[0].startswith("bert.encoder.")
    model = ternop.hf.load_model(dst)
    assert sorted(_ternary_layers(model)) == sorted(p.removeprefix("bert.") for p in ternary_prefixes(dst))


def test_hf_save_pretrained_writes_a_v1_checkpoint(ternary_minilm, tmp_path):
    model = ternop.hf.load_model(ternary_minilm)
    model.save_pretrained(str(tmp_path / "again"))
    assert read_quant_config(tmp_path / "again") == read_quant_config(ternary_minilm)
    again, first = load_ternary_layers(tmp_path / "again"), load_ternary_layers(ternary_minilm)
    assert again.keys() == first.keys() and all(torch.equal(again[k][0], first[k][0]) for k in first)


def test_hf_load_leaves_each_layer_in_its_devices_layout_and_saves_v1(ternary_minilm, tmp_path, monkeypatch):
    """After loading, every TernaryLinear holds the layout preferred on its device (on the CPU v1;
    here the CPU is made to prefer a16): the same embeddings, and save_pretrained still writes the
    checkpoint's v1 bytes."""
    import ternop.hf.quantizer

    want = ternop.hf.embed_texts(ternary_minilm, PROMPTS)
    monkeypatch.setattr(ternop.hf.quantizer, "preferred_layout", lambda bits, device: "a16")
    model = ternop.hf.load_model(ternary_minilm)
    assert {m.layout for m in _ternary_layers(model).values()} == {"a16"}
    got = ternop.hf.embed_model(model, ternop.hf.load_tokenizer(ternary_minilm), PROMPTS)
    assert torch.equal(got, want)
    model.save_pretrained(str(tmp_path / "again"))
    again, first = load_ternary_layers(tmp_path / "again"), load_ternary_layers(ternary_minilm)
    assert again.keys() == first.keys() and all(torch.equal(again[k][0], first[k][0]) for k in first)
    dense = model.dequantize()  # from the a16 codes
    assert not _ternary_layers(dense)
    dense_out = ternop.hf.embed_model(dense, ternop.hf.load_tokenizer(ternary_minilm), PROMPTS)
    assert float((dense_out * want).sum(-1).min()) > 0.99999


@pytest.fixture(scope="module")
def bert_a8(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-a8")
    quantize_checkpoint(tiny_bert(root / "fp"), root / "a8", progress=False, activation_bits=8)
    return root / "a8"


def test_hf_a8_checkpoint_builds_a8_layers_and_save_pretrained_keeps_the_mode(bert_a8, tmp_path):
    model = ternop.hf.load_model(bert_a8)
    layers = _ternary_layers(model)
    assert len(layers) == 12 and all(m.activation_bits == 8 for m in layers.values())
    assert model.config.quantization_config.activation_bits == 8
    ids = torch.randint(5, 40, (2, 9))
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
        a16 = ternop.hf.load_model(bert_a8)
        for m in _ternary_layers(a16).values():
            m.activation_bits = 16
        want16 = a16(input_ids=ids).last_hidden_state
        for m in _ternary_layers(a16).values():
            m.activation_bits = 8
        want8 = a16(input_ids=ids).last_hidden_state
    assert torch.equal(got, want8) and not torch.equal(got, want16)
    model.save_pretrained(str(tmp_path / "again"))
    assert read_quant_config(tmp_path / "again")["activation_bits"] == 8
    assert read_quant_config(tmp_path / "again") == read_quant_config(bert_a8)
    assert all(m.activation_bits == 8 for m in _ternary_layers(ternop.hf.build_layout(tmp_path / "again")).values())


@pytest.mark.parametrize("bits", [4, "int8"])
def test_hf_unknown_activation_bits_is_refused_naming_the_field(bert_a8, tmp_path, bits):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(bert_a8, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["activation_bits"] = bits
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"activation_bits {bits!r} is not supported"):
        ternop.hf.load_model(bad)
    from transformers import AutoModel

    with pytest.raises(ValueError, match=f"activation_bits {bits!r} is not supported"):
        AutoModel.from_pretrained(str(bad))


def test_hf_checkpoint_for_another_architecture_names_the_layer(tmp_path):
    src = tiny_bert(tmp_path / "fp")
    dst = tmp_path / "ternary"
    quantize_checkpoint(src, dst, method="absmean", progress=False)
    tensors = load_file(str(dst / "model.safetensors"))
    for suffix in ("weight_packed", "weight_scale"):
        tensors[f"encoder.layer.0.attention.self.nothing.{suffix}"] = tensors[f"encoder.layer.0.attention.self.query.{suffix}"].clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self\.nothing.*no nn\.Linear"):
        ternop.hf.load_model(dst)


def test_hf_build_layout_reads_no_weights(ternary_minilm):
    model = ternop.hf.build_layout(ternary_minilm)
    layers = _ternary_layers(model)
    assert len(layers) == 36 and all(m.weight_packed.is_meta for m in layers.values())
    config = json.loads((ternary_minilm / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "ternary"
