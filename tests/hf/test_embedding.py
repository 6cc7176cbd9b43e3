"""ternop.hf.embedding: pooling as sentence-transformers does it, and what a sentence-transformers folder says."""

from __future__ import annotations

import pytest
import torch

from ternop.hf import embedding
from tests.models import minilm_dir


def test_pool_modes_respect_padding():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mean = embedding.pool(hidden, right, "mean")
    expect = torch.nn.functional.normalize(hidden[0, :2].mean(0), dim=0)
    assert torch.allclose(mean[0], expect)
    last_r = embedding.pool(hidden, right, "lasttoken")
    last_l = embedding.pool(hidden, left, "lasttoken")
    assert torch.allclose(last_r[0], torch.nn.functional.normalize(hidden[0, 1], dim=0))
    assert torch.allclose(last_l[0], torch.nn.functional.normalize(hidden[0, 3], dim=0))
    assert torch.allclose(last_r[1], torch.nn.functional.normalize(hidden[1, 3], dim=0))
    with pytest.raises(ValueError, match="pooling"):
        embedding.pool(hidden, right, "max")


def test_pooling_and_length_from_a_sentence_transformers_folder(tmp_path):
    assert embedding.pooling_mode(minilm_dir()) == "mean"
    assert embedding.max_seq_length(minilm_dir()) == 256
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "max_position_embeddings": 128}')
    assert embedding.pooling_mode(tmp_path) == "lasttoken"
    assert embedding.max_seq_length(tmp_path) == 128  # 512 by default, capped by the position table
