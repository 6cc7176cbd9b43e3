"""ternop convert from GGUF (TQ1_0, TQ2_0): each tensor equals what transformers loads from the file (torch.equal),
the ternary layers equal the model the file was written from, and what cannot convert exactly fails naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ternop.checkpoint import CheckpointError, dequantized_state_dict, load_ternary_layers, read_quant_config
from ternop.format import BLOCK_SIZE, dequantize, unpack_codes
from ternop.quant.exact import NotExact, exact_pair
from ternop.quant.importer import convert_checkpoint
from tests.ternary_sources import tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("transformers")

CASES = [("llama", "TQ2_0"), ("qwen2", "TQ1_0"), ("qwen3", "TQ2_0"), ("qwen3", "TQ1_0")]


def transformers_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor transformers' GGUF loader makes of the file (dequantized by the gguf package, fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def converted(request, tmp_path_factory):
    arch, qtype = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    path, hf_dir = tiny_gguf(root, arch, qtype)
    report = convert_checkpoint(path, root / "dst", progress=False)
    return path, hf_dir, root / "dst", report


def test_gguf_converts_to_what_transformers_loads(converted):
    path, _, dst, report = converted
    want, got = transformers_tensors(path), dequantized_state_dict(dst)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].to(torch.float32), tensor), name
    layers = load_ternary_layers(dst)
    assert len(layers) == 14 and sorted(layers) == sorted(report.quantized)
    qc = read_quant_config(dst)
    assert qc["activation_bits"] == 16 and qc["modules_to_not_convert"] == ["lm_head"]


def test_gguf_ternary_layers_equal_the_model_it_was_written_from(converted):
    """Independent of transformers' GGUF code: llama's permuted Q/K rows come back in the original order."""
    from safetensors.torch import load_file

    _, hf_dir, dst, _ = converted
    original = load_file(str(hf_dir / "model.safetensors"))
    for prefix, (packed, scale) in load_ternary_layers(dst).items():
        assert torch.equal(dequantize(packed, scale), original[prefix + ".weight"]), prefix


def test_gguf_256_block_becomes_two_128_blocks_with_its_scale(tmp_path):
    """One TQ block of 256 weights and scale d -> two v1 blocks of scale |d| (codes swapped where d < 0);
    an all-zero block -> scale 0, codes 00. Checked against the gguf package's own dequantization."""
    import gguf

    def negate_odd_blocks(data):  # the fp16 d closes each 66-byte block; flip its sign bit
        blocks = data.reshape(data.shape[0], -1, 66)
        blocks[:, 1::2, -1] ^= 0x80
        return data

    path, _ = tiny_gguf(tmp_path, "qwen3", "TQ2_0", tamper={"blk.0.ffn_down.weight": negate_odd_blocks})
    convert_checkpoint(path, tmp_path / "dst", progress=False)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    d = torch.from_numpy(np.asarray(tensor.data).reshape(-1, 66)[:, -2:].copy().view(np.float16).reshape(-1))
    want = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type))
    packed, scale = load_ternary_layers(tmp_path / "dst")["model.layers.0.mlp.down_proj"]
    assert torch.equal(dequantize(packed, scale), want)
    halves, live = scale.reshape(-1, 2), scale.reshape(-1, 2).ne(0).any(dim=1)
    assert bool(((halves[live] == d.abs()[live][:, None]) | (halves[live] == 0)).all())
    assert bool((d[live] < 0).any() and (~live).any() and (scale >= 0).all())
    zero = scale.repeat_interleave(BLOCK_SIZE, dim=1) == 0
    assert bool((unpack_codes(packed)[zero] == 0).all())


def test_gguf_tokenizer_and_config_are_written(converted):
    from transformers import AutoConfig, AutoTokenizer

    path, hf_dir, dst, _ = converted
    tok, ref = AutoTokenizer.from_pretrained(str(dst)), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Ternary weights take two bits each."
    assert tok(text)["input_ids"] == ref(text)["input_ids"] and len(tok(text)["input_ids"]) > 3
    config, source = AutoConfig.from_pretrained(str(dst)), AutoConfig.from_pretrained(str(hf_dir))
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size"):  # fmt: skip
        assert getattr(config, key) == getattr(source, key), key


def test_gguf_non_ternary_linear_type_fails_naming_the_tensor(tmp_path):
    path, _ = tiny_gguf(tmp_path, "qwen2", types={"blk.1.attn_k.weight": "Q8_0"})
    with pytest.raises(NotExact, match=r"blk\.1\.attn_k\.weight \(model\.layers\.1\.self_attn\.k_proj\.weight\) is Q8_0"):
        convert_checkpoint(path, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_gguf_tq2_code_3_is_not_ternary(tmp_path):
    """TQ2_0 stores t + 1 in two bits; the unused code 3 would mean t = 2."""

    def code_3(data):
        data[5, 0] |= 0b11  # row 5, first byte of its first block
        return data

    path, _ = tiny_gguf(tmp_path, "qwen3", tamper={"blk.0.ffn_up.weight": code_3})
    with pytest.raises(NotExact, match=r"model\.layers\.0\.mlp\.up_proj\.weight: row 5, block 0 is not ternary"):
        convert_checkpoint(path, tmp_path / "dst", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("tiny")) == ["hf"]


def test_gguf_unknown_architecture_and_i2_s_are_refused(tmp_path):
    import gguf

    path = tmp_path / "bitnet.gguf"
    w = gguf.GGUFWriter(str(path), "bitnet-b1.58")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 256), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="architecture 'bitnet-b1.58' is not one transformers maps from GGUF"):
        convert_checkpoint(path, tmp_path / "dst", progress=False)
    raw = bytearray(path.read_bytes())  # retype the tensor as 36, bitnet.cpp's I2_S
    at = raw.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")
    raw[at + 4 + 16 : at + 4 + 16 + 4] = (36).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="type 36 .bitnet.cpp's I2_S., which ternop convert does not read"):
        convert_checkpoint(path, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


# --- exact_pair, the one rule every conversion goes through ---


def test_exact_pair_negative_and_zero_blocks():
    w = torch.zeros(2, 256, dtype=torch.float16)
    w[0, :128] = torch.tensor([0.5, -0.5, 0.0, 0.5] * 32, dtype=torch.float16)  # scale 0.5
    w[0, 128:] = -0.25 * torch.tensor([1.0, 0.0, -1.0, 0.0] * 32, dtype=torch.float16)  # a negative source scale
    packed, scale = exact_pair(w, "w")
    assert scale.tolist() == [[0.5, 0.25], [0.0, 0.0]]
    assert torch.equal(dequantize(packed, scale, torch.float16), w)
    assert unpack_codes(packed)[0, :4].tolist() == [0b01, 0b10, 0b00, 0b01]
    assert unpack_codes(packed)[0, 128:132].tolist() == [0b10, 0b00, 0b01, 0b00]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda w: w[:, :192], r"w: K=192 .* not a positive multiple of 128"),
        (lambda w: w.index_put_((torch.tensor([1]), torch.tensor([3])), torch.tensor(0.75)),
         r"w: row 1, block 0 is not ternary: it holds 0.5 beside the block's largest magnitude 0.75"),
        (lambda w: w * (1 + 2.0**-12), r"w: row 0, block 0 has scale .* float16 cannot hold exactly"),
        (lambda w: w.index_put_((torch.tensor([0]), torch.tensor([200])), torch.tensor(float("inf"))),
         r"w: non-finite value inf at row 0, column 200"),
    ],
    ids=["k", "values", "scale", "inf"],
)
def test_exact_pair_refuses_what_v1_cannot_hold(make, message):
    w = torch.full((2, 256), 0.5, dtype=torch.float32)
    with pytest.raises(NotExact, match=message):
        exact_pair(make(w), "w")
