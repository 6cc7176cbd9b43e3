"""The model a GPU distillation job carries (benchmarks/quality_minilm_gpu.py): shrunk here, restored there."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quality_minilm_gpu as job  # noqa: E402


def _state(table: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        table: torch.randn(10, 6, generator=g),
        "layers.0.mlp.up_proj.weight": torch.randn(8, 6, generator=g),
        "embeddings.position_ids": torch.arange(5).unsqueeze(0),
    }


@pytest.mark.parametrize("table", ["embeddings.word_embeddings.weight", "embed_tokens.weight",
                                   "model.embed_tokens.weight"])  # fmt: skip
def test_shrink_keeps_the_used_rows_of_the_table_and_unshrink_restores_them(table):
    state = _state(table)
    used = {7, 1, 3, 12}  # 12 is past the table, as EmbeddingGemma's image token is
    out, meta = job.shrink(state, used)
    prefix = table[: -len(".weight")]
    assert meta == {"full_rows": "10"}
    assert out[prefix + ".row_ids"].tolist() == [1, 3, 7]
    assert out[table].dtype == torch.int8 and out[table].shape == (3, 6)
    assert out["layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert torch.equal(out["embeddings.position_ids"], state["embeddings.position_ids"])

    back = job.unshrink(out, meta)
    assert set(back) == set(state)
    full = back[table]
    assert full.dtype == torch.float32 and full.shape == (10, 6)
    for i in range(10):
        if i in used:
            # absmax int8 per row: at most half a step (absmax / 254), plus the fp16 scale's rounding
            # (a relative 2^-11 of the scale, times at most 127 steps)
            bound = state[table][i].abs().max() * (1 / 254 + 2**-11)
            assert (full[i] - state[table][i]).abs().max() <= bound
        else:
            assert torch.count_nonzero(full[i]) == 0
    assert torch.equal(back["layers.0.mlp.up_proj.weight"], state["layers.0.mlp.up_proj.weight"].half().float())
    assert torch.equal(back["embeddings.position_ids"], state["embeddings.position_ids"])


def test_a_model_without_a_known_token_table_is_refused():
    state = _state("decoder.not_embed_tokens.weight")
    with pytest.raises(SystemExit, match="no token table"):
        job.shrink(state, {1})
