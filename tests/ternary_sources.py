"""Tiny ternary source checkpoints for the conversion tests, built offline.

- :func:`tiny_bitnet`: a random ``BitNetForCausalLM`` saved in one of transformers' BitNet forms
  (packed ``bitlinear``, packed ``autobitlinear`` offline, or bf16 master weights), packed with
  transformers' own ``pack_weights``.
- :func:`tiny_gguf`: a random llama / qwen2 / qwen3 model whose linear weights are ternary per
  256-block, written as a GGUF file with the ``gguf`` package (``TQ1_0`` / ``TQ2_0``), the
  llama.cpp way (llama's Q and K rows permuted), beside the Hugging Face model it came from.
- :func:`bpe_tokenizer`: a small byte-level BPE tokenizer, for both.

Every K is a multiple of 256, and the head sizes are ones vLLM's CPU attention supports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from tests.models import PROMPTS

BITNET_QUANT = {
    "bitlinear": {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"},
    "autobitlinear": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"},
    "master": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"},
}
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def bpe_tokenizer(dst: str | os.PathLike | None = None, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on PROMPTS (transformers' fast tokenizer); saved to ``dst`` if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(PROMPTS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if dst is not None:
        fast.save_pretrained(str(dst))
    return fast


def _randomize(model, seed: int, std: float = 0.05) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
            else:  # norms: away from 1, so that a misplaced norm shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p))


def bitnet_config(vocab_size: int, *, hidden: int = 256, layers: int = 2, heads: int = 8, kv_heads: int = 4,
                  head_dim: int = 32, intermediate: int = 512, tie: bool = False):  # fmt: skip
    from transformers import BitNetConfig

    return BitNetConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, max_position_embeddings=256, tie_word_embeddings=tie,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def is_bitnet_layer(name: str) -> bool:
    return name.endswith("_proj.weight") and ".layers." in name


def tiny_bitnet(dst: str | os.PathLike, form: str = "bitlinear", *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                tie: bool = False, pow2_scales: bool = False, **shape) -> Path:  # fmt: skip
    """A random BitNetForCausalLM saved in ``form`` (one of BITNET_QUANT) with its tokenizer.

    The packed forms hold the ternarization of the same master weights:
    ``bitlinear``: weight_scale = s = 1 / mean|w| (it divides); ``autobitlinear``: weight_scale = 1 / s.
    ``pow2_scales`` rounds each weight_scale to a power of two, whose reciprocal every float type holds.
    """
    from safetensors.torch import save_file
    from transformers import BitNetForCausalLM
    from transformers.integrations.bitnet import pack_weights

    dst = Path(dst)
    tok = bpe_tokenizer(dst)
    model = BitNetForCausalLM(bitnet_config(len(tok), tie=tie, **shape)).eval()
    _randomize(model, seed)
    model.to(dtype)
    config = {**model.config.to_dict(), "architectures": ["BitNetForCausalLM"]}
    config["quantization_config"] = BITNET_QUANT[form]
    if form == "master":
        model.config.quantization_config = BITNET_QUANT[form]
        model.save_pretrained(str(dst))
        return dst
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    out = {}
    for name, w in state.items():
        if not is_bitnet_layer(name):
            out[name] = w
            continue
        wf = w.to(torch.float32)
        s = 1.0 / wf.abs().mean().clamp(min=1e-5)
        values = (wf * s).round().clamp(-1, 1).to(torch.int8)
        out[name] = pack_weights(values.clone())
        scale = s if form == "bitlinear" else 1.0 / s
        if pow2_scales:
            scale = torch.exp2(torch.round(torch.log2(scale)))
        out[name[: -len(".weight")] + ".weight_scale"] = scale.reshape(1).to(dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


# --- GGUF ---

GGUF_ARCHS = {
    # arch: (transformers config class, model class, extra shape kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    # transformers reads a qwen3 GGUF with Qwen3Config's default head_dim, 128
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}),
}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # fmt: skip


def ternary_per_256(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] made exactly ternary per 256-block: sign(w) * d where |w| > d/2, with one float16 d per block."""
    n, k = w.shape
    blocks = w.to(torch.float32).reshape(n, k // 256, 256)
    d = blocks.abs().mean(-1, keepdim=True).to(torch.float16).to(torch.float32)
    t = torch.where(blocks.abs() > d / 2, torch.sign(blocks), torch.zeros_like(blocks))
    t.reshape(-1, 256)[3::7] = 0  # some all-zero blocks
    return (t * d).reshape(n, k)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for llama's Q and K (its rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf(dst: str | os.PathLike, arch: str = "qwen3", qtype: str = "TQ2_0", *, seed: int = 0,
              hidden: int = 256, layers: int = 2, intermediate: int = 512, tie: bool = False,
              types: dict[str, str] | None = None, tamper: dict | None = None) -> tuple[Path, Path]:  # fmt: skip
    """(GGUF file, the Hugging Face folder it was made from) for a random ``arch`` model.

    The HF model's linear weights are exactly ternary per 256-block (:func:`ternary_per_256`), so
    writing them as ``qtype`` loses nothing: the file dequantizes to exactly the HF weights.
    ``types`` gives some GGUF tensors another type; ``tamper[name](bytes) -> bytes`` edits a
    quantized tensor's blocks before they are written.
    """
    import gguf
    import transformers

    dst = Path(dst)
    hf_dir = dst / "hf"
    tok = bpe_tokenizer(hf_dir)
    config_cls, model_cls, extra = GGUF_ARCHS[arch]
    config = getattr(transformers, config_cls)(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                                               num_hidden_layers=layers, max_position_embeddings=256,
                                               tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=10000.0,
                                               pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)  # fmt: skip
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.weight"):
                p.copy_(ternary_per_256(p))
            if name.endswith("_proj.bias"):
                p.copy_(p.to(torch.float16).to(torch.float32))
    model.save_pretrained(str(hf_dir))

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    path = dst / f"tiny-{arch}-{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for name, t in model.state_dict().items():
        a = t.to(torch.float32).numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a.astype(np.float16))
        elif name == "lm_head.weight":
            if not tie:
                w.add_tensor("output.weight", a.astype(np.float16))
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        else:
            _, _, layer, *part, kind = name.split(".")
            gg = f"blk.{layer}.{GGUF_NAMES[part[-1]]}.{kind}"
            if arch == "llama" and part[-1] in ("q_proj", "k_proj"):
                a = _permute(a, heads if part[-1] == "q_proj" else kv_heads)
            if a.ndim == 2:
                kind = getattr(gguf.GGMLQuantizationType, (types or {}).get(gg, qtype))
                data = gguf.quants.quantize(a, kind)
                if tamper and gg in tamper:
                    data = tamper[gg](data.copy())
                w.add_tensor(gg, data, raw_dtype=kind)
            else:
                w.add_tensor(gg, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf_dir


def tiny_bitnet_qwen3(dst: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """A random BitNet-style Qwen3 embedder: Qwen3Model whose projections are offline ``autobitlinear`` layers with
    ``use_rms_norm`` (an RMSNorm, ``<prefix>.rms_norm.weight``, before each), packed by transformers' pack_weights."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model
    from transformers.integrations.bitnet import pack_weights

    dst = Path(dst)
    tok = bpe_tokenizer(dst)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, intermediate_size=512, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = Qwen3Model(config).eval()
    _randomize(model, seed)
    model.to(dtype)
    out = {}
    for name, w in model.state_dict().items():
        if not name.endswith("_proj.weight"):
            out[name] = w.contiguous()
            continue
        prefix = name[: -len(".weight")]
        wf = w.to(torch.float32)
        s = 1.0 / wf.abs().mean().clamp(min=1e-5)
        out[name] = pack_weights((wf * s).round().clamp(-1, 1).to(torch.int8))
        out[prefix + ".weight_scale"] = (1.0 / s).reshape(1).to(dtype)
        out[prefix + ".rms_norm.weight"] = (1.0 + 0.2 * torch.randn(w.shape[1])).to(dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**config.to_dict(), "architectures": ["Qwen3Model"],
           "quantization_config": {**BITNET_QUANT["autobitlinear"], "use_rms_norm": True, "rms_norm_eps": 1e-6}}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst
