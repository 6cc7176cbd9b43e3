"""Sentence embeddings from Hugging Face models, pooled as the sentence-transformers folder says.

``pooling_mode`` and ``max_seq_length`` read a sentence-transformers folder (``modules.json``,
``1_Pooling/config.json``, ``sentence_bert_config.json``) without importing that package, so
transformers, vLLM and sentence-transformers all see the same inputs and pooling.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def pooling_mode(model_dir: str | os.PathLike) -> str:
    """'mean', 'cls' or 'lasttoken', from a sentence-transformers folder or else the model type."""
    d = Path(model_dir)
    pool_cfg = None
    if (d / "modules.json").exists():
        for m in json.loads((d / "modules.json").read_text()):
            if m.get("type", "").endswith("Pooling"):
                pool_cfg = d / m.get("path", "") / "config.json"
    if pool_cfg is not None and pool_cfg.exists():
        cfg = json.loads(pool_cfg.read_text())
        for key, mode in (("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_cls_token", "cls")):
            if cfg.get(key):
                return mode
        return "mean"
    model_type = json.loads((d / "config.json").read_text()).get("model_type", "")
    encoders = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta", "modernbert")
    return "mean" if model_type in encoders else "lasttoken"


def max_seq_length(model_dir: str | os.PathLike, default: int = 512) -> int:
    """sentence-transformers' ``max_seq_length`` (default 512), within the model's position table."""
    d = Path(model_dir)
    st = d / "sentence_bert_config.json"
    n = int(json.loads(st.read_text()).get("max_seq_length", default)) if st.exists() else default
    positions = json.loads((d / "config.json").read_text()).get("max_position_embeddings") or n
    return min(n, positions)


def token_ids(model_dir: str | os.PathLike, texts) -> list[list[int]]:
    """Token ids truncated as sentence-transformers does, so every backend sees the same input."""
    from ternop.hf.loading import load_tokenizer

    return load_tokenizer(model_dir)(list(texts), truncation=True, max_length=max_seq_length(model_dir))["input_ids"]


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """hidden ``[B, T, D]``, attention mask ``[B, T]`` -> L2-normalised ``[B, D]`` (differentiable)."""
    if pooling == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    elif pooling == "cls":
        emb = hidden[:, 0]
    elif pooling == "lasttoken":
        # Works for left and right padding: the last position whose mask is 1.
        idx = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
        emb = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]
    else:
        raise ValueError(f"pooling must be 'mean', 'cls' or 'lasttoken', got {pooling!r}")
    return torch.nn.functional.normalize(emb, dim=-1)


@torch.no_grad()
def embed_model(model, tokenizer, texts, pooling: str = "mean", batch_size: int = 32, max_length: int = 512):
    """Normalised sentence embeddings ``float32 [N, D]`` from an HF base model (``last_hidden_state``)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(
            list(texts[i : i + batch_size]), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        ).to(device)
        hidden = model(**batch).last_hidden_state.float()
        out.append(pool(hidden, batch["attention_mask"], pooling))
    return torch.cat(out).cpu()


def embed_texts(model_dir: str | os.PathLike, texts, *, dtype: torch.dtype = torch.float32, batch_size: int = 32,
                dense: bool = False) -> torch.Tensor:  # fmt: skip
    """Embeds ``texts`` with the model in ``model_dir`` (dense or ternary) -> normalised ``float32 [N, D]``."""
    from ternop.hf.loading import load_model, load_tokenizer

    model = load_model(model_dir, causal=False, dtype=dtype, dense=dense)
    return embed_model(model, load_tokenizer(model_dir), texts, pooling_mode(model_dir), batch_size,
                       max_seq_length(model_dir))  # fmt: skip
